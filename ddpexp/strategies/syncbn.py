"""Synchronized BatchNorm: batch statistics over the global batch (all ranks), not each rank's slice.

On CUDA this is PyTorch's `SyncBatchNorm`. PyTorch's implementation refuses CPU tensors, so on CPU
(gloo) we use `CPUSyncBatchNorm` below, which computes the same thing with plain all-reduces:

forward   per channel, all-reduce [sum x, sum x^2, count] -> global mean and (biased) variance;
          running statistics are updated with the unbiased global variance, as BatchNorm does.
backward  all-reduce [sum dy, sum dy*xhat] -> the input gradient of the global-batch BatchNorm.
          Weight and bias gradients stay local; the data-parallel wrapper averages them like any other
          parameter gradient.

With W ranks each holding b samples, this matches ordinary BatchNorm on the concatenated batch W*b:
outputs, parameter gradients (after gradient averaging) and running statistics.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .comm import Collective, CommMeter, Workload


def convert(model: nn.Module, device_type: str) -> nn.Module:
    """Replace every BatchNorm layer of `model` by its synchronized counterpart (in place)."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert_cpu(model)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def _convert_cpu(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        new = CPUSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, _convert_cpu(child))
    return module


def meter_into(model: nn.Module, meter: CommMeter) -> None:
    """The strategy's communication meter counts the statistics' all-reduces of the model's CPU
    synchronized BatchNorm layers (comm/bytes_per_step/sync_bn; torch's CUDA one is not metered)."""
    for module in model.modules():
        if isinstance(module, CPUSyncBatchNorm):
            module.meter = meter


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm over inputs (N, C, *) with statistics all-reduced across the default process group."""

    meter: CommMeter | None = None  # the strategy's, when it measures communication

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats or not (dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        momentum = self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBN.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if self.training else None,
            self.running_var if self.training else None,
            self.eps,
            momentum if momentum is not None else 0.0,
            self.meter,
        )


def _per_channel(t: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (C,) sums over every dimension but the channel one, accumulated in float64."""
    dims = [0, *range(2, t.dim())]
    return t.sum(dim=dims, dtype=torch.float64)


def _shape(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1, *([1] * (like.dim() - 2)))


class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        meter: CommMeter | None,
    ) -> torch.Tensor:
        local_count = x.numel() // x.size(1)
        count = torch.full((1,), float(local_count), dtype=torch.float64, device=x.device)
        stats = torch.cat([_per_channel(x), _per_channel(x * x), count])
        _all_reduce(stats, meter)
        c = x.size(1)
        total = stats[-1]
        mean = stats[:c] / total
        var = (stats[c : 2 * c] / total - mean * mean).clamp_min(0.0)
        if running_mean is not None and running_var is not None:
            unbiased = var * total / (total - 1).clamp_min(1.0)
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        xhat = (x - _shape(mean, x).to(x.dtype)) * _shape(invstd, x).to(x.dtype)
        out = xhat
        if weight is not None:
            out = out * _shape(weight, x)
        if bias is not None:
            out = out + _shape(bias, x)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total = total
        ctx.has_bias = bias is not None
        ctx.meter = meter
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        sum_dy = _per_channel(dy)
        sum_dy_xhat = _per_channel(dy * xhat)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(dy.dtype) if ctx.has_bias else None
        both = torch.cat([sum_dy, sum_dy_xhat])
        _all_reduce(both, ctx.meter)
        c = dy.size(1)
        mean_dy = both[:c] / ctx.total
        mean_dy_xhat = both[c:] / ctx.total
        scale = invstd if weight is None else invstd * weight.to(torch.float64)
        grad_x = (dy - _shape(mean_dy, dy).to(dy.dtype) - xhat * _shape(mean_dy_xhat, dy).to(dy.dtype)) * (
            _shape(scale, dy).to(dy.dtype)
        )
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def _all_reduce(t: torch.Tensor, meter: CommMeter | None) -> None:
    start = time.perf_counter()
    dist.all_reduce(t)
    if meter is not None:
        meter.record(start, time.perf_counter(), t.numel() * t.element_size(), kind="sync_bn")


def communication(model: nn.Module, job: Workload) -> list[Collective]:
    """What synchronized BatchNorm sends per optimizer step (for the cost model). On CPU (ours): per
    BatchNorm layer of C channels and per micro-batch, a forward all-reduce of [sum x, sum x^2, count]
    (2C+1 float64 values) and a backward one of [sum dy, sum dy*xhat] (2C), each waited for where it
    stands, metered (comm/bytes_per_step/sync_bn). torch's CUDA SyncBatchNorm all-gathers the
    statistics instead (fp32, of the same order) and is not metered."""
    channels = [m.num_features for m in model.modules() if isinstance(m, _BatchNorm)]
    if not channels or job.world < 2:
        return []
    calls = 2 * len(channels) * job.accumulate
    values = sum(4 * c + 1 for c in channels) * job.accumulate
    cpu = job.device_type == "cpu"
    nbytes = float(values * (8 if cpu else 4))
    return [
        Collective(
            f"sync_bn statistics ({len(channels)} layers, forward and backward"
            + ("" if cpu else "; not metered on CUDA")
            + ")",
            "all_reduce",
            nbytes,
            job.world,
            calls=calls,
            counted=nbytes if cpu else 0.0,
            inter_node=job.spans_nodes(job.world),
        )
    ]

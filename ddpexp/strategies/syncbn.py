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

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .comm import Collective, Workload


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


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm over inputs (N, C, *) with statistics all-reduced across the default process group."""

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
    ) -> torch.Tensor:
        local_count = x.numel() // x.size(1)
        count = torch.full((1,), float(local_count), dtype=torch.float64, device=x.device)
        stats = torch.cat([_per_channel(x), _per_channel(x * x), count])
        dist.all_reduce(stats)
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
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        sum_dy = _per_channel(dy)
        sum_dy_xhat = _per_channel(dy * xhat)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(dy.dtype) if ctx.has_bias else None
        both = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(both)
        c = dy.size(1)
        mean_dy = both[:c] / ctx.total
        mean_dy_xhat = both[c:] / ctx.total
        scale = invstd if weight is None else invstd * weight.to(torch.float64)
        grad_x = (dy - _shape(mean_dy, dy).to(dy.dtype) - xhat * _shape(mean_dy_xhat, dy).to(dy.dtype)) * (
            _shape(scale, dy).to(dy.dtype)
        )
        return grad_x, grad_weight, grad_bias, None, None, None, None


def communication(model: nn.Module, job: Workload) -> list[Collective]:
    """What synchronized BatchNorm sends per optimizer step (for the cost model): per BatchNorm layer of
    C channels and per micro-batch, a forward all-reduce of [sum x, sum x^2, count] (3C values) and a
    backward one of [sum dy, sum dy*xhat] (2C), fp32, each waited for where it stands. Not metered.
    (torch's CUDA SyncBatchNorm all-gathers instead; its bytes are of the same order.)"""
    channels = [m.num_features for m in model.modules() if isinstance(m, _BatchNorm)]
    if not channels or job.world < 2:
        return []
    calls = 2 * len(channels) * job.accumulate
    values = 5 * sum(channels) * job.accumulate
    return [
        Collective(
            f"sync_bn statistics ({len(channels)} layers, forward and backward; not metered)",
            "all_reduce",
            float(values * 4),
            job.world,
            calls=calls,
            inter_node=job.spans_nodes(job.world),
        )
    ]

"""naive_allreduce: data parallelism as the textbooks write it, without DDP. Rank 0's initial weights
are broadcast once; after every backward each gradient is averaged with its own all_reduce, one after
the other, with nothing overlapping the backward pass (or, with strategy.bucket_cap_mb, gradients
flattened into buckets of that size: bucketing without overlap). Compare it with `ddp` to see
what bucketing and overlap buy. (Unlike DDP it does not re-broadcast buffers every step: with
sync_bn, or without BatchNorm, there is nothing that could drift.)"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import Wrapped, maybe_sync_bn, refuse_extras
from .comm import CommMeter

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn

    from ..context import RunContext
    from ..validate import HostFacts

USES_PROCESS_GROUP = True


def devices_per_process(cfg: DictConfig, device_type: str, host: HostFacts) -> int:
    return 1


def check(cfg: DictConfig, device_type: str, host: HostFacts) -> None:
    refuse_extras(cfg, "naive_allreduce")


def wrap(model: nn.Module, *, ctx: RunContext, cfg: DictConfig) -> Wrapped:
    model = maybe_sync_bn(model, cfg, ctx.device.type).to(ctx.device)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=0)
    params = [p for p in model.parameters() if p.requires_grad]
    world = dist.get_world_size()
    groups = buckets(params, cfg.strategy.bucket_cap_mb)
    meter = CommMeter() if cfg.trainer.measure_comm else None
    cuda = ctx.device.type == "cuda"

    def sync_grads() -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # keep every rank issuing the same collectives
        if meter is not None and cuda:
            torch.cuda.synchronize()  # time the reductions, not the backward still queued before them
        start = time.perf_counter()
        nbytes = 0
        for group in groups:
            if len(group) == 1:
                grad = group[0].grad
                assert grad is not None
                dist.all_reduce(grad)
                grad.div_(world)
                nbytes += grad.numel() * grad.element_size()
                continue
            flat = torch.cat([p.grad.flatten() for p in group])  # type: ignore[union-attr]
            dist.all_reduce(flat)
            flat.div_(world)
            nbytes += flat.numel() * flat.element_size()
            offset = 0
            for p in group:
                assert p.grad is not None
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        if meter is not None:
            if cuda:
                torch.cuda.synchronize()
            meter.record(start, time.perf_counter(), nbytes)

    return Wrapped(module=model, base=model, sync_grads=sync_grads, comm=meter)


def buckets(params: list[torch.nn.Parameter], cap_mb: float | None) -> list[list[torch.nn.Parameter]]:
    """One parameter per all-reduce (cap None), or consecutive parameters packed up to cap_mb each
    (in reverse order, like DDP: the last layers' gradients are ready first)."""
    if cap_mb is None:
        return [[p] for p in params]
    cap = cap_mb * 2**20
    groups: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if groups[-1] and size + nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups

"""naive_allreduce: data parallelism as the textbooks write it, without DDP. Rank 0's initial weights
are broadcast once; after every backward each gradient is averaged with its own all_reduce, one after
the other, with nothing overlapping the backward pass (or, with strategy.bucket_cap_mb, gradients
flattened into buckets of that size: bucketing without overlap). Compare it with `ddp` to see
what bucketing and overlap buy. (Unlike DDP it does not re-broadcast buffers every step: with
sync_bn, or without BatchNorm, there is nothing that could drift.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..config import StrategyConfig
from ..errors import require_positive
from . import Strategy, Wrapped, maybe_sync_bn, register
from .comm import CommMeter

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext
    from ..validate import HostFacts, Plan


@dataclass
class NaiveAllreduceConfig(StrategyConfig):
    name: str = "naive_allreduce"
    # Convert BatchNorm layers to synchronized BatchNorm (statistics over the global batch).
    sync_bn: bool = False
    # None: one all_reduce per parameter; a size in MB: gradients flattened into buckets of that size.
    bucket_cap_mb: float | None = None


@register
class NaiveAllreduce(Strategy[NaiveAllreduceConfig]):
    name = "naive_allreduce"
    schema = NaiveAllreduceConfig

    def check(self, settings: NaiveAllreduceConfig, *, plan: Plan, host: HostFacts) -> None:
        require_positive({}, {"strategy.bucket_cap_mb": settings.bucket_cap_mb})

    def wrap(
        self, model: nn.Module, settings: NaiveAllreduceConfig, *, ctx: RunContext, measure_comm: bool
    ) -> Wrapped:
        model = maybe_sync_bn(model, settings.sync_bn, ctx.device.type).to(ctx.device)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
        params = [p for p in model.parameters() if p.requires_grad]
        meter = CommMeter() if measure_comm else None
        return Wrapped(
            module=model,
            base=model,
            sync_grads=averager(params, buckets(params, settings.bucket_cap_mb), meter, ctx.device),
            comm=meter,
        )


def averager(
    params: list[torch.nn.Parameter],
    groups: list[list[torch.nn.Parameter]],
    meter: CommMeter | None,
    device: torch.device,
) -> Callable[[], None]:
    """The step's gradient averaging: one all_reduce per group, one after the other, after backward."""
    world = dist.get_world_size()
    cuda = device.type == "cuda"

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

    return sync_grads


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

"""naive_allreduce: data parallelism as the textbooks write it, without DDP. Rank 0's initial weights
are broadcast once; after every backward each gradient is averaged with its own all_reduce, one after
the other, with nothing overlapping the backward pass. Compare it with `ddp` to see what bucketing and
overlap buy. (Unlike DDP it does not re-broadcast buffers every step: with sync_bn, or without
BatchNorm, there is nothing that could drift.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import Wrapped, maybe_sync_bn, refuse_extras

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

    def sync_grads() -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # keep every rank issuing the same collectives
            dist.all_reduce(p.grad)
            p.grad.div_(world)

    return Wrapped(module=model, base=model, sync_grads=sync_grads)

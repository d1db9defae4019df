"""ddp_mp: DDP combined with model parallelism. Each process owns K devices (strategy.stages); the
model's `stages()` are grouped into K consecutive parts placed one per device, activations move from
device to device, and DDP wraps the multi-device module (no device_ids). G GPUs => G/K processes.
On CPU every part sits on the CPU, so the same code path runs and is tested without GPUs."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import UserError
from . import Wrapped, maybe_sync_bn, refuse_extras
from .ddp import bucket_kwargs, measure

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from ..context import RunContext
    from ..validate import HostFacts

USES_PROCESS_GROUP = True


def devices_per_process(cfg: DictConfig, device_type: str, host: HostFacts) -> int:
    return int(cfg.strategy.stages)


def check(cfg: DictConfig, device_type: str, host: HostFacts) -> None:
    refuse_extras(cfg, "ddp_mp")
    if cfg.strategy.stages < 1:
        raise UserError(
            f"must be at least 1, got {cfg.strategy.stages}",
            setting="strategy.stages",
            fix="use strategy.stages=2 (devices per process)",
        )


def check_model(model: nn.Module, cfg: DictConfig) -> None:
    k = cfg.strategy.stages
    stages = getattr(model, "stages", None)
    if not callable(stages):
        raise UserError(
            f"{type(model).__name__} does not say how to split into stages (no stages() method)",
            setting="strategy",
            fix="use a model that defines stages() (convnet, mlp), or strategy=ddp",
        )
    n = len(stages())
    if n < k:
        raise UserError(
            f"{type(model).__name__} splits into at most {n} stages, not {k}",
            setting="strategy.stages",
            fix=f"use strategy.stages<={n}",
        )


class Pipeline(nn.Module):
    """Consecutive parts of one model on consecutive devices; the forward pass moves activations along."""

    def __init__(self, parts: list[nn.Module], devices: list[torch.device]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(part.to(device) for part, device in zip(parts, devices, strict=True))
        self.devices = devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part, device in zip(self.parts, self.devices, strict=True):
            x = part(x.to(device, non_blocking=True))
        return x


def group(stages: list[nn.Module], k: int) -> list[nn.Module]:
    """K consecutive groups of stages, balanced by parameter count (each group at least one stage)."""
    sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
    total = sum(sizes) or 1
    bounds: list[int] = []
    acc = 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        remaining_groups = k - 1 - len(bounds)
        must_cut = len(stages) - (i + 1) == remaining_groups  # as many stages left as groups to fill
        if remaining_groups > 0 and (acc >= total * (len(bounds) + 1) / k or must_cut):
            bounds.append(i + 1)
    edges = [0, *bounds, len(stages)]
    return [nn.Sequential(*stages[a:b]) for a, b in itertools.pairwise(edges)]


def wrap(model: nn.Module, *, ctx: RunContext, cfg: DictConfig) -> Wrapped:
    model = maybe_sync_bn(model, cfg, ctx.device.type)
    parts = group(list(model.stages()), cfg.strategy.stages)  # type: ignore[operator]
    pipeline = Pipeline(parts, list(ctx.devices))
    ddp = DistributedDataParallel(pipeline, **bucket_kwargs(cfg))  # multi-device module: no device_ids
    return Wrapped(module=ddp, base=model, no_sync=ddp.no_sync, eval_module=pipeline, comm=measure(ddp, cfg))

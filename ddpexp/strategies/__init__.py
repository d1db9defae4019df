"""Strategies: one small module per way of spreading training over devices.

Every module exposes the same tiny interface:

- ``USES_PROCESS_GROUP``: whether it runs as one process per rank with torch.distributed;
- ``devices_per_process(cfg, device_type, host) -> int``: devices one process drives (launch arithmetic);
- ``check(cfg, device_type, host) -> None``: refuse combinations that cannot work, before launch;
- ``check_model(model, cfg) -> None`` (optional): refuse a model it cannot handle (built on "meta");
- ``wrap(model, *, ctx, cfg) -> Wrapped``: put the model on its device(s) and wrap it.

Adding a strategy = one module here + one YAML in conf/strategy/ + one line in STRATEGIES.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import ModuleType

from omegaconf import DictConfig
from torch import nn

from ..errors import UserError
from .comm import CommMeter

log = logging.getLogger(__name__)

STRATEGIES: dict[str, str] = {
    "single": "ddpexp.strategies.single",
    "dp": "ddpexp.strategies.dp",
    "ddp": "ddpexp.strategies.ddp",
    "ddp_mp": "ddpexp.strategies.ddp_mp",
    "naive_allreduce": "ddpexp.strategies.naive_allreduce",
}


def get(name: str) -> ModuleType:
    if name not in STRATEGIES:
        raise UserError(
            f"unknown strategy {name!r}",
            setting="strategy",
            fix=f"choose one of: {', '.join(STRATEGIES)}",
        )
    return importlib.import_module(STRATEGIES[name])


@dataclass
class Wrapped:
    """What the engine trains, so that it never needs to know which strategy it runs.

    ``module`` is called for training forward passes; ``base`` is the plain model underneath (its
    state_dict is what checkpoints hold); ``eval_module`` runs evaluation on this process's shard
    without any collective (default: ``base``; a multi-device pipeline for model parallelism).
    ``no_sync`` suppresses gradient synchronisation for all but the last micro-batch of an
    accumulated step; ``sync_grads`` runs after the last backward of a step, before the optimizer.
    """

    module: nn.Module
    base: nn.Module
    no_sync: Callable[[], AbstractContextManager[object]] = field(default=nullcontext)
    sync_grads: Callable[[], None] = field(default=lambda: None)
    eval_module: nn.Module | None = None
    comm: CommMeter | None = None  # set by strategies that communicate gradients (and measure it)

    def __post_init__(self) -> None:
        if self.eval_module is None:
            self.eval_module = self.base


def refuse_sync_bn(cfg: DictConfig, name: str) -> None:
    if cfg.strategy.sync_bn:
        raise UserError(
            f"strategy {name} has no process group to synchronize BatchNorm over",
            setting="strategy.sync_bn",
            fix="use strategy=ddp (or ddp_mp, naive_allreduce) with sync_bn, or strategy.sync_bn=false",
        )


def refuse_extras(cfg: DictConfig, name: str) -> None:
    """Settings that belong to one strategy only must not be silently ignored by the others."""
    if name not in ("ddp", "ddp_mp", "naive_allreduce") and cfg.strategy.get("bucket_cap_mb") is not None:
        raise UserError(
            f"bucket_cap_mb sizes gradient all-reduce buckets; strategy {name} has none",
            setting="strategy.bucket_cap_mb",
            fix="use it with ddp, ddp_mp or naive_allreduce",
        )
    ddp_only = {
        "gradient_as_bucket_view": True,
        "static_graph": False,
        "broadcast_buffers": None,
        "find_unused_parameters": False,
    }
    changed = [k for k, default in ddp_only.items() if cfg.strategy.get(k, default) != default]
    if name not in ("ddp", "ddp_mp") and changed:
        raise UserError(
            f"{changed[0]} is a DistributedDataParallel setting; strategy {name} does not use DDP",
            setting=f"strategy.{changed[0]}",
            fix="use it with strategy=ddp or ddp_mp",
        )
    if name != "dp" and cfg.strategy.device_ids is not None:
        raise UserError(
            f"device_ids is a DataParallel setting; strategy {name} does not use it",
            setting="strategy.device_ids",
            fix="use strategy=dp, or select devices with CUDA_VISIBLE_DEVICES",
        )


def maybe_sync_bn(model: nn.Module, cfg: DictConfig, device_type: str) -> nn.Module:
    """Convert BatchNorm to synchronized BatchNorm when strategy.sync_bn is set (before wrapping)."""
    if not cfg.strategy.sync_bn:
        return model
    from . import syncbn

    if not syncbn.has_batchnorm(model):
        log.warning("strategy.sync_bn=true but the model has no BatchNorm layer: nothing to synchronize")
    return syncbn.convert(model, device_type)

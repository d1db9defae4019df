"""single: one process, one device, no communication: the baseline every other strategy is compared to."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import Wrapped, refuse_extras, refuse_sync_bn

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn

    from ..context import RunContext
    from ..validate import HostFacts

USES_PROCESS_GROUP = False


def devices_per_process(cfg: DictConfig, device_type: str, host: HostFacts) -> int:
    return 1


def check(cfg: DictConfig, device_type: str, host: HostFacts) -> None:
    refuse_sync_bn(cfg, "single")
    refuse_extras(cfg, "single")


def wrap(model: nn.Module, *, ctx: RunContext, cfg: DictConfig) -> Wrapped:
    model = model.to(ctx.device)
    return Wrapped(module=model, base=model)

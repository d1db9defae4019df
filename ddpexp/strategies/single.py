"""single: one process, one device, no communication: the baseline every other strategy is compared to."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import Wrapped

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext
    from ..validate import HostFacts

USES_PROCESS_GROUP = False


def devices_per_process(cfg: object) -> int:
    return 1


def check(cfg: object, host: HostFacts) -> None:
    return None


def wrap(model: nn.Module, *, ctx: RunContext, cfg: object) -> Wrapped:
    model = model.to(ctx.device)
    return Wrapped(module=model, base=model)

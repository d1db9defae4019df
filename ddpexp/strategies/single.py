"""single: one process, one device, no communication: the baseline every other strategy is compared to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import StrategyConfig
from ..errors import UserError
from . import Strategy, Wrapped, register
from .comm import Workload

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext


@dataclass
class SingleConfig(StrategyConfig):
    """single has no settings of its own."""


@register
class Single(Strategy[SingleConfig]):
    name = "single"
    schema = SingleConfig
    uses_process_group = False

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = model.to(ctx.device)
        return Wrapped(module=model, base=model)

    def compute_share(self, *, job: Workload) -> float:
        if job.devices != 1:
            raise UserError(
                "single runs on one device", setting="devices", fix="use ddp (or fsdp...) for more"
            )
        return 1.0

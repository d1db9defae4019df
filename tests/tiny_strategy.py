"""A strategy written outside the package, the way a user would add one: one module (its config
dataclass, its class, @register) and one YAML (tests/conf/strategy/tiny.yaml, which names this module).

`tiny`: data parallelism by hand. Every rank starts from rank 0's weights; after backward, all
gradients are flattened into one buffer and summed over the ranks with a single all_reduce, then
divided by the world size (`average: true`) or left as the sum (`average: false`, which is wrong on
purpose: it lets a test see that the setting reaches the strategy). It logs a scalar of its own each
epoch, `tiny/grad_norm` (the norm of the last step's synchronised gradient), and declares the report's
column for it: nothing in the package names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ddpexp.config import StrategyConfig
from ddpexp.strategies import ReportColumn, Strategy, Wrapped, register

if TYPE_CHECKING:
    from ddpexp.context import RunContext


@dataclass
class TinyConfig(StrategyConfig):
    average: bool = True  # divide the summed gradients by the world size


@register
class Tiny(Strategy[TinyConfig]):
    name = "tiny"
    schema = TinyConfig
    report_columns = (ReportColumn("tiny: grad norm", ("tiny/grad_norm",), ("{:.4f}",)),)

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = model.to(ctx.device)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        params = [p for p in model.parameters() if p.requires_grad]
        divisor = dist.get_world_size() if self.settings.average else 1
        last_norm = [0.0]

        def sync_grads() -> None:
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]
            )
            dist.all_reduce(flat)
            flat.div_(divisor)
            last_norm[0] = flat.norm().item()
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()

        return Wrapped(
            module=model,
            base=model,
            sync_grads=sync_grads,
            extra_metrics=lambda: {"tiny/grad_norm": last_norm[0]},
        )

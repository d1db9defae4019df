"""dp: torch.nn.DataParallel in one process. Every step scatters the global batch over the GPUs,
replicates the model onto each, gathers the outputs on the first, and reduces gradients there. On a
machine without GPUs it runs as a single replica on the CPU (said at start, recorded as replicas=1),
so CPU sweeps that include dp still complete."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.nn import DataParallel

from ..config import StrategyConfig
from ..errors import UserError
from . import Strategy, Wrapped, register
from .comm import Collective, Workload, parameter_bytes

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext
    from ..plan import HostFacts, Plan

log = logging.getLogger(__name__)


@dataclass
class DpConfig(StrategyConfig):
    # The GPUs DataParallel replicates over (None: every visible GPU); the first gathers the outputs.
    device_ids: list[int] | None = None


@register
class Dp(Strategy[DpConfig]):
    name = "dp"
    schema = DpConfig
    uses_process_group = False

    def devices_per_process(self, *, device_type: str, host: HostFacts) -> int:
        if device_type != "cuda":
            return 1
        return len(self.settings.device_ids) if self.settings.device_ids is not None else host.cuda_devices

    def pinned_devices(self) -> tuple[int, ...]:
        return tuple(self.settings.device_ids or ())

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        ids = self.settings.device_ids
        if ids is None:
            return
        if plan.device_type != "cuda":
            raise UserError(
                "device_ids needs GPUs and this run is on the CPU",
                setting="strategy.device_ids",
                fix="leave strategy.device_ids unset on CPU (dp then runs one CPU replica)",
            )
        bad = [i for i in ids if not 0 <= i < host.cuda_devices]
        if not ids or bad or len(set(ids)) != len(ids):
            raise UserError(
                f"{list(ids)} is not a list of distinct visible GPUs (0..{host.cuda_devices - 1})",
                setting="strategy.device_ids",
                fix=f"use ids from 0 to {host.cuda_devices - 1}, or null for all",
            )

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = model.to(ctx.device)
        if ctx.device.type == "cuda":
            dp = DataParallel(model, device_ids=[d.index for d in ctx.devices], output_device=ctx.device)
        else:
            log.warning("dp: no GPU in this run, so DataParallel runs a single replica on the CPU")
            dp = DataParallel(model)  # without GPUs DataParallel simply calls the module
        return Wrapped(module=dp, base=model, eval_module=dp)

    def communication(self, *, job: Workload) -> list[Collective]:
        """DataParallel's copies inside one process, per micro-batch: the model replicated from the
        first GPU to the others before the forward (a broadcast of the parameters), the gradients
        summed back onto it after the backward (a reduce, costed as a broadcast: the same bytes over
        the same links). The inputs' scatter and the outputs' gather are left out (a batch's inputs
        are usually far smaller than the model). Nothing hides: the replicas wait for both. On a CPU
        dp runs one replica and sends nothing."""
        _one_node(job)
        if job.device_type != "cuda" or job.devices < 2:
            return []
        size = float(parameter_bytes(job.model) * job.accumulate)
        return [
            Collective(
                "parameters replicated from the first GPU (not metered)",
                "broadcast",
                size,
                job.devices,
                calls=job.accumulate,
            ),
            Collective(
                "gradients summed onto the first GPU (not metered)",
                "broadcast",
                size,
                job.devices,
                calls=job.accumulate,
            ),
        ]

    def compute_share(self, *, job: Workload) -> float:
        _one_node(job)
        return 1.0 / job.devices if job.device_type == "cuda" else 1.0


def _one_node(job: Workload) -> None:
    if job.nodes > 1:
        raise UserError("dp is one process on one machine", setting="nodes", fix="use ddp for several nodes")

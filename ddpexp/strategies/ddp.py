"""ddp: one process per device, DistributedDataParallel averages gradients with bucketed all-reduces
that overlap the backward pass. Initial weights are broadcast from rank 0 when the wrapper is built."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.nn.parallel import DistributedDataParallel

from ..config import StrategyConfig
from ..errors import require_positive
from . import Strategy, Wrapped, maybe_sync_bn, register
from .comm import CommMeter, timed_allreduce_hook

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext
    from ..validate import HostFacts, Plan

SYNC_BUFFERS_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


@dataclass
class DdpConfig(StrategyConfig):
    name: str = "ddp"
    # Convert BatchNorm layers to synchronized BatchNorm (statistics over the global batch).
    sync_bn: bool = False
    # DDP's gradient bucket size in MB (None: DDP's default, 25).
    bucket_cap_mb: float | None = None
    # DistributedDataParallel settings. gradient_as_bucket_view saves a gradient copy; static_graph
    # lets DDP optimise a graph that never changes; broadcast_buffers (None: on, except with sync_bn,
    # where BatchNorm statistics are already global) re-sends rank 0's buffers each forward;
    # find_unused_parameters is for models whose forward skips parameters (slower).
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    broadcast_buffers: bool | None = None
    find_unused_parameters: bool = False


@register
class DDP(Strategy[DdpConfig]):
    name = "ddp"
    schema = DdpConfig

    def check(self, settings: DdpConfig, *, plan: Plan, host: HostFacts) -> None:
        require_positive({}, {"strategy.bucket_cap_mb": settings.bucket_cap_mb})

    def wrap(self, model: nn.Module, settings: DdpConfig, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = maybe_sync_bn(model, settings.sync_bn, ctx.device.type).to(ctx.device)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs(settings))
        return Wrapped(
            module=ddp, base=model, no_sync=ddp.no_sync, comm=measure(ddp) if measure_comm else None
        )


def ddp_kwargs(settings: DdpConfig) -> dict[str, Any]:
    """DistributedDataParallel's keyword arguments from the settings (shared with ddp_mp)."""
    s = settings
    sync_buffers = (not s.sync_bn) if s.broadcast_buffers is None else s.broadcast_buffers
    kwargs: dict[str, Any] = {
        "gradient_as_bucket_view": s.gradient_as_bucket_view,
        "static_graph": s.static_graph,
        # Newer torch renames the per-forward re-broadcast (and warns on the old name); the buffers are
        # synced at wrap time either way, which is what we want (every rank starts from rank 0's).
        SYNC_BUFFERS_ARG: sync_buffers,
        "find_unused_parameters": s.find_unused_parameters,
    }
    if s.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = float(s.bucket_cap_mb)
    return kwargs


def measure(ddp: DistributedDataParallel) -> CommMeter:
    meter = CommMeter()
    ddp.register_comm_hook(None, timed_allreduce_hook(meter))
    return meter

"""ddp: one process per device, DistributedDataParallel averages gradients with bucketed all-reduces
that overlap the backward pass. Initial weights are broadcast from rank 0 when the wrapper is built."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from torch.nn.parallel import DistributedDataParallel

from . import Wrapped, maybe_sync_bn, refuse_extras
from .comm import CommMeter, timed_allreduce_hook

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn

    from ..context import RunContext
    from ..validate import HostFacts

USES_PROCESS_GROUP = True
SYNC_BUFFERS_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


def devices_per_process(cfg: DictConfig, device_type: str, host: HostFacts) -> int:
    return 1


def check(cfg: DictConfig, device_type: str, host: HostFacts) -> None:
    refuse_extras(cfg, "ddp")


def wrap(model: nn.Module, *, ctx: RunContext, cfg: DictConfig) -> Wrapped:
    model = maybe_sync_bn(model, cfg, ctx.device.type).to(ctx.device)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, **bucket_kwargs(cfg))
    return Wrapped(module=ddp, base=model, no_sync=ddp.no_sync, comm=measure(ddp, cfg))


def bucket_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """DistributedDataParallel's keyword arguments from strategy.* (shared with ddp_mp)."""
    s = cfg.strategy
    sync_buffers = (not s.sync_bn) if s.broadcast_buffers is None else bool(s.broadcast_buffers)
    kwargs: dict[str, Any] = {
        "gradient_as_bucket_view": bool(s.gradient_as_bucket_view),
        "static_graph": bool(s.static_graph),
        # Newer torch renames the per-forward re-broadcast (and warns on the old name); the buffers are
        # synced at wrap time either way, which is what we want (every rank starts from rank 0's).
        SYNC_BUFFERS_ARG: sync_buffers,
        "find_unused_parameters": bool(s.find_unused_parameters),
    }
    if s.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = float(s.bucket_cap_mb)
    return kwargs


def measure(ddp: DistributedDataParallel, cfg: DictConfig) -> CommMeter | None:
    if not cfg.trainer.measure_comm:
        return None
    meter = CommMeter()
    ddp.register_comm_hook(None, timed_allreduce_hook(meter))
    return meter

"""ddp: one process per device, DistributedDataParallel averages gradients with bucketed all-reduces
that overlap the backward pass. Initial weights are broadcast from rank 0 when the wrapper is built.

strategy.comm_hook compresses what the all-reduces send, with torch's DDP communication hooks:
fp16/bf16 cast each bucket to that dtype (half the bytes), powersgd sends a rank-`powersgd_rank`
factorisation of each gradient matrix after `powersgd_start_iter` full-precision steps (PowerSGD,
Vogels et al. 2019, with error feedback). With trainer.measure_comm the chosen hook is wrapped in a
timing hook that records the bytes it actually sends (comm.py). ddp_mp and zero share all of this.

PowerSGD's state (its step count, error feedback, warm-start factors) is not in checkpoints, and a
resumed run says so (`warn_powersgd_restarts`). Saving it would not restore it: PowerSGD keys that state
by DDP bucket, and DDP rebuilds its buckets after the first step (by the order the gradients became
ready; ResNet-18: one bucket in step 1, three from step 2), so a resumed run's first step has other
buckets than the ones the saved tensors belong to."""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import distributed
from ..errors import UserError, require_positive
from . import DataParallelConfig, Strategy, Wrapped, maybe_sync_bn, register, syncbn
from .comm import (
    Collective,
    CommMeter,
    Overlap,
    SentBytes,
    Workload,
    buffer_bytes,
    buffer_bytes_of,
    parameter_bytes,
    powersgd_bytes,
    powersgd_elements,
    tensor_bytes,
    timed_call,
    timed_hook,
)

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext
    from ..plan import HostFacts, Plan

log = logging.getLogger(__name__)

# Where register_comm_hook leaves the PowerSGD hook's state on the DistributedDataParallel module.
POWERSGD_STATE = "ddpexp_powersgd_state"

SYNC_BUFFERS_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


class CommHook(StrEnum):
    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"
    powersgd = "powersgd"


@dataclass
class DdpConfig(DataParallelConfig):
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
    # Gradient compression (a DDP communication hook): none | fp16 | bf16 (buckets all-reduced in that
    # dtype: half the bytes) | powersgd (low-rank: P and Q of rank powersgd_rank per gradient matrix,
    # after powersgd_start_iter uncompressed steps; at least 2, for its error feedback and warm start).
    comm_hook: CommHook = CommHook.none
    powersgd_rank: int = 1
    powersgd_start_iter: int = 10


@register
class Ddp(Strategy[DdpConfig]):
    name = "ddp"
    schema = DdpConfig

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        check_settings(self.settings)

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = maybe_sync_bn(model, self.settings.sync_bn, ctx.device.type).to(ctx.device)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs(self.settings))
        meter = register_comm_hook(ddp, self.settings, measure=measure_comm)
        return Wrapped(module=ddp, base=model, no_sync=ddp.no_sync, comm=meter)

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        warn_powersgd_restarts(wrapped)  # called when training resumes from a checkpoint
        super().load_optimizer_state(wrapped, optimizer, state)

    def communication(self, *, job: Workload) -> list[Collective]:
        return ddp_communication(self.settings, job=job)


# DDP's first gradient bucket (the last layers') is capped at 1 MiB when bucket_cap_mb is left at its
# default (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), the others at 25 MiB.
FIRST_BUCKET_BYTES = 2**20
DEFAULT_BUCKET_MB = 25.0
# PowerSGDState's default: compress a matrix only where that makes it at least 2x smaller.
POWERSGD_MIN_COMPRESSION = 2.0


def ddp_communication(settings: DdpConfig, *, job: Workload) -> list[Collective]:
    """DDP's communication per optimizer step (shared with ddp_mp and zero), as the meter counts it:

    - the gradient all-reduce: every trained parameter's gradient once per step, in buckets launched as
      the backward pass makes them ready (so they may hide behind it, except the last bucket's). Bytes
      as `register_comm_hook` sends them: fp32 (none), half of that (fp16/bf16), or PowerSGD's after its
      `powersgd_start_iter` uncompressed steps (`powersgd_elements`: P and Q of every matrix it
      compresses, the rest in full; three all-reduces per bucket; waited for one bucket at a time off
      NCCL, so there nothing hides behind backward). PowerSGD's own compute (its orthogonalisation)
      is not communication and is not modelled.
    - with sync_bn, the BatchNorm statistics' all-reduces (`syncbn.communication`);
    - the buffers (BatchNorm statistics) broadcast from rank 0 before the forward of the micro-batch
      that synchronises gradients (not under no_sync: DDP syncs buffers only where it syncs gradients),
      where DDP re-sends them (broadcast_buffers: on unless sync_bn); metered (`meter_buffer_broadcast`,
      kind buffers).
    """
    model = job.model
    full = parameter_bytes(model)
    elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
    element_size = full // elements if elements else 4
    cap = (settings.bucket_cap_mb or DEFAULT_BUCKET_MB) * 2**20
    first = FIRST_BUCKET_BYTES if settings.bucket_cap_mb is None else cap
    buckets = 1 + math.ceil(max(full - first, 0) / cap)
    calls, overlaps, what = buckets, Overlap.backward, "gradient all-reduce (DDP buckets)"
    sent = float(full)
    if settings.comm_hook in (CommHook.fp16, CommHook.bf16):
        sent, what = elements * 2.0, f"gradient all-reduce in {settings.comm_hook.value} (DDP buckets)"
    elif settings.comm_hook == CommHook.powersgd:
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        sent = float(
            powersgd_elements(shapes, settings.powersgd_rank, POWERSGD_MIN_COMPRESSION) * element_size
        )
        calls, what = 3 * buckets, f"PowerSGD rank-{settings.powersgd_rank} factors (after its start steps)"
        if job.device_type != "cuda":
            overlaps = Overlap.none  # one bucket at a time off NCCL: the backward waits for each
    spans = job.spans_nodes(job.world)
    out = [Collective(what, "all_reduce", sent, job.world, calls, overlaps, counted=sent, inter_node=spans)]
    if settings.sync_bn:
        out += syncbn.communication(model, job)
    sync_buffers = (
        (not settings.sync_bn) if settings.broadcast_buffers is None else settings.broadcast_buffers
    )
    buffers = buffer_bytes_of(model)
    if sync_buffers and buffers:
        out.append(
            Collective(
                "buffer broadcast before the step's last forward",
                "broadcast",
                float(buffers),
                job.world,
                counted=float(buffers),
                inter_node=spans,
            )
        )
    return out


def check_settings(settings: DdpConfig) -> None:
    """The DDP settings' own refusals (shared with ddp_mp and zero)."""
    require_positive(
        {"strategy.powersgd_rank": settings.powersgd_rank}, {"strategy.bucket_cap_mb": settings.bucket_cap_mb}
    )
    if settings.comm_hook == CommHook.powersgd and settings.powersgd_start_iter < 2:
        raise UserError(
            f"PowerSGD needs at least 2 uncompressed steps before it compresses (its error feedback "
            f"and warm start), got powersgd_start_iter={settings.powersgd_start_iter}",
            setting="strategy.powersgd_start_iter",
            fix="set strategy.powersgd_start_iter to 2 or more",
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


def register_comm_hook(
    ddp: DistributedDataParallel, settings: DdpConfig, *, measure: bool
) -> CommMeter | None:
    """Install strategy.comm_hook on `ddp` (none: DDP's own all-reduce), wrapped in the timing hook
    when communication is measured; the meter, or None when it is not."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    state: Any = None  # the default and fp16/bf16 hooks take the process group: None = the world
    hook: Any = default_hooks.allreduce_hook
    sent: SentBytes = buffer_bytes()
    casts = {
        CommHook.fp16: (default_hooks.fp16_compress_hook, torch.float16),
        CommHook.bf16: (default_hooks.bf16_compress_hook, torch.bfloat16),
    }
    if settings.comm_hook in casts:
        hook, dtype = casts[settings.comm_hook]
        sent = buffer_bytes(dtype)
    elif settings.comm_hook == CommHook.powersgd:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=settings.powersgd_rank,
            start_powerSGD_iter=settings.powersgd_start_iter,
        )
        hook, sent = powerSGD_hook.powerSGD_hook, powersgd_bytes(state)
        if not _nccl(ddp):
            hook = one_bucket_at_a_time(hook)
        setattr(ddp, POWERSGD_STATE, state)
    if not measure:
        if settings.comm_hook != CommHook.none:
            ddp.register_comm_hook(state, hook)
        return None
    meter = CommMeter()
    ddp.register_comm_hook(state, timed_hook(meter, hook, sent))
    meter_buffer_broadcast(ddp, meter)
    return meter


def meter_buffer_broadcast(ddp: DistributedDataParallel, meter: CommMeter) -> None:
    """Count and time the broadcast of rank 0's buffers (BatchNorm statistics) that DDP issues before
    each forward that will synchronise gradients (broadcast_buffers; none under no_sync). DDP sends it,
    synchronously, through `_default_broadcast_coalesced` (its broadcast when it was built ran before
    this): wrapped on this instance, every one is seen."""
    inner = getattr(ddp, "_default_broadcast_coalesced", None)
    if inner is None:  # a torch whose DDP broadcasts otherwise: leave it unmetered, and say so
        log.warning("this torch's DDP has no _default_broadcast_coalesced: its buffer broadcast is unmetered")
        return

    def nbytes() -> int:  # DDP re-reads the module's buffers before each broadcast: so does this
        return tensor_bytes(ddp.modules_buffers)

    ddp._default_broadcast_coalesced = timed_call(meter, inner, nbytes, "buffers")  # type: ignore[method-assign]


def _nccl(ddp: DistributedDataParallel) -> bool:
    """Whether the gradients are reduced with NCCL (CUDA tensors, an NCCL process group)."""
    import torch.distributed as dist

    on_cuda = next(ddp.module.parameters()).device.type == "cuda"
    return on_cuda and "nccl" in str(dist.get_backend(ddp.process_group))


def one_bucket_at_a_time(inner: Any) -> Any:
    """A DDP hook that lets `inner`'s work for one bucket finish, callbacks included, before the next
    bucket's starts. PowerSGD launches a bucket's second and third all-reduce from the completion
    callback of the one before; gloo runs those callbacks on its own threads, where they race the next
    bucket's first all-reduce, so with several buckets two ranks can issue their collectives in
    different orders and gloo fails ("Received data size doesn't match expected size"). Waiting costs
    the overlap of PowerSGD's communication with the rest of the backward pass; NCCL, which PowerSGD
    was written for, is left to run as torch runs it."""

    def hook(state, bucket):  # no annotations: DDP accepts only the real types, or none
        fut = inner(state, bucket)
        distributed.wait_for(fut)
        return fut

    return hook


def warn_powersgd_restarts(wrapped: Wrapped) -> None:
    """Resuming under PowerSGD: say that its state starts over (see the module docstring for why it is
    not saved), so nobody expects the resumed run to be bitwise the uninterrupted one."""
    state = getattr(wrapped.module, POWERSGD_STATE, None)
    if state is None:
        return
    log.warning(
        "resuming with strategy.comm_hook=powersgd: PowerSGD's state is not in checkpoints, so it starts "
        "over (%d uncompressed steps, empty error feedback) and the run is not bitwise the uninterrupted one",
        state.start_powerSGD_iter,
    )

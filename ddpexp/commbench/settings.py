"""The benchmark's own settings (the `commbench` section of conf/commbench.yaml) and their checks.

Everything else about the run (backend, init, dist.*, device, strategy) is ddpexp's own config,
planned by validate.plan and checked by pre-flight exactly as for training.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from . import Op

if TYPE_CHECKING:
    from ..plan import Plan

SMOKE_MAX_BYTES = 64 * 2**10
SMOKE_WARMUP = 1
SMOKE_ITERS = 3


class Dtype(StrEnum):
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class CommbenchConfig:
    # What to measure, in this order (sendrecv: rank i sends to i + 1 and receives from i - 1).
    ops: list[Op] = field(default_factory=lambda: list(Op))
    # Message sizes: min_bytes, doubling up to max_bytes (the size conventions: ddpexp/commbench/__init__.py).
    min_bytes: int = 4
    max_bytes: int = 64 * 2**20
    # Untimed calls before the timed ones at each size (connections, buffers, caches), and timed calls.
    warmup: int = 5
    iters: int = 20
    # Element type of the buffers (sizes count bytes whatever it is).
    dtype: Dtype = Dtype.float32
    # A tiny run for tests and trying things out: sizes up to 64 KiB, 1 warmup call, 3 timed calls.
    smoke: bool = False
    # 0: calls back to back (nccl-tests' way). > 0: every call follows a burst of about this many ms of
    # compute on each rank, as a training step's collectives follow its backward; a call's time then
    # includes waiting for the last rank to arrive, and the burst's time with every rank computing
    # at once against its time alone is recorded too (what processes sharing a host's cores cost).
    after_compute_ms: float = 0.0

    def effective(self) -> CommbenchConfig:
        """The settings the benchmark runs with: smoke mode's caps applied."""
        if not self.smoke:
            return self
        top = min(self.max_bytes, SMOKE_MAX_BYTES)
        return replace(
            self,
            max_bytes=top,
            min_bytes=min(self.min_bytes, top),
            warmup=min(self.warmup, SMOKE_WARMUP),
            iters=min(self.iters, SMOKE_ITERS),
        )


def check(section: Any, plan: Plan) -> None:
    """The settings make sense, and the run has ranks to communicate between; else one UserError."""
    if plan.backend is None:
        raise UserError(
            f"strategy={plan.strategy} runs one process without a process group: nothing to benchmark",
            setting="strategy",
            fix="leave strategy at its default (ddp) or pick another multi-process strategy",
        )
    if plan.world_size < 2:
        if plan.launcher == "torchrun":
            setting, fix = "--nproc-per-node", "start torchrun with --nproc-per-node=2 or more"
        else:
            setting, fix = "dist.nprocs", "use dist.nprocs=2 or more"
            if plan.device_type == "cuda":  # one process per GPU: a second one needs a second GPU
                fix += " on a host with 2 GPUs or more, or device=cpu"
        raise UserError("one process has no one to communicate with", setting=setting, fix=fix)
    if not section.ops:
        raise UserError("is empty", setting="commbench.ops", fix=f"name one or more of {', '.join(Op)}")
    repeated = sorted({str(op) for op in section.ops if list(section.ops).count(op) > 1})
    if repeated:
        raise UserError(
            f"lists {', '.join(repeated)} more than once", setting="commbench.ops", fix="name each op once"
        )
    for key in ("min_bytes", "max_bytes", "iters"):
        if section[key] < 1:
            raise UserError(
                f"must be positive, got {section[key]}",
                setting=f"commbench.{key}",
                fix=f"set commbench.{key}>=1",
            )
    if not 0 <= section.after_compute_ms <= 10_000:
        raise UserError(
            f"must be between 0 and 10000 ms, got {section.after_compute_ms}",
            setting="commbench.after_compute_ms",
            fix="set commbench.after_compute_ms=0 (back to back) or the ms of compute before a call, e.g. 20",
        )
    if section.warmup < 0:
        raise UserError("must be >= 0", setting="commbench.warmup", fix="set commbench.warmup=0 or more")
    if section.max_bytes < section.min_bytes:
        raise UserError(
            f"{section.max_bytes} is below commbench.min_bytes={section.min_bytes}",
            setting="commbench.max_bytes",
            fix=f"set commbench.max_bytes>={section.min_bytes} (or lower commbench.min_bytes)",
        )

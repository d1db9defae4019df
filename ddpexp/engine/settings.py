"""What the training loop is told: its settings, from the config and the plan, and where training
stands (what a checkpoint records to resume at the next batch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import OnNonFinite, Precision

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from ..plan import Plan


@dataclass
class LoopSettings:
    epochs: int
    max_steps: int | None
    log_every_steps: int
    eval_every_epochs: int
    global_batch: int
    eval_every_steps: int | None = None
    accumulate: int = 1
    precision: Precision = Precision.fp32
    clip_grad_norm: float | None = None
    channels_last: bool = False
    checkpoint_every_epochs: int | None = None
    checkpoint_every_steps: int | None = None
    devices: int = 1  # devices training in parallel (per-device throughput)
    stop_on_nonfinite: bool = True
    time_comm_every_steps: int = 1  # the comm meter times one optimizer step in this many
    # Throughput in tokens (data with tokens: DataInfo.tokens_per_sample) and MFU (ddpexp/flops.py):
    # set once the data and the model are known; None: not reported.
    tokens_per_sample: int | None = None
    flops_per_token: float | None = None
    peak_flops: float | None = None  # of one device
    # A mixture of experts' routing counts, (MoE layers, experts + 3) per epoch (models/moe.py); (0, 0):
    # none. The whole model's, so a pipeline stage without MoE layers still joins the reduction.
    routing: tuple[int, int] = (0, 0)

    @classmethod
    def from_config(cls, cfg: DictConfig, plan: Plan) -> LoopSettings:
        t, c = cfg.trainer, cfg.checkpoint
        return cls(
            epochs=t.epochs,
            max_steps=t.max_steps,
            log_every_steps=t.log_every_steps,
            eval_every_epochs=t.eval_every_epochs,
            global_batch=plan.global_batch,
            eval_every_steps=t.eval_every_steps,
            accumulate=t.accumulate,
            precision=Precision(t.precision),
            clip_grad_norm=t.clip_grad_norm,
            channels_last=t.channels_last,
            checkpoint_every_epochs=c.every_epochs,
            checkpoint_every_steps=c.every_steps,
            devices=plan.devices,
            stop_on_nonfinite=t.on_nonfinite == OnNonFinite.stop,
            time_comm_every_steps=t.time_comm_every_steps,
        )

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps the run will take: all epochs, or fewer with max_steps."""
        planned = steps_per_epoch * self.epochs
        return planned if self.max_steps is None else min(planned, self.max_steps)


@dataclass
class Position:
    """Where training stands: `epoch` is the epoch in progress (0-based), `step_in_epoch` the optimizer
    steps already taken in it, `step` the global optimizer step count."""

    epoch: int = 0
    step: int = 0
    step_in_epoch: int = 0

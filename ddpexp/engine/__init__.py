"""The training and evaluation loop, shared by every strategy and blind to which one it runs.

What differs between strategies reaches the loop only through `Wrapped` (no_sync, sync_grads, the
module for evaluation). The hot loop never reads a device value: the running loss is summed on the
device and read once per log point, so GPU work is never stalled by the host.

One optimizer step = `accumulate` micro-batches; gradient synchronisation is skipped (no_sync) on all
but the last. Where training stands (epoch, step, step_in_epoch) is all a checkpoint needs to resume
at the next batch: the sample order is a pure function of (seed, epoch, world size).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import distributed, memory
from ..config import Precision
from ..data.loaders import Loader, to_device
from ..errors import UserError
from ..heartbeat import Heartbeat, Preempted
from ..interrupts import raise_if_requested
from ..recorder import NullRecorder
from ..strategies import FP16_FIX, FP16_OWN_STEP, FP16_OWN_STEPS, Wrapped
from ..tasks import Classification, Task
from . import epoch_metrics
from .settings import LoopSettings, Position

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The training loss is no longer finite (trainer.on_nonfinite=stop)."""


FOLD_EVERY = 64  # losses kept before folding them into the sums (bounds the list on long log intervals)
AUTOCAST = {p: p.autocast_dtype for p in Precision}


class Engine:
    def __init__(
        self,
        *,
        model: Wrapped,
        optimizer: torch.optim.Optimizer,
        train_loader: Loader,
        eval_loader: Loader,
        recorder: NullRecorder,
        settings: LoopSettings,
        device: torch.device,
        task: Task | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        on_checkpoint: Callable[[dict[str, float], bool], None] | None = None,
        on_step: Callable[[int], None] | None = None,
        started_at: float | None = None,
        heartbeat: Heartbeat | None = None,
        activations: memory.ActivationMeter | None = None,
        peak: memory.Peak | None = None,
    ) -> None:
        self.model = model
        self.peak = peak or memory.Peak(device)
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.recorder = recorder
        self.settings = settings
        self.device = device
        self.task = task or Classification()
        self.scheduler = scheduler
        # fp16 needs loss scaling (its range underflows small gradients); bf16 and fp32 do not.
        self.scaler = torch.amp.GradScaler("cuda") if settings.precision == Precision.fp16 else None
        if self.scaler is not None and model.train_step is not None:
            raise UserError(
                FP16_OWN_STEP,
                setting="trainer.precision",
                fix=FP16_FIX,
            )
        if self.scaler is not None and model.own_steps:
            raise UserError(
                FP16_OWN_STEPS,
                setting="trainer.precision",
                fix=FP16_FIX,
            )
        self.on_checkpoint = on_checkpoint
        self.on_step = on_step  # after each optimizer step and its checkpoint (fault injection)
        self.pos = Position()
        self.started_at = started_at  # the job's start: time to the first optimizer step counts from it
        self.heartbeat = heartbeat or Heartbeat()  # progress, for the launcher's hang detection
        # Micro-batch losses are kept as they come (a list append costs nothing; two in-place additions
        # per step cost ~1% of a small MLP's step) and folded into these sums every few dozen steps.
        self._pending: list[torch.Tensor] = []
        self._epoch_loss = torch.zeros((), device=device)  # summed over this epoch
        self._epoch_scored = 0  # losses in that sum
        # The whole world's loss sum and count of the epoch a checkpoint was saved in the middle of,
        # before the save, and its steps then: the resumed epoch adds them to its own, so it averages
        # all its steps (weighted by step: a resume on another number of ranks scores more or fewer
        # losses a step, each the mean of a share of the same global batch).
        self._epoch_before_resume = (0.0, 0.0)
        self._steps_before_resume = 0
        self._log_loss = torch.zeros((), device=device)  # summed since the last log point
        self._log_count = 0
        self._params = [p for p in model.base.parameters() if p.requires_grad]
        meshes: dict[Any, list[torch.Tensor]] = {}
        for p in self._params:
            meshes.setdefault(getattr(p, "device_mesh", None), []).append(p)
        self._by_mesh = list(meshes.values())
        self._first_step_done = False
        self._nonfinite_seen = False
        self._resident: dict[str, float] | None = None  # memory.resident_mb, max over ranks
        # Measures one micro-batch's forward and backward of each run (or resumed run), the first of the
        # `_measure_at`-th step this process runs; the one ddpexp.activation_checkpointing reports
        # recomputations to.
        self.activations = activations or memory.ActivationMeter()
        self._steps_here = 0  # optimizer steps this process has run
        self._measure_at = 0
        dtype = AUTOCAST[settings.precision] if model.autocast else None
        self._autocast: Callable[[], contextlib.AbstractContextManager[Any]] = (
            (lambda: torch.autocast(device_type=device.type, dtype=dtype))
            if dtype is not None
            else contextlib.nullcontext
        )

    @property
    def step(self) -> int:
        return self.pos.step

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train_loader) // self.settings.accumulate

    def fit(self) -> dict[str, float]:
        values: dict[str, float] = {}
        if self._done():  # max_steps=0 (or a finished run resumed): score the weights only
            values = self.evaluate()
            self.recorder.epoch(
                epoch=self.pos.epoch, epochs=self.settings.epochs, step=self.step, values=values
            )
            return values
        # The second step where there is one: a pipeline's first step also sets its stages up, which
        # holds one more micro-batch's activations on the first stage than any later step does.
        self._measure_at = 1 if self.settings.total_steps(self.steps_per_epoch) - self.step >= 2 else 0
        while self.pos.epoch < self.settings.epochs:
            epoch = self.pos.epoch
            values = self.train_epoch(epoch)
            ended = self.pos.step_in_epoch >= self.steps_per_epoch
            last = (epoch + 1 == self.settings.epochs and ended) or self._done()
            if (epoch + 1) % self.settings.eval_every_epochs == 0 or last:
                values.update(self.evaluate())
            self.recorder.epoch(epoch=epoch + 1, epochs=self.settings.epochs, step=self.step, values=values)
            if ended:
                self.pos = Position(epoch=epoch + 1, step=self.step, step_in_epoch=0)
            every = self.settings.checkpoint_every_epochs
            stop = None if last else self.heartbeat.stop_signal(self.step)  # checkpoint_on_signal
            periodic = (every is not None and (epoch + 1) % every == 0) or last or stop is not None
            self._checkpoint(values, periodic=periodic)
            if stop is not None:
                raise Preempted(stop, self.step)
            if self._done():
                break
        return values

    def _done(self) -> bool:
        return self.settings.max_steps is not None and self.step >= self.settings.max_steps

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.module.train()
        acc = self.settings.accumulate
        self.train_loader.set_epoch(epoch, start=self.pos.step_in_epoch * acc)
        self._epoch_loss.zero_()  # the previous epoch folded everything it gathered before returning
        self._epoch_scored = 0
        if self.pos.step_in_epoch == 0:  # a new epoch; else one resumed midway keeps what came before
            self._epoch_before_resume = (0.0, 0.0)
            self._steps_before_resume = 0
        steps_per_epoch = self.steps_per_epoch
        remaining = (steps_per_epoch - self.pos.step_in_epoch) * acc
        batches = self.recorder.progress(
            self.train_loader, total=remaining, desc=f"epoch {epoch + 1}/{self.settings.epochs}"
        )
        comm, time_comm_every = self.model.comm, self.settings.time_comm_every_steps
        if comm is not None:
            comm.take()  # drop what evaluation or the previous epoch left
        # The settings read on every step, hoisted out of the loop.
        log_every, eval_every = self.settings.log_every_steps, self.settings.eval_every_steps
        ckpt_every, on_step, pending = self.settings.checkpoint_every_steps, self.on_step, self._pending
        beat, stop_signal = self.heartbeat.beat, self.heartbeat.stop_signal
        micro = steps = 0
        wait = 0.0
        unmeasured = self.activations.peak_bytes is None
        measure_at = self._measure_at
        start = time.perf_counter()
        it = iter(batches)
        while True:
            t = time.perf_counter()
            try:
                inputs, targets = next(it)
            except StopIteration:
                break
            wait += time.perf_counter() - t
            if comm is not None and micro % acc == 0:
                comm.begin_step(time_comm_every)
            micro += 1
            last_micro = micro % acc == 0
            if unmeasured and self._steps_here == measure_at:
                unmeasured = False
                with self.activations.measure(self.model.base):
                    loss = self.forward_backward(inputs, targets, sync=last_micro)
            else:
                loss = self.forward_backward(inputs, targets, sync=last_micro)
            beat(self.pos.step)
            raise_if_requested()  # a stop signal whose exception a finalizer dropped
            if loss is not None:  # None: this rank computes no loss (a pipeline's first stage)
                pending.append(loss)
                self._epoch_scored += 1
            if not last_micro:
                continue
            self.optimizer_step()
            if comm is not None:
                comm.end_step()
            steps += 1
            step = self.pos.step
            self.heartbeat.reached(step)
            if step % log_every == 0:
                self._log_train()
            elif len(pending) >= FOLD_EVERY:
                self._fold()
            if eval_every and step % eval_every == 0:
                self.recorder.scalars(step, self.evaluate())
                self.model.module.train()
            mid_epoch = self.pos.step_in_epoch < steps_per_epoch  # an epoch's end saves in fit()
            stop = stop_signal(step) if mid_epoch and not self._done() else None  # checkpoint_on_signal
            if mid_epoch and ((ckpt_every and step % ckpt_every == 0) or stop is not None):
                self._checkpoint({}, periodic=True)
            if stop is not None:
                raise Preempted(stop, step)
            if on_step is not None:
                on_step(step)
            if self._done() or self.pos.step_in_epoch >= steps_per_epoch:
                break
        # One reduction per epoch; reading it is the epoch's only host sync, so timing after it is honest.
        loss_sum, micro_count = self._epoch_totals()
        elapsed = time.perf_counter() - start
        if steps and self.pos.step % log_every:  # the log window ends with the epoch, never spans two
            self._log_train()
        throughput = steps * self.settings.global_batch / elapsed if elapsed > 0 else 0.0
        self._check_finite(loss_sum)
        values = {
            "train/epoch_loss": loss_sum / max(micro_count, 1.0),  # train/loss: the log windows
            **epoch_metrics.throughput(self.settings, throughput),
            "perf/epoch_time_s": elapsed,
            "perf/step_time_s": elapsed / max(steps, 1),
        }
        values |= epoch_metrics.routing(self.model.base, self.settings.routing, self.device)
        return values | epoch_metrics.costs(
            self.model, self.device, self.peak, self._resident, wait=wait, elapsed=elapsed, steps=steps
        )

    def _check_finite(self, loss: float) -> None:
        """Every rank sees the same all-reduced value, so every rank stops together."""
        if math.isfinite(loss) or self._nonfinite_seen:
            return
        word = "NaN" if math.isnan(loss) else "infinite"
        message = (
            f"loss became {word} at step ~{self.step} (lower optim.lr, or enable trainer.clip_grad_norm; "
            "trainer.on_nonfinite=warn trains on)"
        )
        if self.settings.stop_on_nonfinite:
            raise TrainingDiverged(message)
        self._nonfinite_seen = True
        log.warning("%s", message)

    def _epoch_totals(self) -> tuple[float, float]:
        """The loss sum and count of the epoch so far, over every rank and across a resume (a
        collective: every rank calls it)."""
        self._fold()
        local = torch.stack([self._epoch_loss, torch.tensor(float(self._epoch_scored), device=self.device)])
        loss_sum, count = distributed.all_reduce_sum(local).tolist()
        before_sum, before_count = self._epoch_before_resume
        steps_here = self.pos.step_in_epoch - self._steps_before_resume
        if before_count and count and steps_here > 0 and self._steps_before_resume:
            # The steps before counted before_count / steps_before losses each, these count / steps_here:
            # rescaled to this run's count a step, so that every step weighs the same.
            scale = count / steps_here * self._steps_before_resume / before_count
            before_sum, before_count = before_sum * scale, before_count * scale
        return loss_sum + before_sum, count + before_count

    def _fold(self) -> None:
        """Add the losses gathered since the last fold to the epoch's and the log window's sums."""
        if self._pending:
            total = torch.stack(self._pending).sum()
            self._epoch_loss += total
            self._log_loss += total
            self._log_count += len(self._pending)
            self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs of the loop itself, besides the model and optimizer: where training
        stands, the layout it stood in (accumulate, global batch), the LR schedule, the loss scaler and,
        mid-epoch, the epoch's loss so far. A collective (the loss is summed over ranks): every rank
        calls it."""
        loss_sum, count = self._epoch_totals() if self.pos.step_in_epoch else (0.0, 0.0)
        return {
            "step": self.pos.step,
            "epoch": self.pos.epoch,
            "step_in_epoch": self.pos.step_in_epoch,
            "epoch_loss": {"sum": loss_sum, "count": count, "steps": self.pos.step_in_epoch},
            "accumulate": self.settings.accumulate,
            "global_batch": self.settings.global_batch,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict()`: its position, schedule and loss scaler."""
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.pos = Position(epoch=state["epoch"], step=state["step"], step_in_epoch=state["step_in_epoch"])
        # Absent from checkpoints older than it: the epoch's loss then averages its steps after the resume.
        before = state.get("epoch_loss", {"sum": 0.0, "count": 0.0})
        self._epoch_before_resume = (float(before["sum"]), float(before["count"]))
        # Absent from checkpoints older than it: their steps are weighted by their count, as before.
        self._steps_before_resume = int(before.get("steps", 0))

    def forward_backward(self, inputs: Any, targets: torch.Tensor, *, sync: bool) -> torch.Tensor | None:
        """One micro-batch: forward under autocast, backward of loss/accumulate. Gradient
        synchronisation is suppressed unless `sync` (the last micro-batch of a step). A strategy's own
        train_step replaces the forward and backward (and returns None where it computes no loss)."""
        if self.settings.channels_last and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        step = self.model.train_step
        if step is not None:
            with contextlib.nullcontext() if sync else self.model.no_sync(), self._autocast():
                return step(inputs, targets, 1.0 / self.settings.accumulate, self.task.loss)
        with contextlib.nullcontext() if sync else self.model.no_sync():
            with self._autocast():
                outputs = self.model.module(inputs)
            self.heartbeat.forward_done()  # past the model's own code: what follows waits for peers
            loss = self.task.loss(outputs, targets.to(outputs.device, non_blocking=True))
            # Dividing only when accumulating: a no-op division still costs ~18 us per step in autograd.
            scaled = loss / self.settings.accumulate if self.settings.accumulate > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.model.sync_grads()
        if self.settings.clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.model.grad_norm is None:
                torch.nn.utils.clip_grad_norm_(self._params, self.settings.clip_grad_norm)
            else:  # this rank holds part of the gradient: clip by the whole gradient's norm
                norm = self.model.grad_norm(self._params)
                for params in self._by_mesh:  # one foreach op may not mix DTensors of two meshes
                    torch.nn.utils.clip_grads_with_norm_(params, self.settings.clip_grad_norm, norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        # Once, while gradients and optimizer state both exist, with the activations of this step.
        if self._resident is None and self._steps_here >= self._measure_at:
            self._measure_resident()
        self._steps_here += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.pos.step += 1
        self.pos.step_in_epoch += 1
        if not self._first_step_done:
            self._first_step_done = True
            if self.started_at is not None:
                self.recorder.update(time_to_first_step_s=time.time() - self.started_at)

    def _eval_batches(self) -> Iterator[tuple[Any, torch.Tensor | None]]:
        """The eval shard's batches. Where the eval forward is collective (FSDP gathers parameters in
        it), ranks with fewer batches repeat their last batch's forward, unscored, until every rank
        has run as many forwards as the busiest one: the shards are unpadded and may differ by one.
        A rank with no eval samples at all (fewer samples than ranks) runs rank 0's first inputs,
        which every rank receives then (rank 0's shard is the first to get a sample)."""
        if not self.model.collective_eval:
            yield from self.eval_loader
            return
        rounds = int(distributed.all_reduce_max(float(len(self.eval_loader))))
        fewest = -int(distributed.all_reduce_max(-float(len(self.eval_loader))))
        batches = iter(self.eval_loader)
        first = next(batches, None)
        last: Any = None
        if fewest == 0 and rounds > 0:
            mine = None if first is None else to_device(first[0], torch.device("cpu"))
            last = to_device(distributed.broadcast_object(mine), self.device)
        done = 0
        for inputs, targets in itertools.chain([] if first is None else [first], batches):
            last = inputs
            done += 1
            yield inputs, targets
        for _ in range(rounds - done):
            yield last, None

    def _measure_resident(self) -> None:
        """Bytes per rank by category (ddpexp/memory.py): the max over ranks goes to the epoch's
        scalars, every rank's to metrics.json (`memory_per_rank`)."""
        mine = memory.resident_mb(self.model.base, self.optimizer)
        if self.activations.peak_bytes is not None:
            mine["mem/activations_mb"] = self.activations.peak_bytes / memory.MB
        ranks = distributed.gather_objects(mine)
        self._resident = {k: max(float(r[k]) for r in ranks) for k in mine}  # type: ignore[index]
        self.recorder.update(memory_per_rank=ranks)

    def _checkpoint(self, values: dict[str, float], *, periodic: bool) -> None:
        if self.model.sync_buffers is not None:
            self.model.sync_buffers()  # what is saved is what every rank holds
        if self.on_checkpoint is not None:
            with self.heartbeat.slow():
                self.on_checkpoint(values, periodic)

    def _log_train(self) -> None:
        self._fold()
        count = torch.tensor(float(self._log_count), device=self.device)
        loss_sum, n = distributed.all_reduce_sum(torch.stack([self._log_loss, count])).tolist()
        values = {"train/loss": loss_sum / max(n, 1.0), "opt/lr": self.optimizer.param_groups[0]["lr"]}
        self._check_finite(values["train/loss"])
        self.recorder.scalars(self.step, values)
        self.recorder.set_postfix(loss=values["train/loss"])
        self._log_loss.zero_()
        self._log_count = 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact over the whole eval set: each rank scores its unpadded shard, the task's sums (loss,
        metric numerators, samples) are all-reduced."""
        module = self.model.eval_module
        assert module is not None and self.model.sync_buffers is not None
        self.model.sync_buffers()  # every rank scores rank 0's BatchNorm statistics, as model.pt holds
        was_training = module.training
        module.eval()
        sums: torch.Tensor | None = None
        for inputs, targets in self._eval_batches():
            with self._autocast():
                outputs = module(inputs)
            self.heartbeat.beat(self.pos.step)
            raise_if_requested()
            if targets is None or outputs is None:  # a lockstep pass, or a rank that scores nothing
                continue
            targets = targets.to(outputs.device, non_blocking=True)
            batch = self.task.eval_sums(outputs, targets).to(self.device)
            sums = batch if sums is None else sums + batch
        module.train(was_training)
        if sums is None:  # a rank whose eval shard is empty still joins the reduction
            sums = torch.zeros(self.task.num_sums, dtype=torch.float64, device=self.device)
        return self.task.finish(distributed.all_reduce_sum(sums).tolist())

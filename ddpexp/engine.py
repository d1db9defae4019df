"""The training and evaluation loop, shared by every strategy and blind to which one it runs.

What differs between strategies reaches the loop only through `Wrapped` (no_sync, sync_grads, the
base module for evaluation). The hot loop never reads a device value: the running loss is summed on
the device and read once per log point, so GPU work is never stalled by the host.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import distributed
from .data.loaders import Loader
from .recorder import NullRecorder
from .strategies import Wrapped

log = logging.getLogger(__name__)


@dataclass
class LoopSettings:
    epochs: int
    max_steps: int | None
    log_every_steps: int
    eval_every_epochs: int
    global_batch: int


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
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.recorder = recorder
        self.s = settings
        self.device = device
        self.step = 0  # global optimizer steps taken
        self._log_loss = torch.zeros((), device=device)  # summed since the last log point
        self._log_count = 0

    def fit(self) -> dict[str, float]:
        values: dict[str, float] = {}
        if self._done():  # max_steps=0: score the initial weights only
            values = self.evaluate()
            self.recorder.epoch(epoch=0, epochs=self.s.epochs, step=0, values=values)
            return values
        for epoch in range(self.s.epochs):
            values = self.train_epoch(epoch)
            last = epoch + 1 == self.s.epochs or self._done()
            if (epoch + 1) % self.s.eval_every_epochs == 0 or last:
                values.update(self.evaluate())
            self.recorder.epoch(epoch=epoch + 1, epochs=self.s.epochs, step=self.step, values=values)
            if self._done():
                break
        return values

    def _done(self) -> bool:
        return self.s.max_steps is not None and self.step >= self.s.max_steps

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.module.train()
        self.train_loader.set_epoch(epoch)
        epoch_loss = torch.zeros((), device=self.device)
        steps = 0
        batches = self.recorder.progress(
            self.train_loader, total=len(self.train_loader), desc=f"epoch {epoch + 1}/{self.s.epochs}"
        )
        start = time.perf_counter()
        for inputs, targets in batches:
            loss = self.train_step(inputs, targets)
            epoch_loss += loss
            self._log_loss += loss
            self._log_count += 1
            steps += 1
            if self.step % self.s.log_every_steps == 0:
                self._log_train()
            if self._done():
                break
        # One reduction per epoch; reading it is the epoch's only host sync, so timing after it is honest.
        totals = distributed.all_reduce_sum(
            torch.stack([epoch_loss, torch.tensor(float(steps), device=self.device)])
        )
        loss_sum, step_count = totals.tolist()
        elapsed = time.perf_counter() - start
        return {
            "train/loss": loss_sum / max(step_count, 1.0),
            "perf/samples_per_s": steps * self.s.global_batch / elapsed if elapsed > 0 else 0.0,
            "perf/epoch_time_s": elapsed,
        }

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        outputs = self.model.module(inputs)
        loss = F.cross_entropy(outputs, targets.to(outputs.device, non_blocking=True))
        loss.backward()
        self.model.sync_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.detach()

    def _log_train(self) -> None:
        count = torch.tensor(float(self._log_count), device=self.device)
        loss_sum, n = distributed.all_reduce_sum(torch.stack([self._log_loss, count])).tolist()
        values = {"train/loss": loss_sum / max(n, 1.0), "opt/lr": self.optimizer.param_groups[0]["lr"]}
        self.recorder.scalars(self.step, values)
        self.recorder.set_postfix(loss=values["train/loss"])
        self._log_loss.zero_()
        self._log_count = 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact over the whole eval set: each rank scores its unpadded shard, sums are all-reduced."""
        module = self.model.eval_module
        assert module is not None
        was_training = module.training
        module.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, correct, count
        for inputs, targets in self.eval_loader:
            outputs = module(inputs)
            targets = targets.to(outputs.device, non_blocking=True)
            losses = F.cross_entropy(outputs.float(), targets, reduction="none")
            sums[0] += losses.double().sum().to(self.device)
            sums[1] += (outputs.argmax(dim=1) == targets).sum().to(self.device)
            sums[2] += targets.numel()
        module.train(was_training)
        loss_sum, correct, count = distributed.all_reduce_sum(sums).tolist()
        return {"eval/loss": loss_sum / count, "eval/acc": correct / count, "eval/samples": count}

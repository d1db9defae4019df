"""Every rank-0-only effect lives here: TensorBoard events, metrics.json, console lines, progress bar.

Other ranks get a `NullRecorder` with the same methods, so the engine calls them unconditionally and
never checks its rank.

metrics.json keys (TensorBoard shows them as board_scalars says: below), x axis = global optimizer step:
  train/loss          mean training loss over the steps since the last log point (all ranks); a
                      window ends at every epoch's end, so no point spans two epochs
  train/epoch_loss    the epoch's mean training loss (at its last step)
  eval/loss, eval/<m>  exact loss and the task's metrics over the whole eval set (eval/acc; eval/top<k>;
                      regression: eval/mse, eval/mae); accuracies are fractions here, % in TensorBoard
  eval/samples        eval samples scored (always the eval set size: nothing counted twice)
  eval/tokens, eval/ppl, eval/token_acc   task=lm: eval tokens scored (eval/loss is their mean),
                      exp(eval/loss), next-token accuracy
  perf/samples_per_s  training samples per second over the epoch (all ranks together)
  perf/tokens_per_s   data with tokens (DataInfo.tokens_per_sample): samples/s x tokens per sample;
                      perf/tokens_per_s_per_device too
  perf/mfu            model FLOPs utilisation, a fraction (ddpexp/flops.py): models that declare
                      flops_per_token, on a device whose peak is known (a GPU of the table, or
                      trainer.peak_flops)
  perf/epoch_time_s   wall-clock seconds of the epoch's training (eval excluded)
  opt/lr              learning rate of the first parameter group
  perf/samples_per_s_per_device, perf/step_time_s, perf/data_wait_frac (host time waiting for batches)
  mem/peak_mb         peak memory since the run began: CUDA max allocated, or on a CPU the resident
                      set's high-water mark (max over ranks; ddpexp.memory.Peak)
  mem/params_mb, mem/grads_mb, mem/optim_state_mb   bytes resident per rank by category, counted from
                      the local shards (max over ranks; every rank's in metrics.json memory_per_rank)
  mem/activations_mb  the peak of the tensors held for the backward in one micro-batch, per rank
                      (max over ranks; memory_per_rank too): what activation checkpointing cuts
  mem/host_mb         of those, what the strategy keeps in host memory (FSDP's offload)
  comm/time_per_step_s, comm/share, comm/bytes_per_step   communication (strategies with any);
                      TensorBoard: perf/comm_time_per_step_s, perf/comm_share
  comm/bytes_per_step/<kind>   gradients, parameters (all-gathers, pulls, ZeRO's broadcasts), sync_bn
                      (statistics), buffers (DDP's broadcast of BatchNorm statistics before each forward),
                      tensor_parallel, activations (what pipeline stages send each other), offload
                      (FSDP's copies between host and device memory: not in comm/bytes_per_step)
  constant over a run (BOARD_CONSTANT): no TensorBoard chart; the run/constants text at the end
  summary/*           TensorBoard only: the HParams view's metrics written once (ddpexp/hparams.py)

Scalars logged between epochs are kept in memory and written in one go at the epoch's end, before a
checkpoint, at close, or once WRITE_EVERY_S has passed: TensorBoard's writer thread serialises and
checksums every event in Python, and doing that during training costs ~1% of a small model's step.
SummaryWriter only flushes to disk every 120 s anyway, so the live view loses nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from . import host
from .fsutil import atomic_write_bytes, atomic_write_text
from .runrecord import (
    CRASHED,
    METRICS_FILE,
    RunRecordError,
    gone_error,
    is_accuracy,
    owner_gone,
    owner_record,
    read_run_record,
    read_run_record_or_none,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

WRITE_EVERY_S = 10.0
MODEL_FILE = "model.pt"
# TensorBoard shows what a person compares, in the units the console and the report use: accuracies
# in %, communication's share and time beside the throughput (perf/, after eval/ in TensorBoard's
# alphabetical order), and no per-step chart of what is constant over a run (bytes per step, resident
# memory by category, eval samples): those are one text table at the end (run/constants).
BOARD_RENAMED = {"comm/share": "perf/comm_share", "comm/time_per_step_s": "perf/comm_time_per_step_s"}
BOARD_CONSTANT = (
    "comm/bytes_per_step",
    "mem/params_mb",
    "mem/grads_mb",
    "mem/optim_state_mb",
    "mem/activations_mb",
    "mem/host_mb",
    "eval/samples",
    "eval/tokens",
)
TAGS = (  # the charts TensorBoard shows for every run
    "train/loss",
    "train/epoch_loss",
    "eval/loss",
    "eval/acc",
    "perf/samples_per_s",
    "perf/epoch_time_s",
    "opt/lr",
)


@dataclass(frozen=True)
class Best:
    """The one definition of "best" (checkpoint.best_metric / best_mode): best.pt, metrics.json's
    `best` and the report all use it."""

    metric: str = "eval/acc"
    mode: str = "max"

    def improves(self, value: float | None, than: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return than is None or (value > than if self.mode == "max" else value < than)

    def pick(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The best of some history records ({} when none has the metric)."""
        best: dict[str, Any] = {}
        for record in records:
            if self.improves(record.get(self.metric), best.get(self.metric)):
                best = record
        return best


def board_scalars(values: dict[str, float]) -> dict[str, float]:
    """A record's scalars as TensorBoard shows them (BOARD_RENAMED, accuracies in %, constants left out)."""
    return {
        BOARD_RENAMED.get(tag, tag): 100 * value if is_accuracy(tag) else value
        for tag, value in values.items()
        if not tag.startswith(BOARD_CONSTANT)
    }


def constants_table(final: dict[str, Any]) -> str:
    """What is constant over a run (BOARD_CONSTANT) as a markdown table for TensorBoard's Text view."""
    rows = [(tag, value) for tag, value in sorted(final.items()) if tag.startswith(BOARD_CONSTANT)]
    return "\n".join(
        ["| value | per run |", "|---|---|", *(f"| {tag} | {value:,.6g} |" for tag, value in rows)]
    )


def new_metrics(facts: dict[str, Any]) -> dict[str, Any]:
    return {"status": "running", "facts": facts, "final": {}, "best": {}, "history": []}


def write_metrics(run_dir: Path, metrics: dict[str, Any]) -> None:
    """metrics.json is strict JSON whatever happened: a NaN or infinite value is written as null, and
    the keys that held one are listed under `nonfinite` (JSON has no NaN; JSON.parse rejects it)."""
    found: set[str] = set()
    clean = _finite(metrics, found, "")
    if found:
        clean["nonfinite"] = sorted(found | set(metrics.get("nonfinite", [])))
    atomic_write_text(run_dir / METRICS_FILE, json.dumps(clean, indent=2, sort_keys=True, allow_nan=False))


def _finite(value: Any, found: set[str], key: str) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        found.add(key)
        return None
    if isinstance(value, dict):
        return {k: _finite(v, found, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v, found, key) for v in value]
    return value


def finish_metrics(run_dir: Path, status: str, error: str, *, facts: dict[str, Any]) -> None:
    """Make metrics.json say how the run ended, even if rank 0 could not write it itself (the
    launcher calls this after stopping the workers). A run rank 0 recorded as completed stays so: its
    work is done, whatever stopped its processes afterwards (a signal the moment model.pt appeared)."""
    record = read_run_record_or_none(run_dir)
    if record is not None and record.status == "completed":
        return
    metrics = (record.raw if record is not None else {}) or new_metrics(facts)
    metrics["status"] = status
    metrics["error"] = error
    write_metrics(run_dir, metrics)


def settle_lost(run_dir: Path) -> bool:
    """A record left `running` by a process that is gone (runrecord.RunRecord.lost) says so in the
    file: status CRASHED, with why, and the HParams view's status too. Called by a command that has
    just claimed the directory, so no live run can be writing there. True when it did."""
    record = read_run_record_or_none(run_dir)
    if record is None or not record.lost:
        return False
    try:
        write_metrics(run_dir, dict(record.raw, status=CRASHED, error=record.error))
        from . import hparams  # tensorboard: only when there is a record to settle

        hparams.write_end(run_dir, CRASHED, step=int(record.final.get("step", 0)))
    except OSError:  # a full disk, a copy without write permission: every reader still sees CRASHED
        return False
    log.warning("ddpexp: %s: %s; its %s now says %s", run_dir, record.error, METRICS_FILE, CRASHED)
    return True


class NullRecorder:
    def start(self) -> None:
        pass

    def scalars(self, step: int, values: dict[str, float]) -> None:
        pass

    def epoch(self, *, epoch: int, epochs: int, step: int, values: dict[str, float]) -> None:
        pass

    def progress(self, items: Iterable[T], *, total: int, desc: str) -> Iterable[T]:
        return items

    def set_postfix(self, **values: float) -> None:
        pass

    def update(self, **fields: Any) -> None:
        pass

    def save_model(self, state: dict[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, status: str, error: str | None = None) -> None:
        pass


class Recorder(NullRecorder):
    def __init__(
        self,
        run_dir: Path,
        *,
        facts: dict[str, Any],
        progress: bool,
        best: Best | None = None,
        resume_step: int | None = None,
        owner_pid: int | None = None,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy: only rank 0 of a run pays for it

        self.run_dir = run_dir
        self.model_saved = False
        # Resuming: TensorBoard drops what earlier attempts logged after the checkpoint's step (every
        # point up to that step was written before the checkpoint was, so it stays).
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge)
        self.best = best or Best()
        self.show_progress = progress
        self._bar: Any = None
        self._unwritten: list[tuple[int, dict[str, float]]] = []
        self._written_at = time.monotonic()
        # Whose run this is while it says `running`: the job's launcher (its workers die with it).
        owner = owner_record(owner_pid if owner_pid is not None else os.getpid())
        self.metrics = new_metrics(facts) | {"started_at": time.time(), "owner": owner}
        self._resume_step = resume_step

    def start(self) -> None:
        """metrics.json (status running) and the HParams start, written where a stop that follows at
        once is already recorded: train.recorded_if_it_stops calls this inside its guard."""
        if self._resume_step is not None:
            self._continue_metrics(self._resume_step)
        else:
            self._write_hparams_start()
        self._write_metrics()

    def _continue_metrics(self, step: int) -> None:
        """Keep the history of the run being resumed, up to the checkpoint's step. A record that is gone
        or damaged (a crash mid-write where renames are not atomic, an edit) cannot give it: say what
        is lost, in the log and in the record, rather than start afresh without a word."""
        try:
            old = read_run_record(self.run_dir)
            why = f"{METRICS_FILE} was missing"
        except RunRecordError as exc:
            old, why = None, f"{METRICS_FILE} was unreadable ({exc.kind})"
        if old is None:
            lost = f"{why} when the run resumed at step {step}: its history before that step is lost"
            log.warning("ddpexp: %s, and so is the count of earlier attempts", lost)
            self.metrics["lost"] = lost
            return
        history = [h for h in old.history if h.get("step", 0) <= step]
        self.metrics["history"] = history
        self.metrics["best"] = self.best.pick(history)
        if history:
            self.metrics["final"] = history[-1]
        self.metrics["attempts"] = old.attempts + 1

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._unwritten.append((step, values))
        if time.monotonic() - self._written_at >= WRITE_EVERY_S:
            self._write_scalars()

    def _write_scalars(self) -> None:
        for step, values in self._unwritten:
            for tag, value in board_scalars(values).items():
                self.writer.add_scalar(tag, value, global_step=step)
        self._unwritten.clear()
        self._written_at = time.monotonic()

    def epoch(self, *, epoch: int, epochs: int, step: int, values: dict[str, float]) -> None:
        self.scalars(step, values)
        self._write_scalars()
        self.writer.flush()
        job_time = time.time() - self._job_start
        self.metrics["history"].append({"epoch": epoch, "step": step, "job_time_s": job_time, **values})
        self.metrics["final"] = {"epoch": epoch, "step": step, **values}
        if self.best.improves(values.get(self.best.metric), self.metrics["best"].get(self.best.metric)):
            self.metrics["best"] = {"epoch": epoch, "step": step, **values}
        self._write_metrics()
        log.info("%s", _summary_line(epoch, epochs, values))

    def progress(self, items: Iterable[T], *, total: int, desc: str) -> Iterable[T]:
        if not self.show_progress:
            return items
        return self._progress(items, total, desc)

    def _progress(self, items: Iterable[T], total: int, desc: str) -> Iterator[T]:
        from tqdm import tqdm

        with tqdm(items, total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stdout) as bar:
            self._bar = bar
            yield from bar
        self._bar = None

    def set_postfix(self, **values: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)

    def update(self, **fields: Any) -> None:
        self.metrics.update(fields)
        self._write_metrics()

    def save_model(self, state: dict[str, Any]) -> None:
        """The trained weights of the unwrapped model (no `module.` prefixes), loadable with
        `model.load_state_dict(torch.load(path))` whatever strategy trained them."""
        import io

        import torch

        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, buf)
        atomic_write_bytes(self.run_dir / MODEL_FILE, buf.getvalue())
        self.model_saved = True  # the run's work is done: a stop from here on does not undo it

    def flush(self) -> None:
        """Everything logged so far onto disk (before a checkpoint: a run resumed from it keeps every
        point logged before it)."""
        self._write_scalars()
        self.writer.flush()

    def close(self, status: str, error: str | None = None) -> None:
        if status == "interrupted" and self.model_saved:
            status, error = "completed", None  # stopped after model.pt was written: nothing was cut short
        owner = self.metrics["owner"]
        if status == "failed" and owner_gone(owner):
            # The run's launcher was killed outright and this rank failed of it (its peers were
            # killed with the launcher): that is the cause, not the broken connection seen here.
            status, error = CRASHED, f"{gone_error(owner)}; rank 0 then failed: {error}"
        self.metrics["status"] = status
        now = time.time()
        self.metrics["wall_s"] = now - self.metrics["started_at"]
        # How the job ended and how busy the host was then (the report warns on a load change).
        self.metrics["facts"].update(job_ended_at=now, load_avg_end=host.load_average())
        if error:
            self.metrics["error"] = error
        self._write_metrics()
        self._write_scalars()
        self._write_hparams_end(status)
        self.writer.close()

    @property
    def _job_start(self) -> float:
        """When the job started (spawn and start-up included); the recorder's own start without it."""
        return float(self.metrics["facts"].get("job_started_at") or self.metrics["started_at"])

    def _write_hparams_start(self) -> None:
        """The HParams view's experiment and this run's settings, from the start: running and failed
        runs show there too (ddpexp/hparams.py)."""
        from . import hparams

        for summary in hparams.start(self.metrics["facts"], self.best.metric, self._job_start):
            self.writer._get_file_writer().add_summary(summary)

    def _write_hparams_end(self, status: str) -> None:
        """The run's status and its metrics in the HParams view (the report's definitions)."""
        from . import hparams

        results = hparams.results(self.metrics, self.best.metric)
        step = int(self.metrics["final"].get("step", 0))
        # At the run's last step: a resumed run's purge drops the status an earlier attempt wrote.
        self.writer._get_file_writer().add_summary(hparams.end(status, time.time()), global_step=step)
        for tag, value in results.items():
            self.writer.add_scalar(tag, value, global_step=step)
        final = self.metrics["final"]
        if any(tag.startswith(BOARD_CONSTANT) for tag in final):
            self.writer.add_text("run/constants", constants_table(final), global_step=step)
        self.writer.flush()

    def _write_metrics(self) -> None:
        write_metrics(self.run_dir, self.metrics)


def _summary_line(epoch: int, epochs: int, v: dict[str, float]) -> str:
    parts = [f"epoch {epoch}/{epochs}"]
    if "train/epoch_loss" in v:
        parts.append(f"train_loss {v['train/epoch_loss']:.4f}")
    if "eval/loss" in v:
        parts.append(f"eval_loss {v['eval/loss']:.4f}")
    for tag, value in v.items():  # the task's eval metrics: accuracies in %, errors as they are
        if tag.startswith("eval/") and tag not in ("eval/loss", "eval/samples", "eval/tokens"):
            name = tag.replace("/", "_")
            pct = is_accuracy(tag)
            parts.append(f"{name} {100 * value:.2f}%" if pct else f"{name} {value:.4f}")
    if "perf/samples_per_s" in v:
        parts.append(f"{v['perf/samples_per_s']:,.0f} samples/s")
    if "perf/tokens_per_s" in v:
        parts.append(f"{v['perf/tokens_per_s']:,.0f} tokens/s")
    if "perf/mfu" in v:
        parts.append(f"MFU {100 * v['perf/mfu']:.2f}%")
    if "perf/epoch_time_s" in v:
        parts.append(f"{v['perf/epoch_time_s']:.1f}s")
    return "  ".join(parts)

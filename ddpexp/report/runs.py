"""The runs a report is about: every directory below the given ones that holds a run's record
(metrics.json, read through ddpexp.runrecord), with its TensorBoard scalars, read with tensorboard's own
event reader; and what one run measured (samples/s, times, the best metric's progress)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runrecord import METRICS_FILE, RunRecordError, finite_number, is_accuracy, read_run_record, steady


@dataclass
class Run:
    name: str
    path: Path
    status: str
    facts: dict[str, Any]
    final: dict[str, Any]
    best: dict[str, Any]
    started_at: float | None
    scalars: dict[str, list[tuple[int, float, float]]] = field(
        default_factory=dict
    )  # tag -> (step, value, wall)
    history: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float | None = None
    time_to_first_step_s: float | None = None

    @property
    def devices(self) -> int:
        return int(self.facts.get("devices") or 1)  # Plan.devices, recorded by the run

    def values(self, tag: str) -> list[float]:
        """The tag's points from the event files, else from metrics.json's per-epoch history."""
        if tag in self.scalars:
            return [v for _, v, _ in self.scalars[tag]]
        return [float(h[tag]) for h in self.history if isinstance(h.get(tag), int | float)]

    def throughput(self) -> float | None:
        return self.steady_mean("perf/samples_per_s")

    def token_throughput(self) -> float | None:
        return self.steady_mean("perf/tokens_per_s")

    def mfu(self) -> float | None:
        return self.steady_mean("perf/mfu")

    def steady_mean(self, tag: str) -> float | None:
        """The mean over epochs, the first left out when there are several (it includes warm-up)."""
        per_epoch = self.values(tag)
        if not per_epoch:
            return None
        kept = steady(per_epoch)
        return sum(kept) / len(kept)

    @property
    def metric(self) -> str:
        """The run's best metric (its task's, or checkpoint.best_metric)."""
        return str(self.facts.get("best_metric", "eval/acc"))

    @property
    def job_start(self) -> float | None:
        """When the job started (spawn and start-up included); the recorder's start for older runs."""
        return finite_number(self.facts.get("job_started_at")) or self.started_at

    @property
    def job_end(self) -> float | None:
        end = finite_number(self.facts.get("job_ended_at"))
        if end is None and self.started_at is not None and self.wall_s is not None:
            end = self.started_at + self.wall_s
        return end

    def job_time(self) -> float | None:
        start = finite_number(self.facts.get("job_started_at"))
        if start is not None and self.job_end is not None:
            return self.job_end - start
        if self.time_to_first_step_s is not None and self.wall_s is not None:
            return self.time_to_first_step_s + self.wall_s
        return None

    def time_to(self, target: float) -> float | None:
        """Seconds from the job's start until the best metric first reached the target (>= for max, <=
        for min metrics)."""
        if self.job_start is None:
            return None
        lower = self.facts.get("best_mode") == "min"
        for _, value, wall in self.scalars.get(self.metric, []):
            if (value <= target) if lower else (value >= target):
                return wall - self.job_start
        return None

    def bytes_sent(self) -> list[tuple[int, float]]:
        """(step, bytes each rank had sent by then) at the start and at each epoch's end, from
        metrics.json's history: comm/bytes_per_step x the steps the epoch took. Empty where the run
        did not measure its communication."""
        points = [(0, 0.0)]
        for epoch in self.history:
            per_step, step = finite_number(epoch.get("comm/bytes_per_step")), epoch.get("step")
            if per_step is None or not isinstance(step, int) or step <= points[-1][0]:
                continue  # an evaluation-only record, or an epoch that measured nothing
            done, total = points[-1]
            points.append((step, total + per_step * (step - done)))
        return points if len(points) > 1 else []

    def bytes_moved(self) -> float | None:
        """Bytes each rank sent in the whole run (None: not measured)."""
        sent = self.bytes_sent()
        return sent[-1][1] if sent else None

    def bytes_at(self, step: int) -> float | None:
        """Bytes each rank had sent by `step`, at its epoch's rate within the epoch."""
        sent = self.bytes_sent()
        for (before, total), (after, then) in itertools.pairwise(sent):
            if step <= after:
                return total + (then - total) * (step - before) / (after - before)
        return None

    def tokens_per_step(self) -> float | None:
        """Tokens (for data with tokens; else samples) one optimizer step trains on: the global batch's."""
        batch = finite_number(self.facts.get("global_batch_size"))
        per_sample = finite_number(self.facts.get("tokens_per_sample")) or 1.0
        return batch * per_sample if batch is not None else None

    def mean(self, tag: str) -> float | None:
        vals = self.values(tag)
        return sum(vals) / len(vals) if vals else None

    def peak(self, tag: str) -> float | None:
        vals = self.values(tag)
        return max(vals) if vals else None


def find_runs(roots: list[Path]) -> list[Run]:
    runs = []
    for root in roots:
        for metrics_path in sorted(root.rglob(METRICS_FILE)):
            if ".hydra" in metrics_path.parts or "checkpoints" in metrics_path.parts:
                continue
            run_dir = metrics_path.parent
            name = str(run_dir.relative_to(root)) if run_dir != root else run_dir.name
            runs.append(load_run(run_dir, name))
    return runs


def load_run(run_dir: Path, name: str) -> Run:
    try:
        record = read_run_record(run_dir)
    except RunRecordError as exc:
        return Run(name, run_dir, f"unreadable ({exc.kind})", {}, {}, {}, None)
    if record is None:  # gone since it was found
        return Run(name, run_dir, f"unreadable (no {METRICS_FILE})", {}, {}, {}, None)
    return Run(
        name,
        run_dir,
        record.status,  # `crashed` for a run left `running` by a process that is gone (runrecord)
        record.facts,
        record.final,
        record.best,
        record.started_at,
        scalars=as_fractions(read_scalars(run_dir), record.final),
        history=record.history,
        wall_s=record.wall_s,
        time_to_first_step_s=record.time_to_first_step_s,
    )


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    if not any(run_dir.glob("events.out.tfevents.*")):
        return {}  # runs fabricated or copied without their events: metrics.json's history still counts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    try:
        acc.Reload()
    except Exception:  # a crashed run may leave a truncated event file: report what is readable
        return {}
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def as_fractions(
    scalars: dict[str, list[tuple[int, float, float]]], final: dict[str, Any]
) -> dict[str, list[tuple[int, float, float]]]:
    """Accuracies as fractions, as metrics.json has them: TensorBoard shows them in % (runs recorded
    before that, as fractions), told apart by the last point against metrics.json's final value."""
    out = dict(scalars)
    for tag, points in scalars.items():
        last, recorded = (points[-1][1] if points else None), finite_number(final.get(tag))
        if not is_accuracy(tag) or last is None:
            continue
        percent = abs(last - 100 * recorded) < abs(last - recorded) if recorded is not None else last > 1
        if percent:
            out[tag] = [(step, value / 100, wall) for step, value, wall in points]
    return out

"""`python -m ddpexp.report DIR [DIR ...]` (or `ddpexp-report`): which strategy, and at what cost.

Every directory holding a metrics.json below the given ones is a run. Numbers come from the run's
metrics.json (facts, final, best, status, history, wall_s) and its TensorBoard events, read with
tensorboard's own event reader; nothing is re-measured. Written into the first directory given (or
--out), by --format:

  md (default)         report.md: one section per group (below), its table, notes and warnings
  csv, json            report.csv / report.json: one record per row, numbers as numbers (accuracy as a
                       fraction, times in seconds), with the row's group and warnings
  acc_vs_time.png      the best metric (eval/acc in %) against seconds since the job started, with the
                       --target line
  loss_vs_step.png     training loss against optimizer step
  throughput.png       samples/s per row (all devices; median, min-max bars when repeated)
  scaling.png          scaling efficiency against device count (groups with a baseline whose device
                       counts differ); `plot_scaling` also draws predicted curves when given some

The table is printed on stdout too (columns that are "-" in every row left out), then the notes and
every warning, one line each.

How runs are compared:
  group                runs with the same facts.model, facts.data and facts.global_batch_size; rows of
                       different groups are never compared with each other
  row                  runs that differ only in facts.seed / facts.repeat: the same facts otherwise (the
                       job's own clock and load readings aside) and the same run name once its seed=/repeat=
                       parts are taken out (the name carries overrides that facts do not, such as
                       trainer.epochs). Only completed runs are pooled; any other run is a row of its own.
  baseline             the group's row of --baseline NAME (a strategy label such as `single` or
                       `ddp comm_hook=bf16`, or a run's name) if given, else its completed `single` row
                       (facts.strategy == "single"; of several, the one labelled plain `single`, then the
                       one with most runs). Never "the fastest one-device run". No baseline: efficiency "-"
                       and a warning.
  vs baseline          "no measurable difference" when the row's samples/s min-max range and the
                       baseline's overlap; otherwise the ratio of medians ("1.80x faster", "2.10x
                       slower"), marked "(n=1)" when either side ran once, so its spread is unknown

Definitions (also in the README):
  samples/s            per run: mean of perf/samples_per_s over its epochs, the first left out when there
                       are several (it includes warm-up); per row: median (min-max) over its runs
  per device           median samples/s / devices (processes on CPU, GPUs on CUDA)
  scaling eff.         (per device of the row) / (per device of the group's baseline), from medians
  final, best          the best metric's final / best value; a row of several runs: mean ± std (sample
                       standard deviation, in percentage points for accuracies)
  time to target       seconds from the job's start (facts.job_started_at, else the recorder's start)
                       until the best metric first reached --target (>= for max metrics, <= for min ones);
                       median (min-max) over the runs that reached it, "k of n" when some did not
  train time           metrics.json wall_s: from the recorder's start (data and model built) to its close
  job time             facts.job_ended_at - facts.job_started_at: the whole job, spawn and start-up
                       included; for runs recorded before job_ended_at, the recorder's close minus the job's
                       start (started_at + wall_s - job_started_at), else time_to_first_step_s + wall_s
  comm share           mean comm/share: fraction of training wall time with a gradient reduction running
  comm bytes/step      comm/bytes_per_step of the last epoch: the bytes each rank's gradient reductions
                       send per optimizer step (after PowerSGD's uncompressed start, when it ran that long)
  strategy             the strategy, with the settings that differ from its defaults (ddp comm_hook=bf16)
  bubble               pipeline runs, last epoch: pipe/bubble_frac (the measured share of a schedule step
                       spent outside the rank's stage) / pipe/bubble_frac_textbook ((p-1)/(m+p-1))
  staleness            ps async runs, last epoch: ps/staleness_mean / ps/staleness_max (server updates
                       between a worker's pull and its push)
  Several runs in a row: the other columns show the median over its runs.

Warnings (a marker [k] in the row's "warnings" column, the text under the table and on stdout):
  efficiency > 1.05    more than linear per-device speed cannot be real: the baseline was slowed
  oversubscribed       CPU runs: nprocs_per_node x threads > host_cpus (GPU runs' intra-op threads idle)
  no baseline          the group has no completed baseline row
  load                 the 1-minute load average (facts.load_avg_start / load_avg_end) against what the
                       run itself explains. busy threads = nprocs_per_node x threads on CPU (x 1 when
                       threads is unknown), nprocs_per_node on GPUs. At the start, the load left by the
                       previous job on the host (its load_avg_end, decayed with the average's 60 s time
                       constant over the gap) is set aside: what remains above the cores this run leaves
                       free (+0.5) was other work. At the end, the expected load is that other work +
                       the decayed rest + busy threads x (1 - exp(-job time / 60 s)); a reading further
                       than 0.5 x host_cpus from it means other work started or stopped during the run.
  overlapped           two jobs on one machine (the same facts.machine, the kernel's boot id, which
                       containers share; else the same facts.host) whose [job_started_at, job_ended_at]
                       intervals (job_ended_at, else started_at + wall_s) intersect by more than 1 s:
                       each slowed the other (a sweep under a parallel launcher)
Facts a run lacks (older runs: threads, host_cpus, load_avg_*, job_ended_at, host, machine) give no warning.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import fsutil
from .recorder import METRICS_FILE, steady

EFFICIENCY_LIMIT = 1.05  # above this, per-device speed grew with the device count: not real
LOAD_TAU_S = 60.0  # time constant of Linux's 1-minute load average
LOAD_CHANGE_SHARE = 0.5  # of host_cpus: how far the end-of-job load may stray from the expected one
BUSY_MARGIN = 0.5  # runnable tasks of others tolerated at the start beyond the cores the run leaves free
OVERLAP_TOLERANCE_S = 1.0
# Facts that differ between repeats of one configuration (the job's own clock and load readings).
PER_RUN_FACTS = frozenset(
    {"seed", "repeat", "job_started_at", "job_ended_at", "load_avg_start", "load_avg_end", "resumed_from"}
    | {"command_started_at"}
    | {"sweep_varies"}  # this job's values of what the sweep varies: the run's name has them
)
REPEAT_KEYS = ("seed=", "repeat=", "+repeat=", "+seed=")


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
        per_epoch = self.values("perf/samples_per_s")
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
        return _number(self.facts.get("job_started_at")) or self.started_at

    @property
    def job_end(self) -> float | None:
        end = _number(self.facts.get("job_ended_at"))
        if end is None and self.started_at is not None and self.wall_s is not None:
            end = self.started_at + self.wall_s
        return end

    def job_time(self) -> float | None:
        start = _number(self.facts.get("job_started_at"))
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
        m = json.loads((run_dir / METRICS_FILE).read_text())
    except (OSError, ValueError) as exc:
        return Run(name, run_dir, f"unreadable ({type(exc).__name__})", {}, {}, {}, None)
    status = m.get("status", "unknown")
    if status == "running" and not (fsutil.held(run_dir) or fsutil.held(run_dir.parent)):
        status = "crashed"  # no live ddpexp process holds its directory (or its sweep's)
    return Run(
        name,
        run_dir,
        status,
        m.get("facts") or {},
        m.get("final") or {},
        m.get("best") or {},
        _number(m.get("started_at")),
        scalars=read_scalars(run_dir),
        history=[h for h in m.get("history") or [] if isinstance(h, dict)],
        wall_s=_number(m.get("wall_s")),
        time_to_first_step_s=_number(m.get("time_to_first_step_s")),
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


# ------------------------------------------------------------------------------ groups and rows


@dataclass
class Flag:
    """One warning, numbered across the whole report: [number] in the table, the text below it."""

    number: int
    text: str


@dataclass
class Row:
    """Runs of one configuration that differ only in seed or repeat (or one run that did not complete)."""

    name: str
    runs: list[Run]
    efficiency: float | None = None
    speedup: float | None = None  # median samples/s over the baseline's
    versus: str = "-"
    warnings: list[Flag] = field(default_factory=list)

    @property
    def facts(self) -> dict[str, Any]:
        return self.runs[0].facts

    @property
    def status(self) -> str:
        return self.runs[0].status

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def label(self) -> str:
        return strategy_label(self.facts)

    @property
    def devices(self) -> int:
        return self.runs[0].devices

    @property
    def metric(self) -> str:
        return self.runs[0].metric

    def throughputs(self) -> list[float]:
        return [t for r in self.runs if (t := r.throughput()) is not None]

    def per_run(self, value: Callable[[Run], float | None]) -> list[float]:
        return [v for r in self.runs if (v := value(r)) is not None and not math.isnan(v)]

    def median(self, value: Callable[[Run], float | None]) -> float | None:
        values = self.per_run(value)
        return statistics.median(values) if values else None

    def spread(self, value: Callable[[Run], float | None]) -> tuple[float, float] | None:
        values = self.per_run(value)
        return (min(values), max(values)) if values else None

    def per_device(self) -> float | None:
        tput = self.median(Run.throughput)
        return tput / self.devices if tput is not None else None


@dataclass
class Group:
    """Runs of one (model, data, global batch): the only runs whose numbers are compared."""

    model: str | None
    data: str | None
    global_batch_size: int | None
    rows: list[Row]
    baseline: Row | None = None
    context: str = ""
    notes: list[str] = field(default_factory=list)
    warnings: list[Flag] = field(default_factory=list)

    @property
    def title(self) -> str:
        batch = self.global_batch_size or "?"
        return f"{self.model or 'model ?'} on {self.data or 'data ?'}, global batch {batch}"

    def flags(self) -> list[Flag]:
        return [*self.warnings, *(flag for row in self.rows for flag in row.warnings)]


def group_runs(runs: list[Run], *, baseline: str | None = None) -> list[Group]:
    """Runs → groups of rows, each row compared with its group's baseline, every warning attached."""
    groups: dict[tuple[Any, ...], list[Run]] = {}
    for run in runs:
        f = run.facts
        groups.setdefault((f.get("model"), f.get("data"), f.get("global_batch_size")), []).append(run)
    out = []
    for (model, data, batch), members in sorted(groups.items(), key=lambda item: _group_order(item[0])):
        group = Group(model, data, batch, _rows(members), context=context_line(members))
        group.baseline = pick_baseline(group.rows, baseline)
        out.append(group)
    texts = {id(row): _run_warnings(row, runs) for group in out for row in group.rows}
    counter = itertools.count(1)  # warnings are numbered across the whole report
    for group in out:
        group_texts = _compare(group, baseline)
        group.notes = _notes(group)
        group.warnings = [Flag(next(counter), text) for text in group_texts]
        for row in group.rows:
            row_texts = [*_row_warnings(row), *texts[id(row)]]
            row.warnings = [Flag(next(counter), text) for text in row_texts]
    return out


def _group_order(key: tuple[Any, ...]) -> tuple[str, str, float]:
    model, data, batch = key
    return (str(model), str(data), batch if isinstance(batch, int | float) else math.inf)


def _rows(runs: list[Run]) -> list[Row]:
    rows: dict[Any, Row] = {}
    for run in runs:
        if run.status != "completed":
            rows[("run", run.name)] = Row(run.name, [run])
            continue
        name = repeat_free_name(run.name) or strategy_label(run.facts)
        facts = json.dumps({k: v for k, v in run.facts.items() if k not in PER_RUN_FACTS}, sort_keys=True)
        key = ("repeats", name, facts)
        if key in rows:
            rows[key].runs.append(run)
        else:
            rows[key] = Row(run.name, [run])
    for row in rows.values():
        if row.n > 1:
            row.name = repeat_free_name(row.runs[0].name) or row.label
    return list(rows.values())


def repeat_free_name(name: str) -> str:
    """A run's name without its seed=/repeat= parts: `seed=1,strategy=ddp` → `strategy=ddp`."""
    head, _, last = name.rpartition("/")
    kept = [part for part in last.split(",") if not part.startswith(REPEAT_KEYS)]
    return "/".join(p for p in (head, ",".join(kept)) if p)


def pick_baseline(rows: list[Row], named: str | None) -> Row | None:
    usable = [r for r in rows if r.status == "completed" and r.throughputs()]
    if named is not None:
        return next(
            (r for r in usable if named in (r.label, r.name) or any(run.name == named for run in r.runs)),
            None,
        )
    singles = [r for r in usable if r.facts.get("strategy") == "single"]
    if not singles:
        return None
    return min(singles, key=lambda r: (r.label != "single", -r.n))


def _compare(group: Group, named: str | None) -> list[str]:
    """Fill each row's efficiency and "vs baseline"; the group's own warning when it has no baseline."""
    base = group.baseline
    if base is None:
        if not any(row.throughputs() for row in group.rows):
            return []  # nothing to compare (failed runs only)
        which = f"no run or strategy named {named!r} here" if named else "no completed `single` run"
        return [
            f"{group.title}: no baseline ({which}): scaling efficiency not shown; name one with --baseline"
        ]
    base_per_device = base.per_device()
    for row in group.rows:
        per_device = row.per_device()
        if row.status != "completed" or per_device is None or not base_per_device:
            continue
        row.efficiency = per_device / base_per_device
        row.speedup, row.versus = versus(row, base)
    return []


def versus(row: Row, base: Row) -> tuple[float | None, str]:
    """The row's samples/s against the baseline's: a ratio of medians, or no ranking at all when
    the two min-max ranges overlap (the difference is within what repeating the run changes)."""
    if row is base:
        return 1.0, "baseline"
    ours, theirs = row.spread(Run.throughput), base.spread(Run.throughput)
    mine, base_median = row.median(Run.throughput), base.median(Run.throughput)
    if ours is None or theirs is None or mine is None or not base_median:
        return None, "-"
    ratio = mine / base_median
    if ours[0] <= theirs[1] and theirs[0] <= ours[1]:
        return ratio, "no measurable difference"
    text = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
    return ratio, text + (" (n=1)" if min(row.n, base.n) < 2 else "")


def context_line(runs: list[Run]) -> str:
    """What the runs ran on: "CPU, gloo, 2 cores on host vm" (distinct values joined by "/")."""
    devices = _distinct(
        _device_name(r.facts.get("device_type"))
        + (f" ({r.facts['gpu_name']})" if r.facts.get("gpu_name") else "")
        for r in runs
        if r.facts.get("device_type")
    )
    backends = _distinct(str(r.facts["backend"]) for r in runs if r.facts.get("backend"))
    cores = _distinct(str(r.facts["host_cpus"]) for r in runs if r.facts.get("host_cpus"))
    hosts = _distinct(str(r.facts["host"]) for r in runs if r.facts.get("host"))
    parts = [p for p in (devices, backends) if p]
    where = " ".join(p for p in (f"{cores} cores" if cores else "", f"on host {hosts}" if hosts else "") if p)
    return ", ".join([*parts, where] if where else parts)


def _device_name(device_type: Any) -> str:
    return {"cpu": "CPU", "cuda": "CUDA"}.get(str(device_type), str(device_type))


def _distinct(values: Iterable[str]) -> str:
    return "/".join(dict.fromkeys(values))


def _notes(group: Group) -> list[str]:
    notes = []
    for row in group.rows:
        if row.facts.get("strategy") == "dp" and row.facts.get("replicas") == 1:
            where = "on CPU" if row.facts.get("device_type") == "cpu" else "with one device"
            notes.append(
                f"{row.name}: dp had 1 replica: {where} DataParallel runs one replica, so it is `single` "
                "plus DataParallel's overhead"
            )
    return notes


# ------------------------------------------------------------------------------------- warnings


def _row_warnings(row: Row) -> list[str]:
    if row.efficiency is not None and row.efficiency > EFFICIENCY_LIMIT:
        return [
            f"{row.name}: scaling efficiency {row.efficiency:.2f} > {EFFICIENCY_LIMIT} cannot be real: "
            "the baseline was probably slowed by other load"
        ]
    return []


def _run_warnings(row: Row, everyone: list[Run]) -> list[str]:
    out = []
    for run in row.runs:
        out += oversubscription(run)
        out += load_warnings(run, previous_on_host(run, everyone))
        out += overlaps(run, everyone)
    return out


def busy_threads(facts: dict[str, Any]) -> int:
    """Runnable threads the run keeps busy: on CPU every intra-op thread of every process, on GPUs
    about one per process."""
    procs = int(facts.get("nprocs_per_node") or 1)
    threads = facts.get("threads")
    return procs * int(threads) if facts.get("device_type") == "cpu" and threads else procs


def oversubscription(run: Run) -> list[str]:
    f = run.facts
    procs, threads, cpus = f.get("nprocs_per_node"), f.get("threads"), f.get("host_cpus")
    if f.get("device_type") != "cpu" or not (procs and threads and cpus) or procs * threads <= cpus:
        return []
    return [
        f"{run.name}: oversubscribed: {procs} processes x {threads} threads = {procs * threads} busy "
        f"threads on {cpus} cores: they take turns, and the numbers describe that"
    ]


def same_machine(a: Run, b: Run) -> bool:
    """Whether two runs ran on one machine: the same facts.machine (the kernel's boot id, which
    containers on one machine share under different host names), else, for runs recorded before it
    was, the same facts.host."""
    if a.facts.get("machine") and b.facts.get("machine"):
        return bool(a.facts["machine"] == b.facts["machine"])
    return a.facts.get("host") is not None and a.facts.get("host") == b.facts.get("host")


def previous_on_host(run: Run, everyone: list[Run]) -> Run | None:
    """The job on the same machine that ended last before this one started."""
    start = run.job_start
    if start is None:
        return None
    before = [
        other
        for other in everyone
        if other is not run
        and same_machine(run, other)
        and (end := other.job_end) is not None
        and end <= start + OVERLAP_TOLERANCE_S
    ]
    return max(before, key=lambda other: other.job_end or 0.0, default=None)


def load_warnings(run: Run, previous: Run | None) -> list[str]:
    """Other work on the host at the start, or work that started or stopped during the run, read off
    the 1-minute load average with the run's own share (and the previous job's fading share) set aside."""
    f = run.facts
    start, end, cpus = _number(f.get("load_avg_start")), _number(f.get("load_avg_end")), f.get("host_cpus")
    if start is None or not cpus or run.job_start is None:
        return []
    busy = busy_threads(f)
    left = 0.0  # the previous job's load, fading
    if previous is not None and previous.job_end is not None:
        previous_end = _number(previous.facts.get("load_avg_end")) or 0.0
        left = previous_end * math.exp(-max(run.job_start - previous.job_end, 0.0) / LOAD_TAU_S)
    others = max(start - left, 0.0)
    out = []
    if others > max(cpus - busy, 0) + BUSY_MARGIN:
        out.append(
            f"{run.name}: host busy at the start: 1-min load {start:.1f} ({others:.1f} of it not left by "
            f"earlier jobs here) while this run keeps {busy} threads busy on {cpus} cores: others were "
            "running"
        )
    duration = run.job_time()
    if end is not None and duration is not None:
        fade = math.exp(-duration / LOAD_TAU_S)
        expected = others + left * fade + busy * (1 - fade)
        if abs(end - expected) > LOAD_CHANGE_SHARE * cpus:
            out.append(
                f"{run.name}: load changed during the run: 1-min load {start:.1f} at the start, {end:.1f} at "
                f"the end, {expected:.1f} expected from this run alone on {cpus} cores: other work "
                f"{'started' if end > expected else 'stopped'} meanwhile"
            )
    return out


def overlaps(run: Run, everyone: list[Run]) -> list[str]:
    host, start, end = run.facts.get("host"), run.job_start, run.job_end
    if start is None or end is None:
        return []
    shared = []
    for other in everyone:
        if other is run or not same_machine(run, other) or other.job_start is None or other.job_end is None:
            continue
        overlap = min(end, other.job_end) - max(start, other.job_start)
        if overlap > OVERLAP_TOLERANCE_S:
            shared.append((other.name, overlap, other.facts.get("host")))
    if not shared:
        return []
    names = ", ".join(name for name, _, _ in shared[:2]) + (
        f" and {len(shared) - 2} more" if len(shared) > 2 else ""
    )
    longest = max(overlap for _, overlap, _ in shared)
    hosts = list(dict.fromkeys(str(h) for h in [host, *(h for _, _, h in shared)] if h))
    if len(hosts) == 1:
        where = f"host {hosts[0]}"
    else:  # containers of one machine under their own names (or runs that recorded none)
        where = "one machine" + (f" (host names {', '.join(hosts)})" if hosts else "")
    return [
        f"{run.name}: ran at the same time as {names} on {where} (up to {longest:.0f} s of its "
        f"{end - start:.0f} s): each slowed the other, so neither measures its strategy alone"
    ]


# ----------------------------------------------------------------------------------------- table

COLUMNS = (
    "run",
    "status",
    "strategy",
    "n",
    "device",
    "backend",
    "procs/host",
    "threads",
    "replicas",
    "world",
    "batch (global/rank)",
    "final",
    "best",
    "time to target (s)",
    "train time (s)",
    "job time (s)",
    "samples/s",
    "per device",
    "scaling eff.",
    "vs baseline",
    "warnings",
    "comm share",
    "comm bytes/step",
    "bubble: measured/textbook",
    "staleness: mean/max",
    "peak mem (MB)",
    "per rank MB: params/grads/optim",
)


def table(group: Group, target: float) -> list[list[str]]:
    """One list of cells (in COLUMNS' order) per row of the group."""
    return [_cells(row, target) for row in group.rows]


def _cells(row: Row, target: float) -> list[str]:
    f = row.facts

    def final(key: str) -> float | None:
        return row.median(lambda r: _number(r.final.get(key)))

    return [
        row.name,
        row.status,
        row.label,
        str(row.n),
        str(f.get("device_type") or "-"),
        str(f.get("backend") or "-"),
        str(f.get("nprocs_per_node") or "-"),
        str(f.get("threads") or "-"),
        str(f.get("replicas") or "-"),
        str(f.get("world_size", "?")),
        f"{f.get('global_batch_size', '?')}/{f.get('per_rank_batch_size', '?')}",
        _accuracy(row, lambda r: r.final),
        _accuracy(row, lambda r: r.best),
        _time_to_target(row, target),
        _median_range(row, lambda r: r.wall_s, "{:.1f}"),
        _median_range(row, Run.job_time, "{:.1f}"),
        _median_range(row, Run.throughput, "{:,.0f}"),
        _num(row.per_device(), "{:,.0f}"),
        _num(row.efficiency, "{:.2f}"),
        row.versus,
        " ".join(f"[{flag.number}]" for flag in row.warnings) or "-",
        _pct(row.median(lambda r: r.mean("comm/share"))),
        _num(final("comm/bytes_per_step"), "{:,.0f}"),
        _pair(final("pipe/bubble_frac"), final("pipe/bubble_frac_textbook"), "{:.2f}"),
        _pair(final("ps/staleness_mean"), final("ps/staleness_max"), "{:.2f}", "{:.0f}"),
        _num(row.median(lambda r: r.peak("mem/peak_mb")), "{:,.0f}"),
        _resident([final(k) for k in ("mem/params_mb", "mem/grads_mb", "mem/optim_state_mb")]),
    ]


def _accuracy(row: Row, which: Callable[[Run], dict[str, Any]]) -> str:
    """One run: its value; several: mean ± sample standard deviation."""
    values = row.per_run(lambda r: _number(which(r).get(row.metric)))
    if not values:
        return "-"
    shown = _metric(row.metric, statistics.fmean(values))
    if len(values) < 2:
        return shown
    std = statistics.stdev(values)
    return f"{shown} ± {100 * std:.2f}" if _is_accuracy(row.metric) else f"{shown} ± {std:.2g}"


def _time_to_target(row: Row, target: float) -> str:
    shown = _median_range(row, lambda r: r.time_to(target), "{:.1f}")
    reached = len(row.per_run(lambda r: r.time_to(target)))
    return shown if reached in (0, row.n) else f"{shown}, {reached} of {row.n}"


def _median_range(row: Row, value: Callable[[Run], float | None], fmt: str) -> str:
    values = row.per_run(value)
    if not values:
        return "-"
    shown = fmt.format(statistics.median(values))
    return shown if len(values) < 2 else f"{shown} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def strategy_label(facts: dict[str, Any]) -> str:
    """The strategy and the settings it ran with that differ from its defaults, so that variants of one
    strategy (fsdp with and without reshard_after_forward, ddp with each comm_hook) read apart."""
    settings = dict(facts.get("strategy_settings") or {})
    syncbn = bool(settings.pop("sync_bn", facts.get("sync_bn")))
    shown = [f"{key}={_setting(value)}" for key, value in sorted(settings.items())]
    return " ".join([str(facts.get("strategy", "?")) + (" +syncbn" if syncbn else ""), *shown])


def _setting(value: Any) -> str:
    """As it is written on the command line: true/false, null."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


def _resident(values: list[float | None]) -> str:
    """Bytes per rank by category (max over ranks), counted from the tensors (ddpexp/memory.py)."""
    if any(v is None for v in values):
        return "-"
    return "/".join(f"{v:.2f}" for v in values if v is not None)


def _pair(first: float | None, second: float | None, fmt: str, second_fmt: str | None = None) -> str:
    """Two of a strategy's own last-epoch scalars as first/second; "-" for runs that do not log them."""
    if first is None and second is None:
        return "-"
    return f"{_num(first, fmt)}/{_num(second, second_fmt or fmt)}"


def _is_accuracy(tag: str) -> bool:
    return tag == "eval/acc" or tag.startswith("eval/top")


def _metric(tag: str, v: float | None) -> str:
    """Accuracies in %, anything else (eval/mse...) with its name."""
    if _is_accuracy(tag):
        return _pct(v)
    return "-" if v is None else f"{tag.removeprefix('eval/')} {v:.4g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def markdown(cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def plain(cells: list[list[str]]) -> str:
    """The table for a terminal: columns that are "-" in every row left out."""
    keep = [i for i in range(len(COLUMNS)) if i == 0 or any(row[i] != "-" for row in cells)]
    widths = {i: max(len(COLUMNS[i]), *(len(row[i]) for row in cells)) for i in keep}
    lines = ["  ".join(COLUMNS[i].ljust(widths[i]) for i in keep).rstrip()]
    lines += ["  ".join(row[i].ljust(widths[i]) for i in keep).rstrip() for row in cells]
    return "\n".join(lines)


def heading(group: Group) -> str:
    base = f"baseline: {group.baseline.name}" if group.baseline else "no baseline"
    return f"{group.title} — {group.context or 'hardware unknown'}; {base}"


# --------------------------------------------------------------------------------- csv and json


def records(groups: list[Group], target: float) -> list[dict[str, Any]]:
    """One record per row, numbers as numbers (None where a row has none)."""
    return [_record(group, row, target) for group in groups for row in group.rows]


def _record(group: Group, row: Row, target: float) -> dict[str, Any]:
    f = row.facts
    tput = row.spread(Run.throughput)
    reach = row.spread(lambda r: r.time_to(target))
    finals = row.per_run(lambda r: _number(r.final.get(row.metric)))

    def final(key: str) -> float | None:
        return row.median(lambda r: _number(r.final.get(key)))

    return {
        "model": group.model,
        "data": group.data,
        "global_batch_size": group.global_batch_size,
        "context": group.context,
        "baseline": group.baseline.name if group.baseline else None,
        "run": row.name,
        "runs": [r.name for r in row.runs],
        "status": row.status,
        "strategy": row.label,
        "n": row.n,
        "device_type": f.get("device_type"),
        "gpu_name": f.get("gpu_name"),
        "backend": f.get("backend"),
        "host": f.get("host"),
        "host_cpus": f.get("host_cpus"),
        "nprocs_per_node": f.get("nprocs_per_node"),
        "threads": f.get("threads"),
        "replicas": f.get("replicas"),
        "world_size": f.get("world_size"),
        "devices": row.devices,
        "per_rank_batch_size": f.get("per_rank_batch_size"),
        "metric": row.metric,
        "final_mean": statistics.fmean(finals) if finals else None,
        "final_std": statistics.stdev(finals) if len(finals) > 1 else None,
        "best_mean": _mean(row.per_run(lambda r: _number(r.best.get(row.metric)))),
        "time_to_target_s_median": row.median(lambda r: r.time_to(target)),
        "time_to_target_s_min": reach[0] if reach else None,
        "time_to_target_s_max": reach[1] if reach else None,
        "reached_target": len(row.per_run(lambda r: r.time_to(target))),
        "train_time_s_median": row.median(lambda r: r.wall_s),
        "job_time_s_median": row.median(Run.job_time),
        "samples_per_s_median": row.median(Run.throughput),
        "samples_per_s_min": tput[0] if tput else None,
        "samples_per_s_max": tput[1] if tput else None,
        "samples_per_s_per_device": row.per_device(),
        "scaling_efficiency": row.efficiency,
        "speedup_vs_baseline": row.speedup,
        "vs_baseline": row.versus,
        "comm_share": row.median(lambda r: r.mean("comm/share")),
        "comm_bytes_per_step": final("comm/bytes_per_step"),
        "bubble_frac": final("pipe/bubble_frac"),
        "bubble_frac_textbook": final("pipe/bubble_frac_textbook"),
        "staleness_mean": final("ps/staleness_mean"),
        "staleness_max": final("ps/staleness_max"),
        "peak_mem_mb": row.median(lambda r: r.peak("mem/peak_mb")),
        "params_mb": final("mem/params_mb"),
        "grads_mb": final("mem/grads_mb"),
        "optim_state_mb": final("mem/optim_state_mb"),
        "notes": [note for note in group.notes if note.startswith(f"{row.name}:")],
        "warnings": [flag.text for flag in [*group.warnings, *row.warnings]],
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else [])
    writer.writeheader()
    for record in rows:
        writer.writerow(
            {
                k: "; ".join(map(str, v)) if isinstance(v, list) else ("" if v is None else v)
                for k, v in record.items()
            }
        )
    fsutil.atomic_write_text(path, buffer.getvalue())


# ----------------------------------------------------------------------------------------- plots

MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", ":", "-.")
Predicted = Mapping[str, Sequence[tuple[int, float]]]  # strategy label -> [(devices, efficiency)]


def colours(groups: list[Group]) -> dict[str, Any]:
    """One colour per strategy label, the same in every plot: sorted labels → tab10 (tab20 past ten)."""
    from matplotlib import colormaps

    labels = sorted({row.label for group in groups for row in group.rows})
    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def plots(
    groups: list[Group], out: Path, *, target: float, predicted: Callable[[Group], Predicted] | None = None
) -> list[Path]:
    palette = colours(groups)
    title = context_line([run for group in groups for row in group.rows for run in row.runs])
    figures = {
        "acc_vs_time.png": accuracy_figure(groups, palette=palette, title=title, target=target),
        "loss_vs_step.png": loss_figure(groups, palette=palette, title=title),
        "throughput.png": throughput_figure(groups, palette=palette, title=title),
        "scaling.png": scaling_figure(groups, palette=palette, title=title, predicted=predicted),
    }
    return [_save(fig, out / name) for name, fig in figures.items() if fig is not None]


def prediction(source: str) -> Callable[[Group], Predicted]:
    """Each group's predicted curves (ddpexp/predict.py): every strategy label of the group, from the
    group's baseline run, at 1 to max(4, the most devices measured) devices. A strategy the model cannot
    predict from that run is left out with a warning on stdout."""
    from .errors import UserError
    from .predict import predict_curve

    bench = source if source.endswith(".json") else None
    profile = None if bench else source

    def curves(group: Group) -> Predicted:
        if group.baseline is None:
            return {}
        base = group.baseline.runs[0]
        devices = list(range(1, max(4, *(row.devices for row in group.rows)) + 1))
        out: dict[str, list[tuple[int, float]]] = {}
        for row in group.rows:
            if row is group.baseline or row.label in out:
                continue
            settings = [f"{k}={_setting(v)}" for k, v in (row.facts.get("strategy_settings") or {}).items()]
            try:
                out[row.label] = predict_curve(
                    base.path,
                    devices,
                    interconnect=profile,
                    commbench=bench,
                    strategy=row.facts.get("strategy"),
                    settings=settings,
                )
            except UserError as exc:
                print(f"warning: no prediction for {row.label}: {exc}")
        return out

    return curves


def plot_scaling(
    groups: list[Group], path: Path, *, title: str = "", predicted: Predicted | None = None
) -> Path | None:
    """scaling.png with predicted curves (a cost model's) next to the measured points; None when no
    group has a baseline and either several device counts or predictions."""
    fig = scaling_figure(groups, palette=colours(groups), title=title, predicted=predicted)
    return _save(fig, path) if fig is not None else None


def _figure(panels: int, title: str, what: str) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 1.2 + 3.3 * panels))  # not pyplot's: nothing global to close
    axes = fig.subplots(panels, 1, squeeze=False)
    fig.suptitle(f"{what} — {title}" if title else what, fontsize=10)
    return fig, [ax for (ax,) in axes]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _row_styles(group: Group, palette: dict[str, Any]) -> Iterable[tuple[Row, dict[str, Any]]]:
    """Each row's colour (its strategy's) and a marker telling rows of one strategy apart."""
    seen: dict[str, int] = {}
    for row in group.rows:
        index = seen[row.label] = seen.get(row.label, -1) + 1
        style = LINESTYLES[index % len(LINESTYLES)]
        yield row, {"color": palette[row.label], "marker": MARKERS[index % len(MARKERS)], "linestyle": style}


def accuracy_figure(groups: list[Group], *, palette: dict[str, Any], title: str, target: float) -> Any:
    """The best metric (accuracies in %) against seconds since each job started, with the target."""
    fig, axes = _figure(len(groups), title, "Eval metric vs time since the job started")
    for group, ax in zip(groups, axes, strict=True):
        metrics = sorted({row.metric for row in group.rows})
        percent = all(_is_accuracy(tag) for tag in metrics)
        scale = 100.0 if percent else 1.0
        for row, style in _row_styles(group, palette):
            for i, run in enumerate(row.runs):
                points = run.scalars.get(run.metric, [])
                if points and run.job_start is not None:
                    x = [wall - run.job_start for _, _, wall in points]
                    y = [value * scale for _, value, _ in points]
                    ax.plot(x, y, **style, ms=4, lw=1.2, label=row.name if i == 0 else None)
        shown = f"{100 * target:g}%" if percent else f"{target:g}"
        ax.axhline(target * scale, color="grey", ls="--", lw=1, label=f"target {shown}")
        ylabel = "eval accuracy (%)" if percent else ", ".join(metrics)
        ax.set(xlabel="seconds since the job started", ylabel=ylabel, title=group.title)
        _legend(ax)
    return fig


def loss_figure(groups: list[Group], *, palette: dict[str, Any], title: str) -> Any:
    fig, axes = _figure(len(groups), title, "Training loss vs step")
    for group, ax in zip(groups, axes, strict=True):
        for row, style in _row_styles(group, palette):
            for i, run in enumerate(row.runs):
                points = run.scalars.get("train/loss", [])
                if points:
                    steps, losses = [s for s, _, _ in points], [v for _, v, _ in points]
                    colour, dashes = style["color"], style["linestyle"]
                    ax.plot(steps, losses, color=colour, ls=dashes, lw=1, label=row.name if i == 0 else None)
        ax.set(xlabel="optimizer step", ylabel="train loss", title=group.title)
        _legend(ax)
    return fig


def throughput_figure(groups: list[Group], *, palette: dict[str, Any], title: str) -> Any:
    """Median samples/s per row, labelled; min-max error bars where a row has repeats."""
    fig, axes = _figure(len(groups), title, "Throughput (median; bars: min-max of repeats)")
    for group, ax in zip(groups, axes, strict=True):
        rows = [row for row in group.rows if row.throughputs()][::-1]  # barh draws bottom-up
        medians = [row.median(Run.throughput) or 0.0 for row in rows]
        ax.barh([row.name for row in rows], medians, color=[palette[row.label] for row in rows])
        top = max((row.spread(Run.throughput) or (0.0, 1.0))[1] for row in rows) if rows else 1.0
        for y, (row, median) in enumerate(zip(rows, medians, strict=True)):
            low, high = row.spread(Run.throughput) or (median, median)
            if row.n > 1:
                ax.errorbar(median, y, xerr=[[median - low], [high - median]], color="black", capsize=3)
            text = f"{median:,.0f}" + (f" (n={row.n})" if row.n > 1 else "")
            ax.text(high + top * 0.01, y, text, va="center", fontsize=8)
        ax.set_xlim(0, top * 1.25)
        ax.set(xlabel="samples/s (all devices)", title=group.title)
    return fig


def scaling_figure(
    groups: list[Group],
    *,
    palette: dict[str, Any],
    title: str,
    predicted: Predicted | Callable[[Group], Predicted] | None = None,
) -> Any | None:
    """Scaling efficiency against devices, one panel per group that has a baseline and either several
    device counts or predictions; error bars from the repeats' min-max samples/s. `predicted`
    ({strategy label: [(devices, efficiency), ...]}, e.g. from a cost model) is drawn as dashed lines
    in the strategy's colour on every panel: pass the groups it was predicted for; or a function
    giving each group's own (`--predict`)."""
    predicted = predicted or {}
    shown = [
        g
        for g in groups
        if g.baseline and (predicted or len({r.devices for r in g.rows if r.efficiency is not None}) > 1)
    ]
    if not shown:
        return None
    fig, axes = _figure(len(shown), title, "Scaling efficiency vs devices")
    for group, ax in zip(shown, axes, strict=True):
        ticks = _plot_measured(group, ax, palette)
        curves = predicted(group) if callable(predicted) else predicted
        for label, points in sorted(curves.items()):
            devices, efficiency = zip(*sorted(points), strict=True) if points else ((), ())
            colour = palette.get(label, "black")
            ax.plot(devices, efficiency, ls="--", marker="x", color=colour, label=f"{label} (predicted)")
            ticks |= set(devices)
        ax.axhline(1.0, color="grey", lw=0.8, label="linear scaling")
        ax.set_xticks(sorted(ticks))  # device counts are whole numbers: no tick at 1.5 devices
        ax.set_xlim(min(ticks) - 0.5, max(ticks) + 0.5)
        ax.margins(y=0.1)  # room above the highest marker
        ax.set_ylim(bottom=0)
        base = group.baseline.name if group.baseline else "-"
        ax.set(xlabel="devices", ylabel="scaling efficiency", title=f"{group.title} (baseline: {base})")
        _legend(ax)
    return fig


def _plot_measured(group: Group, ax: Any, palette: dict[str, Any]) -> set[int]:
    """The group's measured efficiencies: a line per series (rows of one strategy label over device
    counts), error bars from the repeats' min-max samples/s."""
    base = group.baseline.per_device() if group.baseline else None
    ticks: set[int] = set()
    for label, index, rows in _series([row for row in group.rows if row.efficiency is not None]):
        x = [row.devices for row in rows]
        y = [row.efficiency or 0.0 for row in rows]
        low, high = [], []
        for row, eff in zip(rows, y, strict=True):
            lo, hi = row.spread(Run.throughput) or (0.0, 0.0)
            low.append(eff - lo / row.devices / base if base else 0.0)
            high.append(hi / row.devices / base - eff if base else 0.0)
        name = label if index == 0 else f"{label}: {', '.join(row.name for row in rows)}"
        marker = MARKERS[index % len(MARKERS)]
        ax.errorbar(x, y, yerr=[low, high], color=palette[label], marker=marker, capsize=3, label=name)
        ticks |= set(x)
    return ticks


def _series(rows: list[Row]) -> list[tuple[str, int, list[Row]]]:
    """Rows of one strategy label joined over device counts; a second row at a device count already
    taken (another thread count, say) starts a series of its own rather than a vertical line."""
    series: dict[str, list[list[Row]]] = {}
    for row in rows:
        lines = series.setdefault(row.label, [])
        line = next((ln for ln in lines if all(r.devices != row.devices for r in ln)), None)
        if line is None:
            lines.append([row])
        else:
            line.append(row)
    return [
        (label, index, sorted(line, key=lambda row: row.devices))
        for label, lines in sorted(series.items())
        for index, line in enumerate(lines)
    ]


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


# ------------------------------------------------------------------------------------------- main


def render_markdown(groups: list[Group], *, dirs: list[Path], target: float, images: list[Path]) -> str:
    runs = sum(row.n for group in groups for row in group.rows)
    body = [
        f"# ddpexp report: {', '.join(map(str, dirs))}",
        "",
        f"{runs} runs in {len(groups)} group(s); time to target = seconds from the job's start until the "
        f"best metric first reached {target:g}.",
    ]
    for group in groups:
        body += ["", f"## {heading(group)}", "", markdown(table(group, target)), ""]
        body += [f"- note: {note}" for note in group.notes]
        body += [f"- [{flag.number}] warning: {flag.text}" for flag in group.flags()]
    body += ["", *(f"![{p.stem}]({p.name})" for p in images), ""]
    return "\n".join(body)


def render_plain(groups: list[Group], target: float) -> str:
    lines: list[str] = []
    for group in groups:
        lines += [heading(group), plain(table(group, target))]
        lines += [f"note: {note}" for note in group.notes]
        lines += [f"warning [{flag.number}]: {flag.text}" for flag in group.flags()]
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ddpexp-report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep or run directories")
    parser.add_argument(
        "--target", type=float, default=0.95, help="best-metric value for 'time to target' (0.95)"
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the first dir)")
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="NAME",
        help="the row efficiency is measured against: a strategy label (single, 'ddp comm_hook=bf16') "
        "or a run's name (default: each group's `single` run)",
    )
    parser.add_argument(
        "--predict",
        default=None,
        metavar="PROFILE|commbench.json",
        help="scaling.png also shows ddpexp-predict's curves for each strategy of a group, from the "
        "group's single run and this interconnect (conf/interconnect: localhost_gloo, nvlink4, ib400...) "
        "or commbench result",
    )
    parser.add_argument(
        "--format",
        choices=("md", "csv", "json"),
        default="md",
        help="report.md (default), report.csv or report.json",
    )
    args = parser.parse_args(argv)
    missing = [d for d in args.dirs if not d.is_dir()]
    if missing:
        print(f"ddpexp-report: error: {missing[0]} is not a directory", file=sys.stderr)
        sys.exit(2)
    runs = find_runs(args.dirs)
    if not runs:
        print(
            f"ddpexp-report: error: no runs (metrics.json) under {', '.join(map(str, args.dirs))}",
            file=sys.stderr,
        )
        sys.exit(2)
    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, baseline=args.baseline)
    predicted = prediction(args.predict) if args.predict else None
    images = plots(groups, out, target=args.target, predicted=predicted)
    path = out / f"report.{args.format}"
    if args.format == "md":
        text = render_markdown(groups, dirs=args.dirs, target=args.target, images=images)
        fsutil.atomic_write_text(path, text)
    elif args.format == "csv":
        write_csv(path, records(groups, args.target))
    else:
        fsutil.atomic_write_text(path, json.dumps(records(groups, args.target), indent=1) + "\n")
    print(render_plain(groups, args.target))
    print(f"report: {path}")


if __name__ == "__main__":
    main()

"""Runs pooled into rows and groups, and each row compared with its group's baseline (the rules are in
the package's docstring: group, row, baseline, vs baseline)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..runrecord import strategy_label
from .host_warnings import run_warnings
from .runs import Run

EFFICIENCY_LIMIT = 1.05  # above this, per-device speed grew with the device count: not real
# Facts that differ between repeats of one configuration (the job's own clock and load readings).
PER_RUN_FACTS = frozenset(
    {"seed", "repeat", "job_started_at", "job_ended_at", "load_avg_start", "load_avg_end", "resumed_from"}
    | {"command_started_at"}
    | {"sweep_varies"}  # this job's values of what the sweep varies: the run's name has them
)
REPEAT_KEYS = ("seed=", "repeat=", "+repeat=", "+seed=")


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
    texts = {id(row): run_warnings(row.runs, runs) for group in out for row in group.rows}
    counter = itertools.count(1)  # warnings are numbered across the whole report
    for group in out:
        group_texts = _compare(group, baseline)
        group.notes = _notes(group)
        group.warnings = [Flag(next(counter), text) for text in group_texts]
        for row in group.rows:
            row_texts = [*efficiency_warnings(row), *texts[id(row)]]
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


def efficiency_warnings(row: Row) -> list[str]:
    """More than linear per-device speed cannot be real: the baseline was slowed."""
    if row.efficiency is not None and row.efficiency > EFFICIENCY_LIMIT:
        return [
            f"{row.name}: scaling efficiency {row.efficiency:.2f} > {EFFICIENCY_LIMIT} cannot be real: "
            "the baseline was probably slowed by other load"
        ]
    return []

"""Runs pooled into rows and groups, and each row compared with its group's baseline (the rules are in
the package's docstring: group, row, baseline, vs baseline)."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable
from typing import Any

from ..runrecord import strategy_label
from .host_warnings import run_warnings
from .labels import distinct_labels, repeat_free_name
from .rows import EFFICIENCY_LIMIT, Flag, Group, Row, pick_baseline
from .runs import Run
from .weak import covered, weak_scaling

# Facts that differ between repeats of one configuration (the job's own clock and load readings).
PER_RUN_FACTS = frozenset(
    {"seed", "repeat", "job_started_at", "job_ended_at", "load_avg_start", "load_avg_end", "resumed_from"}
    | {"command_started_at"}
    | {"sweep_varies"}  # this job's values of what the sweep varies: the run's name has them
)


def group_runs(runs: list[Run], *, baseline: str | None = None) -> list[Group]:
    """Runs → groups of rows, each row compared with its group's baseline, every warning attached."""
    groups: dict[tuple[Any, ...], list[Run]] = {}
    for run in runs:
        f = run.facts
        groups.setdefault((f.get("model"), f.get("data"), f.get("global_batch_size")), []).append(run)
    out = []
    for (model, data, batch), members in sorted(groups.items(), key=lambda item: _group_order(item[0])):
        group = Group(model, data, batch, _rows(members), context=context_line(members))
        labels = distinct_labels([(row.strategy, row.name) for row in group.rows])
        for row, label in zip(group.rows, labels, strict=True):
            row.label = label
        group.baseline = pick_baseline(group.rows, baseline)
        out.append(group)
    texts = {id(row): run_warnings(row.runs, runs) for group in out for row in group.rows}
    counter = itertools.count(1)  # warnings are numbered across the whole report
    series = weak_scaling(out)
    for group in out:
        weak = covered(group, series) if group.baseline is None and baseline is None else None
        group_texts = ([] if weak else _compare(group, baseline)) + data_warnings(group)
        group.notes = _notes(group)
        if weak:  # a weak-scaling step: its comparison is the series', not a missing baseline
            group.weak = weak.title
            group.notes.append(
                f"{group.title}: no one-process run at this global batch, so no strong-scaling "
                f"efficiency; compared in weak scaling: {weak.title}"
            )
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
            row.name = repeat_free_name(row.runs[0].name) or row.strategy
    return list(rows.values())


def _compare(group: Group, named: str | None) -> list[str]:
    """Fill each row's efficiency and "vs baseline"; the group's own warning when it has no baseline."""
    base = group.baseline
    if base is None:
        if not any(row.throughputs() for row in group.rows):
            return []  # nothing to compare (failed runs only)
        which = f"no run or strategy named {named!r} here" if named else "no completed one-process run"
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


def data_warnings(group: Group) -> list[str]:
    """Runs of one group that read different data (facts.data_fingerprint: another Python's standard
    library, an edited corpus, another vocabulary): their losses cannot be compared."""
    runs = [run for row in group.rows for run in row.runs]
    prints = {str(run.facts["data_fingerprint"]) for run in runs if run.facts.get("data_fingerprint")}
    if len(prints) < 2:
        return []
    pythons = sorted(
        {str(f["python"]) for run in runs if (f := run.facts.get("data_facts") or {}).get("python")}
    )
    on = f" (Python {', '.join(pythons)})" if len(pythons) > 1 else ""
    return [
        f"{group.title}: the runs read different data{on}, {len(prints)} data fingerprints: their losses "
        "and accuracies are not comparable"
    ]


def efficiency_warnings(row: Row) -> list[str]:
    """More than linear per-device speed cannot be real: the baseline was slowed."""
    if row.efficiency is not None and row.efficiency > EFFICIENCY_LIMIT:
        return [
            f"{row.name}: scaling efficiency {row.efficiency:.2f} > {EFFICIENCY_LIMIT} cannot be real: "
            "the baseline was probably slowed by other load"
        ]
    return []

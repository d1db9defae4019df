"""The report's table: one row of cells per pooled row (COLUMNS, then the strategies' own columns),
as markdown or for a terminal."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from ..runrecord import finite_number, is_accuracy
from .rows import EFFICIENCY_LIMIT, Group, Row
from .runs import Run
from .weak import WeakSeries

ACT = "mem/activations_mb"

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
    "bytes moved (MB)",
    "peak mem (MB)",
    "per rank MB: params/grads/optim/act",
)


# Groups whose data has tokens (facts.tokens_per_sample) get these after "per device".
TOKEN_COLUMNS = ("tokens/s", "MFU")
# Groups with a mixture of experts get this after them: the worst layer's busiest expert over the mean
# (1.00: balanced), and the share of choices a capacity dropped where it dropped any.
ROUTING_COLUMN = "expert load max/mean"


def table(group: Group, target: float) -> tuple[list[str], list[list[str]]]:
    """The header (COLUMNS, with TOKEN_COLUMNS for data with tokens, then the columns the group's
    strategies declare for scalars of their own) and one list of cells per row of the group."""
    declared = strategy_columns(group.rows)
    at = COLUMNS.index("per device") + 1
    tokens = any(row.facts.get("tokens_per_sample") for row in group.rows)
    routed = any(_final(row, "moe/load_max_over_mean") is not None for row in group.rows)

    def spliced(cells: list[str], extra: list[str], routing: list[str]) -> list[str]:
        return [*cells[:at], *(extra if tokens else []), *(routing if routed else []), *cells[at:]]

    header = spliced(list(COLUMNS), list(TOKEN_COLUMNS), [ROUTING_COLUMN]) + list(declared)
    rows = [
        spliced(_cells(row, target), _token_cells(row), [_routing_cell(row)]) + _strategy_cells(row, declared)
        for row in group.rows
    ]
    return header, rows


def _routing_cell(row: Row) -> str:
    load, dropped = _final(row, "moe/load_max_over_mean"), _final(row, "moe/dropped_frac")
    shown = format_cell(load, "{:.2f}")
    return f"{shown}, {_pct(dropped)} dropped" if dropped else shown


def _token_cells(row: Row) -> list[str]:
    """tokens/s as samples/s is shown (median, min-max); MFU the median, in %."""
    return [_median_range(row, Run.token_throughput, "{:,.0f}"), _pct(row.median(Run.mfu))]


def strategy_columns(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Heading -> column, for every column a row's strategy declared (facts.strategy_columns, written
    from the strategy's `report_columns`), in the order they first appear."""
    declared: dict[str, dict[str, Any]] = {}
    for row in rows:
        for column in row.facts.get("strategy_columns") or []:
            declared.setdefault(str(column["heading"]), column)
    return declared


def _strategy_cells(row: Row, declared: dict[str, dict[str, Any]]) -> list[str]:
    """A declared column's last-epoch values joined by "/"; "-" for runs whose strategy lacks it."""
    own = {str(c["heading"]) for c in row.facts.get("strategy_columns") or []}
    cells = []
    for heading, column in declared.items():
        values = [_final(row, str(tag)) for tag in column["tags"]]
        if heading not in own or all(v is None for v in values):
            cells.append("-")
            continue
        formats = list(column.get("formats") or ["{:.2f}"])
        formats += formats[-1:] * (len(values) - len(formats))
        cells.append("/".join(format_cell(v, fmt) for v, fmt in zip(values, formats, strict=False)))
    return cells


def _final(row: Row, tag: str) -> float | None:
    """The median over the row's runs of a scalar's last-epoch value."""
    return row.median(lambda r: finite_number(r.final.get(tag)))


def _cells(row: Row, target: float) -> list[str]:
    f = row.facts

    def final(key: str) -> float | None:
        return row.median(lambda r: finite_number(r.final.get(key)))

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
        format_cell(row.per_device(), "{:,.0f}"),
        format_cell(row.efficiency, "{:.2f}"),
        row.versus,
        " ".join(f"[{flag.number}]" for flag in row.warnings) or "-",
        _pct(row.median(lambda r: r.mean("comm/share"))),
        format_cell(final("comm/bytes_per_step"), "{:,.0f}"),
        format_cell(_mb(row.median(Run.bytes_moved)), "{:,.1f}"),
        format_cell(row.median(lambda r: r.peak("mem/peak_mb")), "{:,.0f}"),
        _resident(
            [final(k) for k in ("mem/params_mb", "mem/grads_mb", "mem/optim_state_mb")],
            final(ACT),
            final("mem/host_mb"),
        ),
    ]


def _mb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e6


def _accuracy(row: Row, which: Callable[[Run], dict[str, Any]]) -> str:
    """One run: its value; several: mean ± sample standard deviation."""
    values = row.per_run(lambda r: finite_number(which(r).get(row.metric)))
    if not values:
        return "-"
    shown = _metric(row.metric, statistics.fmean(values))
    if len(values) < 2:
        return shown
    std = statistics.stdev(values)
    return f"{shown} ± {100 * std:.2f}" if is_accuracy(row.metric) else f"{shown} ± {std:.2g}"


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


def _resident(values: list[float | None], activations: float | None, host: float | None = None) -> str:
    """Bytes per rank by category (max over ranks), counted from the tensors (ddpexp/memory.py); runs
    recorded before activations were measured show "-" for them. What of them the host holds
    (offload), where anything."""
    if any(v is None for v in values):
        return "-"
    shown = "/".join([*(f"{v:.2f}" for v in values if v is not None), format_cell(activations, "{:.2f}")])
    return f"{shown} (host {host:.2f})" if host else shown


def _metric(tag: str, v: float | None) -> str:
    """Accuracies in %, anything else (eval/mse...) with its name."""
    if is_accuracy(tag):
        return _pct(v)
    return "-" if v is None else f"{tag.removeprefix('eval/')} {v:.4g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def format_cell(v: float | None, fmt: str) -> str:
    """A number as a table cell: formatted with `fmt`, or "-" when there is none (None or NaN).
    (Reading a record's value as a number, or None, is ddpexp.runrecord.finite_number.)"""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def markdown(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def plain(header: list[str], cells: list[list[str]]) -> str:
    """The table for a terminal: columns that are "-" in every row left out."""
    keep = [i for i in range(len(header)) if i == 0 or any(row[i] != "-" for row in cells)]
    widths = {i: max(len(header[i]), *(len(row[i]) for row in cells)) for i in keep}
    lines = ["  ".join(header[i].ljust(widths[i]) for i in keep).rstrip()]
    lines += ["  ".join(row[i].ljust(widths[i]) for i in keep).rstrip() for row in cells]
    return "\n".join(lines)


WEAK_COLUMNS = ("run", "strategy", "devices", "global batch", "samples/s", "per device", "weak scaling eff.")


def weak_table(series: WeakSeries) -> tuple[list[str], list[list[str]]]:
    """A weak-scaling series: per device count, samples/s per device against the one-process run's;
    an efficiency above EFFICIENCY_LIMIT is marked, as it cannot be real."""
    cells = []
    for row in series.rows:
        efficiency = series.efficiency[id(row)]
        shown = f"{efficiency:.2f}" + (" (impossible)" if efficiency > EFFICIENCY_LIMIT else "")
        cells.append(
            [
                row.name,
                row.label,
                str(row.devices),
                str(row.facts.get("global_batch_size", "?")),
                _median_range(row, Run.throughput, "{:,.0f}"),
                format_cell(row.per_device(), "{:,.0f}"),
                "baseline" if row is series.baseline else shown,
            ]
        )
    return list(WEAK_COLUMNS), cells


def heading(group: Group) -> str:
    if group.baseline:
        base = f"baseline: {group.baseline.name}"
    else:
        base = "compared in weak scaling (below)" if group.weak else "no baseline"
    return f"{group.title} — {group.context or 'hardware unknown'}; {base}"

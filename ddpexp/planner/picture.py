"""`ddpexp plan --plot FILE`: which plan, and what each other one gives up, at a glance. One bar per
plan that runs, in the table's order, the recommended one first and marked: its predicted time to the
target (without a target, its step time) on the bottom axis, in a unit that fits, the cost on the top
axis (on one cluster cost is time x devices x price, so one bar says both), the range the held-out
validation puts around it as an error bar, and at its end what it costs against the recommendation
(+N% time) or why it does not fit. Plan names are the bars' labels, so they never overlap however
many plans there are."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_bytes
from ..predict.validation import Validation
from .estimate import Estimate
from .profiles import Cluster

UNITS = [("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0), ("seconds", 1.0), ("ms", 1e-3)]


def axes(r: Estimate, cluster: Cluster, job: Any) -> tuple[float, float]:
    """(time, cost) of a plan: to the target in hours and USD; without one, a step in seconds and USD
    per million tokens."""
    if job.target_tokens:
        return r.time_s / 3600, r.cost
    dollars_per_second = cluster.devices * cluster.price_per_device_hour / 3600
    return r.step_s, dollars_per_second / r.tokens_per_s * 1e6


def span(r: Estimate, cluster: Cluster, job: Any, spread: Validation) -> list[tuple[float, float]]:
    """The two ends of a plan's range: its point with the step time at the validation's smallest and
    largest measured / predicted (both axes scale with the step time, with a target or without)."""
    x, y = axes(r, cluster, job)
    return [(x * k, y * k) for k in (spread.low, spread.high)]


def unit_for(seconds: float) -> tuple[str, float]:
    """The largest unit in which `seconds` is at least 1."""
    return next(((name, size) for name, size in UNITS if seconds >= size), UNITS[-1])


def figure(results: list[Estimate], cluster: Cluster, job: Any, spread: Validation) -> Any:
    """The picture as a matplotlib Figure (results in the table's order: the recommendation first)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [r for r in results if r.note is None and math.isfinite(r.step_s)]
    target = bool(job.target_tokens)
    seconds = [(r.time_s if target else r.step_s) for r in runs]
    fitting = [s for r, s in zip(runs, seconds, strict=True) if r.fits]
    unit, size = unit_for(max(fitting or seconds or [1.0]))
    best = next((r for r in runs if r.fits), None)
    fig = Figure(figsize=(10, 1.6 + 0.32 * max(len(runs), 1)))
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot's global state
    ax = fig.add_subplot()
    rows = list(range(len(runs)))[::-1]  # the first plan on top
    for row, r, s in zip(rows, runs, seconds, strict=True):
        color = "tab:green" if r is best else "tab:blue" if r.fits else "0.8"
        value = s / size
        low, high = value * spread.low, value * spread.high
        ax.barh(row, value, color=color, height=0.6, zorder=2)
        if r.fits:
            ax.errorbar(
                value, row, xerr=[[value - low], [high - value]], color="0.25", capsize=3, lw=1, zorder=3
            )
        if r is best:
            said = "recommended"
        elif not r.fits:
            said = f"does not fit: {r.largest}"
        else:
            more = (s / (best.time_s if target else best.step_s) - 1) * 100 if best else math.nan
            said = f"+{more:.0f}% time and cost" if target else f"+{more:.0f}% step time"
        ax.annotate(
            said,
            (high if r.fits else value, row),
            textcoords="offset points",
            xytext=(6, 0),
            va="center",
            fontsize=8,
            color="0.2" if r.fits else "0.5",
            fontweight="bold" if r is best else "normal",
        )
    ax.set_yticks(rows, [("\u2605 " if r is best else "") + r.label for r in runs], fontsize=8)
    for tick, r in zip(ax.get_yticklabels(), runs, strict=True):
        tick.set_color("black" if r.fits else "0.55")
    values = [s / size for s in seconds]
    if values and min(values) > 0 and max(values) / min(values) > 30:
        ax.set_xscale("log")
    ax.set_xlim(right=max(values or [1.0]) * spread.high * 1.45)
    if target:
        ax.set_xlabel(f"time to {job.target_tokens:,.0f} tokens ({unit}; error bars: the validation's range)")
        per_unit = cluster.devices * cluster.price_per_device_hour / 3600 * size  # USD per unit of time
        top = "cost (USD)"
    else:
        ax.set_xlabel(f"step time ({unit}; error bars: the validation's range)")
        tokens_per_step = job.global_batch * job.seq_len
        per_unit = cluster.devices * cluster.price_per_device_hour / 3600 * size / tokens_per_step * 1e6
        top = "cost per million tokens (USD)"

    def to_cost(t: Any) -> Any:
        return t * per_unit

    def to_time(c: Any) -> Any:
        return c / per_unit

    cost = ax.secondary_xaxis("top", functions=(to_cost, to_time))
    cost.set_xlabel(top, fontsize=9)
    ax.set_title(
        f"{cluster.devices} x {cluster.device}, ${cluster.price_per_device_hour:g} per device-hour: "
        f"predicted (validation range {spread.low:.2f}-{spread.high:.2f} x)",
        fontsize=9,
    )
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_ylim(-0.7, len(runs) - 0.3)
    fig.tight_layout()
    return fig


def write(path: Path, results: list[Estimate], cluster: Cluster, job: Any, spread: Validation) -> Path:
    fig = figure(results, cluster, job, spread)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    atomic_write_bytes(path, buffer.getvalue())
    return path

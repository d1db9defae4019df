"""scaling.png: strong scaling (a group's rows against its one-process baseline, the global batch
fixed) and weak scaling (weak.py: the per-rank batch fixed), one panel each, with a cost model's
predicted curves when given some. An efficiency above EFFICIENCY_LIMIT cannot be real: such a point is
marked on the plot and says so."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .labels import DEVICE_KEYS, distinct_labels
from .plots import MARKERS, colours, figure, legend, save
from .rows import EFFICIENCY_LIMIT, Group, Row
from .runs import Run
from .weak import WeakSeries, weak_scaling

Predicted = Mapping[str, Sequence[tuple[int, float]]]  # strategy label -> [(devices, efficiency)]
# A red ring around the point (its own colour and marker stay visible inside), drawn on top.
IMPOSSIBLE = {
    "marker": "o",
    "s": 320,
    "facecolors": "none",
    "edgecolors": "red",
    "linewidths": 2,
    "zorder": 5,
}


def plot_scaling(
    groups: list[Group], path: Path, *, title: str = "", predicted: Predicted | None = None
) -> Path | None:
    """scaling.png with predicted curves (a cost model's) next to the measured points; None when there
    is nothing to draw (scaling_figure)."""
    fig = scaling_figure(groups, palette=colours(groups), title=title, predicted=predicted)
    return save(fig, path) if fig is not None else None


def scaling_figure(
    groups: list[Group],
    *,
    palette: dict[str, Any],
    title: str,
    predicted: Predicted | Callable[[Group], Predicted] | None = None,
) -> Any | None:
    """Scaling efficiency against devices: a panel per group that has a baseline and either several
    device counts or predictions (error bars from the repeats' min-max samples/s), then a panel per
    weak-scaling series. `predicted` ({strategy label: [(devices, efficiency), ...]}, e.g. from a cost
    model) is drawn as dashed lines in the strategy's colour on every strong-scaling panel, curves that
    are the same drawn once: pass the groups it was predicted for; or a function giving each group's
    own (`--predict`). None when there is no panel."""
    predicted = predicted or {}
    curves = {
        id(g): (predicted(g) if callable(predicted) else predicted) if g.baseline else {} for g in groups
    }
    strong = [
        g
        for g in groups
        if g.baseline
        and (
            len({r.devices for r in g.rows if r.efficiency is not None}) > 1
            or any(d > 1 for points in curves[id(g)].values() for d, _ in points)
        )
    ]
    weak = weak_scaling(groups)
    if not strong and not weak:
        return None
    entries = max((len(g.rows) for g in groups), default=0) + max(
        (len(curves[id(g)]) for g in strong), default=0
    )
    effs = [r.efficiency or 0.0 for g in strong for r in g.rows] + [
        e for s in weak for e in s.efficiency.values()
    ]
    if any(e > EFFICIENCY_LIMIT for e in effs):
        entries = max(entries, 5)  # a legend beside the plot, off the notes on impossible points
    fig, axes = figure(len(strong) + len(weak), title, "Scaling efficiency vs devices", entries=entries)
    for group, ax in zip(strong, axes, strict=False):
        points = [(row, row.efficiency or 0.0) for row in group.rows if row.efficiency is not None]
        ticks = _plot_measured(ax, points, palette, group.baseline)
        ticks |= _plot_predicted(ax, curves[id(group)], palette)
        base = group.baseline.label if group.baseline else "-"
        _finish(ax, ticks, f"strong scaling: {group.title} (baseline: {base})")
    for series, ax in zip(weak, axes[len(strong) :], strict=True):
        points = [(row, series.efficiency[id(row)]) for row in series.rows]
        ticks = _plot_measured(ax, points, palette, series.baseline, weak=series)
        _finish(ax, ticks, f"{series.title} (baseline: {series.baseline.label}, 1 process)")
        ax.set_ylabel("weak scaling efficiency\n(per-device samples/s vs 1 process)")
    return fig


def _finish(ax: Any, ticks: set[int], title: str) -> None:
    ax.axhline(1.0, color="grey", lw=0.8, label="linear scaling")
    ax.set_xticks(sorted(ticks))  # device counts are whole numbers: no tick at 1.5 devices
    ax.set_xlim(min(ticks) - 0.5, max(ticks) + 0.5)
    ax.margins(y=0.15)  # room above the highest marker and its note
    ax.set_ylim(bottom=0)
    ax.set(xlabel="devices", ylabel="scaling efficiency", title=title)
    ax.title.set_fontsize(9)
    handles, labels = ax.get_legend_handles_labels()
    legend(ax, outside=len(handles) > 6 or any("impossible" in label for label in labels))  # off the notes


def _plot_measured(
    ax: Any,
    points: list[tuple[Row, float]],
    palette: dict[str, Any],
    base: Row | None,
    *,
    weak: WeakSeries | None = None,
) -> set[int]:
    """Measured efficiencies: a line per series (rows of one label, device counts aside), error bars
    from the repeats' min-max samples/s; a point above EFFICIENCY_LIMIT marked and annotated."""
    base_per_device = base.per_device() if base else None
    ticks: set[int] = set()
    impossible = []
    for number, (label, _, line) in enumerate(_series(points)):
        x = [row.devices for row, _ in line]
        y = [eff for _, eff in line]
        low, high = [], []
        for row, eff in line:
            lo, hi = row.spread(Run.throughput) or (0.0, 0.0)
            low.append(eff - lo / row.devices / base_per_device if base_per_device else 0.0)
            high.append(hi / row.devices / base_per_device - eff if base_per_device else 0.0)
        colour = palette[line[0][0].strategy]
        marker = MARKERS[number % len(MARKERS)]  # series of one colour (strategy) still read apart
        ax.errorbar(x, y, yerr=[low, high], color=colour, marker=marker, capsize=3, label=label)
        impossible += [(label, row, eff) for row, eff in line if eff > EFFICIENCY_LIMIT]
        ticks |= set(x)
    right = max(ticks, default=0)
    at: dict[int, int] = {}  # annotations so far at each device count: the next goes below them
    for k, (label, row, eff) in enumerate(sorted(impossible, key=lambda item: -item[2])):
        note = f"impossible (> {EFFICIENCY_LIMIT}): baseline slowed?" if k == 0 else None
        ax.scatter([row.devices], [eff], **IMPOSSIBLE, label=note)
        left = row.devices == right and right != min(ticks)  # at the right edge: the text goes left
        below = at[row.devices] = at.get(row.devices, -1) + 1
        ax.annotate(
            f"{label}: {eff:.2f} impossible",
            (row.devices, eff),
            textcoords="offset points",
            xytext=(-14 if left else 14, 6 - 13 * below),
            ha="right" if left else "left",
            va="center",
            fontsize=8,
            color="red",
        )
    return ticks


def _series(points: list[tuple[Row, float]]) -> list[tuple[str, int, list[tuple[Row, float]]]]:
    """Rows of one label (the table's, device-count settings aside) joined over device counts; a second
    row at a device count already taken starts a series of its own rather than a vertical line."""
    labels = distinct_labels(
        [(row.strategy, row.name) for row, _ in points], ignore=DEVICE_KEYS, unique=False
    )
    series: dict[str, list[list[tuple[Row, float]]]] = {}
    for label, (row, eff) in zip(labels, points, strict=True):
        lines = series.setdefault(label, [])
        line = next((ln for ln in lines if all(r.devices != row.devices for r, _ in ln)), None)
        if line is None:
            lines.append([(row, eff)])
        else:
            line.append((row, eff))
    return [
        (
            label if index == 0 else f"{label} ({', '.join(r.label for r, _ in line)})",
            index,
            sorted(line, key=lambda p: p[0].devices),
        )
        for label, lines in sorted(series.items())
        for index, line in enumerate(lines)
    ]


def _plot_predicted(ax: Any, curves: Predicted, palette: dict[str, Any]) -> set[int]:
    """Predicted curves, dashed in the strategy's colour; strategies whose curves are the same (to
    three decimals) are one line naming them all."""
    same: dict[tuple[tuple[int, float], ...], list[str]] = {}
    for label, points in sorted(curves.items()):
        if points:
            same.setdefault(tuple((d, round(e, 3)) for d, e in sorted(points)), []).append(label)
    ticks: set[int] = set()
    for key, labels in same.items():
        devices, efficiency = zip(*key, strict=True)
        name = (
            f"{labels[0]} (predicted)" if len(labels) == 1 else f"{', '.join(labels)} (predicted, identical)"
        )
        ax.plot(devices, efficiency, ls="--", marker="x", color=palette.get(labels[0], "black"), label=name)
        ticks |= set(devices)
    return ticks

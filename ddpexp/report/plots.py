"""The report's plots: acc_vs_time.png, loss_vs_step.png, throughput.png and scaling.png (with a cost
model's predicted curves when given some), one colour per strategy label in every plot."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .groups import Group, Row, context_line
from .runs import Run
from .table import is_accuracy

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
        percent = all(is_accuracy(tag) for tag in metrics)
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

"""The report's plots acc_vs_time.png, loss_vs_step.png, loss_vs_cost.png and throughput.png, and
what every plot shares (scaling.png too: scaling_plot.py): one colour per strategy and one label per
row, the table's strategy column."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..runrecord import is_accuracy
from .groups import Group
from .rows import Row
from .runs import Run

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")
PLOT_WIDTH = 8.0  # inches
MARKS_PER_CURVE = 8  # markers along a curve: enough to tell coincident curves apart, few enough to read


def colours(groups: list[Group]) -> dict[str, Any]:
    """One colour per strategy (with its settings), the same in every plot: sorted → tab10 (tab20 past
    ten)."""
    from matplotlib import colormaps

    labels = sorted({row.strategy for group in groups for row in group.rows})
    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def figure(
    panels: int, title: str, what: str, *, entries: int = 0, heights: list[float] | None = None
) -> tuple[Any, list[Any]]:
    """A figure of `panels` panels one above the other; with many legend entries, wider, the legend
    going to the right of the plot (legend() with outside=True) so that it hides no curve."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    width = PLOT_WIDTH  # legend() widens it for a legend beside the plot
    heights = heights or [3.6] * panels  # inches per panel
    fig = Figure(figsize=(width, 1.2 + sum(heights)))  # not pyplot's: nothing global to close
    axes = fig.subplots(panels, 1, squeeze=False, height_ratios=heights)
    fig.suptitle(f"{what} — {title}" if title else what, fontsize=10)
    return fig, [ax for (ax,) in axes]


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def row_styles(group: Group, palette: dict[str, Any]) -> Iterable[tuple[Row, dict[str, Any]]]:
    """Each row's colour (its strategy's) and a marker and line style telling rows of one strategy
    apart."""
    seen: dict[str, int] = {}
    for row in group.rows:
        index = seen[row.strategy] = seen.get(row.strategy, -1) + 1
        style = LINESTYLES[index % len(LINESTYLES)]
        yield (
            row,
            {"color": palette[row.strategy], "marker": MARKERS[index % len(MARKERS)], "linestyle": style},
        )


def _entries(groups: list[Group]) -> int:
    """How much legend a figure has: its largest group's rows, counted as more than four (a legend
    beside the plot, a wider figure) when a label is long."""
    rows = max((len(group.rows) for group in groups), default=0)
    longest = max((len(row.label) for group in groups for row in group.rows), default=0)
    return max(rows, 5) if longest > 32 else rows


def accuracy_figure(groups: list[Group], *, palette: dict[str, Any], title: str, target: float) -> Any:
    """The best metric (accuracies in %) against seconds since each job started, with the target."""
    entries = _entries(groups)
    fig, axes = figure(len(groups), title, "Eval metric vs time since the job started", entries=entries)
    for group, ax in zip(groups, axes, strict=True):
        metrics = sorted({row.metric for row in group.rows})
        percent = all(is_accuracy(tag) for tag in metrics)
        scale = 100.0 if percent else 1.0
        for row, style in row_styles(group, palette):
            for i, run in enumerate(row.runs):
                points = run.scalars.get(run.metric, [])
                if points and run.job_start is not None:
                    x = [wall - run.job_start for _, _, wall in points]
                    y = [value * scale for _, value, _ in points]
                    ax.plot(x, y, **style, ms=4, lw=1.2, alpha=0.85, label=row.label if i == 0 else None)
        shown = f"{100 * target:g}%" if percent else f"{target:g}"
        ax.axhline(target * scale, color="grey", ls="--", lw=1, label=f"target {shown}")
        ylabel = "eval accuracy (%)" if percent else ", ".join(metrics)
        ax.set(xlabel="seconds since the job started", ylabel=ylabel, title=group.title)
        ax.grid(alpha=0.3)
        legend(ax, outside=entries > 4)
    return fig


def loss_figure(groups: list[Group], *, palette: dict[str, Any], title: str) -> Any:
    """Training loss against optimizer step on a log scale (the later, smaller losses stay readable).
    Curves that coincide (equal strategies: the point of parity) each carry markers at steps of their
    own, and say in the legend which curve they repeat."""
    entries = _entries(groups)
    fig, axes = figure(len(groups), title, "Training loss vs step", entries=entries)
    for group, ax in zip(groups, axes, strict=True):
        curves = [
            (row, style, i, run.scalars.get("train/loss", []))
            for row, style in row_styles(group, palette)
            for i, run in enumerate(row.runs)
        ]
        curves = [c for c in curves if c[3]]
        drawn: dict[tuple[tuple[int, float], ...], str] = {}
        for k, (row, style, i, points) in enumerate(curves):
            steps, losses = [s for s, _, _ in points], [v for _, v, _ in points]
            key = tuple((s, round(v, 6)) for s, v in zip(steps, losses, strict=True))
            label = row.label if i == 0 else None
            if label and key in drawn:
                label += f" (identical to {drawn[key]})"
            drawn.setdefault(key, row.label)
            # Coinciding curves stay visible: each its own marker, earlier ones larger (rings around
            # the later), at steps of its own where the curve is long enough
            every = max(1, len(steps) // MARKS_PER_CURVE)
            ax.plot(
                steps,
                losses,
                color=style["color"],
                ls=style["linestyle"],
                marker=MARKERS[k % len(MARKERS)],
                markevery=(((k * every) // len(curves)) % every, every),
                ms=4 + 2.5 * (len(curves) - 1 - k) / max(len(curves) - 1, 1) * 2,
                mfc="none" if k < len(curves) - 1 else style["color"],
                lw=1,
                label=label,
            )
        losses = [v for *_, points in curves for _, v, _ in points]
        log = bool(losses) and min(losses) > 0 and max(losses) > 3 * min(losses)  # falls far: log
        if log:
            ax.set_yscale("log")
        ylabel = "train loss (log scale)" if log else "train loss"
        ax.set(xlabel="optimizer step", ylabel=ylabel, title=group.title)
        ax.grid(alpha=0.3, which="both")
        legend(ax, outside=entries > 4)
    return fig


def cost_figure(groups: list[Group], *, palette: dict[str, Any], title: str) -> Any | None:
    """Training loss against what it cost, two panels a group: the tokens trained on (steps x the
    global batch's tokens; samples for data without tokens) and the bytes each rank sent (log scale),
    which tells strategies that communicate differently (every step, every H steps, through a server)
    apart at equal tokens and at equal bytes moved. Groups where no run measured its bytes are left
    out (None: no group left)."""
    shown = [g for g in groups if any(run.bytes_moved() for row in g.rows for run in row.runs)]
    if not shown:
        return None
    entries = _entries(shown)
    fig, axes = figure(2 * len(shown), title, "Training loss vs tokens and vs bytes sent", entries=entries)
    for k, group in enumerate(shown):
        by_tokens, by_bytes = axes[2 * k], axes[2 * k + 1]
        losses: list[float] = []
        for row, style in row_styles(group, palette):
            for i, run in enumerate(row.runs):
                points = [(step, loss) for step, loss, _ in run.scalars.get("train/loss", [])]
                per_step = run.tokens_per_step()
                sent = [(b, loss) for step, loss in points if (b := run.bytes_at(step))]
                drawn = {
                    "color": style["color"],
                    "ls": style["linestyle"],
                    "marker": style["marker"],
                    "markevery": max(1, len(points) // MARKS_PER_CURVE),
                    "ms": 4,
                    "lw": 1,
                    "label": row.label if i == 0 else None,
                }
                if points and per_step:
                    by_tokens.plot([step * per_step for step, _ in points], [v for _, v in points], **drawn)
                if sent:
                    by_bytes.plot([b for b, _ in sent], [v for _, v in sent], **drawn)
                losses += [v for _, v in points]
        tokens = any(row.facts.get("tokens_per_sample") for row in group.rows)
        falls_far = bool(losses) and min(losses) > 0 and max(losses) > 3 * min(losses)
        for ax, xlabel in (
            (by_tokens, "tokens trained on" if tokens else "samples trained on"),
            (by_bytes, "bytes sent per rank (log scale)"),
        ):
            if falls_far:
                ax.set_yscale("log")
            ax.set(
                xlabel=xlabel, ylabel="train loss" + (" (log scale)" if falls_far else ""), title=group.title
            )
            ax.grid(alpha=0.3, which="both")
            legend(ax, outside=entries > 4)
        by_bytes.set_xscale("log")
    return fig


def throughput_figure(groups: list[Group], *, palette: dict[str, Any], title: str) -> Any:
    """Median samples/s per row, labelled; min-max error bars where a row has repeats."""
    repeated = any(row.n > 1 for group in groups for row in group.rows)
    what = "Throughput (median; bars: min-max of repeats)" if repeated else "Throughput"
    heights = [1.4 + 0.45 * len(group.rows) for group in groups]  # bars of one thickness in every panel
    fig, axes = figure(len(groups), title, what, heights=heights)
    for group, ax in zip(groups, axes, strict=True):
        rows = [row for row in group.rows if row.throughputs()][::-1]  # barh draws bottom-up
        medians = [row.median(Run.throughput) or 0.0 for row in rows]
        ax.barh([row.label for row in rows], medians, color=[palette[row.strategy] for row in rows])
        top = max((row.spread(Run.throughput) or (0.0, 1.0))[1] for row in rows) if rows else 1.0
        for y, (row, median) in enumerate(zip(rows, medians, strict=True)):
            low, high = row.spread(Run.throughput) or (median, median)
            if row.n > 1:
                ax.errorbar(median, y, xerr=[[median - low], [high - median]], color="black", capsize=3)
            text = f"{median:,.0f}" + (f" (n={row.n})" if row.n > 1 else "")
            ax.text(high + top * 0.01, y, text, va="center", fontsize=8)
        ax.set_xlim(0, top * 1.25)
        ax.set_ylim(-0.6, max(len(rows), 3) - 0.4)  # one or two bars stay bars, not blocks
        ax.set(xlabel="samples/s (all devices)", title=group.title)
    return fig


def legend(ax: Any, *, outside: bool = False) -> None:
    """The panel's legend, fontsize 8; `outside`: beside the plot, where it hides no curve, the figure
    widened by the legend's width so that the plot keeps its own."""
    labels = ax.get_legend_handles_labels()[1]
    if not labels:
        return
    if not outside:
        ax.legend(fontsize=8)
        return
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig = ax.figure
    needed = PLOT_WIDTH + 0.8 + 0.062 * max(len(label) for label in labels)  # inches, at fontsize 8
    if fig.get_figwidth() < needed:
        fig.set_figwidth(needed)

"""`ddpexp plan --plot FILE`: every plan that runs as a point of predicted time against cost, the ones
that do not fit greyed out, so the cheap, the fast and the trade between them show at a glance; each
plan that fits with the range the held-out validation puts around it (time and cost move together on
one cluster, so a range is a segment through the point)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_bytes
from ..predict.validation import Validation
from .estimate import Estimate
from .profiles import Cluster


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


def write(path: Path, results: list[Estimate], cluster: Cluster, job: Any, spread: Validation) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot's global state
    ax = fig.add_subplot()
    runs = [r for r in results if r.note is None and math.isfinite(r.step_s)]
    for fits in (False, True):
        mine = [r for r in runs if r.fits == fits]
        if not mine:
            continue
        points = [axes(r, cluster, job) for r in mine]
        ax.scatter(
            [x for x, _ in points],
            [y for _, y in points],
            label="fits" if fits else "does not fit",
            color="tab:blue" if fits else "0.75",
            zorder=3 if fits else 2,
        )
        for r in mine if fits else []:
            (x0, y0), (x1, y1) = span(r, cluster, job, spread)
            ax.plot([x0, x1], [y0, y1], color="tab:blue", alpha=0.35, linewidth=3, zorder=1)
        for r, (x, y) in zip(mine, points, strict=True):
            ax.annotate(
                r.candidate.label,
                (x, y),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color="black" if fits else "0.6",
            )
    if job.target_tokens:
        ax.set_xlabel(f"time to {job.target_tokens:,.0f} tokens (hours)")
        ax.set_ylabel("cost (USD)")
    else:
        ax.set_xlabel("step time (s)")
        ax.set_ylabel("cost per million tokens (USD)")
    ax.set_title(
        f"{cluster.devices} x {cluster.device}, ${cluster.price_per_device_hour:g} per device-hour "
        f"(predicted; bands: {spread.low:.2f}-{spread.high:.2f} x, the held-out validation's range)",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    atomic_write_bytes(path, buffer.getvalue())
    return path

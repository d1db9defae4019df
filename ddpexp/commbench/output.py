"""What rank 0 makes of the measurements: the table on the console, commbench.json (the results and
the fitted alpha-beta model per op; a cost model reads it) and commbench.png (busbw against size).

Bandwidths are in GB/s of 10^9 bytes, as nccl-tests reports them.
"""

from __future__ import annotations

import io
import json
import logging
import platform
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from ..context import RunContext
from ..fsutil import atomic_write_bytes, atomic_write_text
from ..job import Job
from . import JSON_FILE, PLOT_FILE, Op, bus_factor, fit_alpha_beta
from .settings import CommbenchConfig

log = logging.getLogger(__name__)

GB = 1e9


@dataclass(frozen=True)
class Measurement:
    op: Op
    nbytes: int
    seconds: float  # per call: the slowest rank's mean (after compute: the mean over ranks, waits included)
    iters: int
    compute_s: float | None = None  # after compute: the burst before each call, every rank computing
    back_to_back_s: float | None = None  # after compute: the same call back to back, as without it


def results(measurements: list[Measurement], world: int) -> list[dict[str, Any]]:
    """commbench.json's `results`: one row per op and size."""
    rows = []
    for m in measurements:
        algbw = m.nbytes / m.seconds / GB
        rows.append(
            {
                "op": str(m.op),
                "bytes": m.nbytes,
                "time_s": m.seconds,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * bus_factor(m.op, world),
                "iters": m.iters,
                **({} if m.compute_s is None else {"compute_s": m.compute_s}),
                **({} if m.back_to_back_s is None else {"back_to_back_s": m.back_to_back_s}),
            }
        )
    return rows


def fits(measurements: list[Measurement], back_to_back: bool = False) -> dict[str, dict[str, float]]:
    """commbench.json's `fits`: alpha-beta per op measured at two sizes or more (one size cannot tell
    latency from bandwidth, so such an op has no fit); `back_to_back`: of the back-to-back times a run
    after compute also took (`fits_back_to_back`)."""
    out = {}
    for op in dict.fromkeys(m.op for m in measurements):
        mine = [m for m in measurements if m.op == op]
        if len({m.nbytes for m in mine}) >= 2:
            times = [(m.back_to_back_s or m.seconds) if back_to_back else m.seconds for m in mine]
            fit = fit_alpha_beta([m.nbytes for m in mine], times)
            out[str(op)] = {
                "alpha_s": fit.alpha_s,
                "beta_s_per_byte": fit.beta_s_per_byte,
                "rel_error_mean": fit.rel_error_mean,
                "rel_error_max": fit.rel_error_max,
            }
    return out


def write_outputs(
    job: Job,
    ctx: RunContext,
    measurements: list[Measurement],
    settings: CommbenchConfig,
    compute_alone_s: float | None = None,
) -> None:
    p = job.plan
    record: dict[str, Any] = {
        "facts": {
            "backend": p.backend,
            "world_size": p.world_size,
            "nnodes": max(p.world_size // p.nprocs_per_node, 1),
            "nprocs_per_node": p.nprocs_per_node,
            "device_type": p.device_type,
            "host": platform.node(),
            "torch": torch.__version__,
            "started_at": job.started_at,
        },
        "results": results(measurements, p.world_size),
        "fits": fits(measurements),
    }
    if compute_alone_s is not None:
        record["facts"]["after_compute_ms"] = settings.after_compute_ms
        record["facts"]["threads"] = torch.get_num_threads()
        record["compute"] = compute_record(measurements, compute_alone_s)
        record["fits_back_to_back"] = fits(measurements, back_to_back=True)
    atomic_write_text(ctx.run_dir / JSON_FILE, json.dumps(record, indent=2) + "\n")
    atomic_write_bytes(ctx.run_dir / PLOT_FILE, plot(record))
    log.info("%s", table(record, settings))


def compute_record(measurements: list[Measurement], alone_s: float) -> dict[str, float]:
    """commbench.json's `compute`, after compute only: one burst with the other ranks idle (each rank in
    turn, the mean), the same burst with every rank computing (the median over the measurements), and
    their ratio, the stretch: what running these W processes side by side does to each one's compute."""
    together = statistics.median(m.compute_s for m in measurements if m.compute_s is not None)
    return {"alone_s": alone_s, "together_s": together, "stretch": together / alone_s}


def table(record: dict[str, Any], settings: CommbenchConfig) -> str:
    """The console's view of commbench.json: every measurement, then the fit of each op."""
    f = record["facts"]
    layout = f"{f['nnodes']} node(s) x {f['nprocs_per_node']}"
    how = f"the slowest rank's mean over {settings.iters} calls"
    if "compute" in record:
        how = (
            f"each call after {settings.after_compute_ms:g} ms of compute on every rank, the mean over "
            f"{settings.iters} calls and the ranks, waiting for the last rank included"
        )
    lines = [
        f"commbench: {f['backend']}, {f['world_size']} ranks ({layout}), {f['device_type']}, "
        f"{settings.dtype}; time = {how} (after {settings.warmup} warm-up calls)",
        f"{'op':<15} {'bytes':>10} {'time_us':>11} {'algbw_GBps':>11} {'busbw_GBps':>11}",
    ]
    for r in record["results"]:
        time_us, algbw, busbw = r["time_s"] * 1e6, r["algbw_GBps"], r["busbw_GBps"]
        lines.append(f"{r['op']:<15} {r['bytes']:>10} {time_us:>11.1f} {algbw:>11.4f} {busbw:>11.4f}")
    lines += [
        "fit: time ~ alpha + bytes x beta, least squares on relative error; 1/beta = the bandwidth the",
        "largest sizes approach (algbw); rel_err = |fit - time| / time over the sizes measured",
        f"{'op':<15} {'alpha_us':>10} {'1/beta_GBps':>11} {'rel_err_mean':>12} {'rel_err_max':>11}",
    ]
    if "compute" in record:
        c = record["compute"]
        lines.append(
            f"compute: one burst {c['alone_s'] * 1e3:.3g} ms on a rank alone, "
            f"{c['together_s'] * 1e3:.3g} ms with all {f['world_size']} at once (stretch {c['stretch']:.3g})"
        )
    for op, fit in record["fits"].items():
        beta = fit["beta_s_per_byte"]
        bandwidth = f"{1 / beta / GB:>11.4g}" if beta > 0 else f"{'inf':>11}"
        lines.append(
            f"{op:<15} {fit['alpha_s'] * 1e6:>10.1f} {bandwidth} {fit['rel_error_mean']:>12.1%} "
            f"{fit['rel_error_max']:>11.1%}"
        )
    return "\n".join(lines)


def plot(record: dict[str, Any]) -> bytes:
    """busbw against size, log-log, one line per op, as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot's global state
    ax = fig.add_subplot()
    for op in dict.fromkeys(r["op"] for r in record["results"]):
        rows = [r for r in record["results"] if r["op"] == op]
        ax.plot(
            [r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", markersize=3, label=op
        )
    f = record["facts"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes; nccl-tests' convention per op)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{f['backend']}, {f['world_size']} ranks, {f['device_type']} ({f['host']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()

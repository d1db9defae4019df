"""`python -m ddpexp.report DIR [DIR ...]` (or `ddpexp-report`): a sweep turned into a table and plots.

Every directory holding a metrics.json below the given ones is a run. Numbers come from the run's
metrics.json (facts, final, best, status) and its TensorBoard events, read with tensorboard's own event
reader; nothing is re-measured. Written into the first directory given:

  report.md            one row per run (failed or unfinished runs marked as such)
  acc_vs_time.png      the best metric (eval/acc unless the task says otherwise) against wall-clock
                       seconds since the run started
  loss_vs_step.png     training loss against optimizer step
  throughput.png       samples/s per run (all devices together)
  scaling.png          scaling efficiency against device count (when device counts differ)

Definitions (also in the README):
  samples/s            mean of perf/samples_per_s over the run's epochs, the first left out when there
                       are several (it includes warm-up)
  per device           samples/s / devices (processes on CPU, GPUs on CUDA)
  scaling eff.         (samples/s per device) / (samples/s of the sweep's single-device run)
  time to target       seconds from the run's start until its best metric first reached --target
                       (eval/acc >= target; for a min metric such as eval/mse, <= target)
  comm share           mean comm/share: fraction of training wall time with a gradient reduction running
  comm bytes/step      comm/bytes_per_step of the last epoch: the bytes each rank's gradient reductions
                       send per optimizer step (after PowerSGD's uncompressed start, when it ran that long)
  strategy             the strategy, with the settings that differ from its defaults (ddp comm_hook=bf16)
  bubble               pipeline runs, last epoch: pipe/bubble_frac (the measured share of a schedule step
                       spent outside the rank's stage) / pipe/bubble_frac_textbook ((p-1)/(m+p-1))
  staleness            ps async runs, last epoch: ps/staleness_mean / ps/staleness_max (server updates
                       between a worker's pull and its push)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import fsutil
from .recorder import METRICS_FILE


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

    @property
    def devices(self) -> int:
        return int(self.facts.get("devices", 1))  # Plan.devices, recorded by the run

    def values(self, tag: str) -> list[float]:
        return [v for _, v, _ in self.scalars.get(tag, [])]

    def throughput(self) -> float | None:
        per_epoch = self.values("perf/samples_per_s")
        if not per_epoch:
            return None
        steady = per_epoch[1:] if len(per_epoch) > 1 else per_epoch
        return sum(steady) / len(steady)

    @property
    def metric(self) -> str:
        """The run's best metric (its task's, or checkpoint.best_metric)."""
        return str(self.facts.get("best_metric", "eval/acc"))

    def time_to(self, target: float) -> float | None:
        """Seconds until the best metric first reached the target (>= for max, <= for min metrics)."""
        if self.started_at is None:
            return None
        lower = self.facts.get("best_mode") == "min"
        for _, value, wall in self.scalars.get(self.metric, []):
            if (value <= target) if lower else (value >= target):
                return wall - self.started_at
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
    run = Run(
        name, run_dir, status, m.get("facts", {}), m.get("final", {}), m.get("best", {}), m.get("started_at")
    )
    run.scalars = read_scalars(run_dir)
    return run


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    try:
        acc.Reload()
    except Exception:  # a crashed run may leave a truncated event file: report what is readable
        return {}
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ----------------------------------------------------------------------------------------- table

COLUMNS = (
    "run",
    "status",
    "strategy",
    "world",
    "batch (global/rank)",
    "final",
    "best",
    "time to target (s)",
    "samples/s",
    "per device",
    "scaling eff.",
    "comm share",
    "comm bytes/step",
    "bubble: measured/textbook",
    "staleness: mean/max",
    "peak mem (MB)",
    "per rank MB: params/grads/optim",
)


def baseline(runs: list[Run]) -> float | None:
    """Samples/s of the sweep's single-device run, if it has one that completed."""
    singles = [t for r in runs if r.devices == 1 and r.status == "completed" and (t := r.throughput())]
    return max(singles) if singles else None


def rows(runs: list[Run], target: float) -> list[list[str]]:
    base = baseline(runs)
    out = []
    for r in runs:
        f = r.facts
        tput = r.throughput()
        eff = tput / r.devices / base if tput and base else None
        out.append(
            [
                r.name,
                r.status,
                strategy_label(f),
                str(f.get("world_size", "?")),
                f"{f.get('global_batch_size', '?')}/{f.get('per_rank_batch_size', '?')}",
                _metric(r.metric, r.final.get(r.metric)),
                _metric(r.metric, r.best.get(r.metric)),
                _num(r.time_to(target), "{:.1f}"),
                _num(tput, "{:,.0f}"),
                _num(tput / r.devices if tput else None, "{:,.0f}"),
                _num(eff, "{:.2f}"),
                _pct(r.mean("comm/share")),
                _num(r.final.get("comm/bytes_per_step"), "{:,.0f}"),
                _pair(r.final, "pipe/bubble_frac", "pipe/bubble_frac_textbook", "{:.2f}"),
                _pair(r.final, "ps/staleness_mean", "ps/staleness_max", "{:.2f}", "{:.0f}"),
                _num(r.peak("mem/peak_mb"), "{:,.0f}"),
                _resident(r.final),
            ]
        )
    return out


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


def _resident(final: dict[str, Any]) -> str:
    """Bytes per rank by category (max over ranks), counted from the tensors (ddpexp/memory.py)."""
    keys = ("mem/params_mb", "mem/grads_mb", "mem/optim_state_mb")
    if not all(k in final for k in keys):
        return "-"
    return "/".join(f"{final[k]:.2f}" for k in keys)


def _pair(final: dict[str, Any], first: str, second: str, fmt: str, second_fmt: str | None = None) -> str:
    """Two of a strategy's own last-epoch scalars as first/second; "-" for runs that do not log them."""
    if first not in final and second not in final:
        return "-"
    return f"{_num(final.get(first), fmt)}/{_num(final.get(second), second_fmt or fmt)}"


def _metric(tag: str, v: float | None) -> str:
    """Accuracies in %, anything else (eval/mse...) with its name."""
    if tag == "eval/acc" or tag.startswith("eval/top"):
        return _pct(v)
    return "-" if v is None else f"{tag.removeprefix('eval/')} {v:.4g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def plain(table: list[list[str]]) -> str:
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(COLUMNS)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*COLUMNS), *(fmt.format(*row) for row in table)])


# ----------------------------------------------------------------------------------------- plots


def plots(runs: list[Run], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        pts = r.scalars.get(r.metric, [])
        if pts and r.started_at is not None:
            ax.plot([w - r.started_at for _, _, w in pts], [v for _, v, _ in pts], marker="o", label=r.name)
    tags = sorted({r.metric for r in runs})
    ax.set(xlabel="wall-clock seconds since start", ylabel=", ".join(tags), title="Eval metric vs time")
    _legend(ax)
    save(fig, "acc_vs_time.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        pts = r.scalars.get("train/loss", [])
        if pts:
            ax.plot([s for s, _, _ in pts], [v for _, v, _ in pts], label=r.name)
    ax.set(xlabel="optimizer step", ylabel="train loss", title="Training loss vs step")
    _legend(ax)
    save(fig, "loss_vs_step.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r.name for r in runs]
    ax.barh(names, [r.throughput() or 0.0 for r in runs])
    ax.set(xlabel="samples/s (all devices)", title="Throughput")
    save(fig, "throughput.png")

    base = baseline(runs)
    counts = {r.devices for r in runs}
    if base and len(counts) > 1:
        fig, ax = plt.subplots(figsize=(7, 4))
        effs = sorted(
            (r.devices, (r.throughput() or 0.0) / r.devices / base, r.name) for r in runs if r.throughput()
        )
        ax.plot([d for d, _, _ in effs], [e for _, e, _ in effs], "o")
        for d, e, name in effs:
            ax.annotate(name, (d, e), fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(xlabel="devices", ylabel="scaling efficiency", title="Scaling efficiency vs devices")
        save(fig, "scaling.png")
    return written


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ddpexp-report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep or run directories")
    parser.add_argument(
        "--target", type=float, default=0.95, help="best-metric value for 'time to target' (0.95)"
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the first dir)")
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
    table = rows(runs, args.target)
    images = plots(runs, out)
    body = [
        f"# ddpexp report: {', '.join(map(str, args.dirs))}",
        "",
        f"{len(runs)} runs; time to target = first time the best metric reached {args.target:g}.",
        "",
        markdown(table),
        "",
        *(f"![{p.stem}]({p.name})" for p in images),
        "",
    ]
    (out / "report.md").write_text("\n".join(body))
    print(plain(table))
    print(f"report: {out / 'report.md'}")


if __name__ == "__main__":
    main()

"""`ddpexp plan --verify K`: the planner's first K plans that fit, run on this machine in rounds, and
the regret: how much slower the plan it recommended ran than the fastest of them measured."""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from .estimate import Estimate, launch_args
from .profiles import Cluster


def check(cluster: Cluster, k: int) -> None:
    """--verify runs the plans here: a profile of this machine, one node."""
    if k < 1:
        raise UserError(
            f"{k} plans", setting="--verify", fix="give how many of the first plans to run, e.g. 3"
        )
    if cluster.device_type != "cpu" or cluster.nodes != 1:
        raise UserError(
            f"--verify runs the plans on this machine, and {cluster.name} is {cluster.nodes} node(s) of "
            f"{cluster.device}",
            setting="--cluster",
            fix="plan for a profile of this machine (--cluster cpu_host, or a copy with your cores)",
        )


@dataclass
class Verified:
    estimate: Estimate
    run_dirs: list[Path] = field(default_factory=list)
    measured_s: list[float] = field(default_factory=list)  # per round: the steady epochs' mean step
    failed: str | None = None

    @property
    def step_s(self) -> float:
        return statistics.median(self.measured_s) if self.measured_s and not self.failed else math.nan


def verify(
    results: list[Estimate], job: Any, cluster: Cluster, k: int, *, rounds: int, epochs: int, out: Path
) -> list[Verified]:
    """Run the first `k` plans that fit, each `rounds` times in turn (so a drifting machine load hits
    them alike), `epochs` epochs a run; a run's step time is its epochs' mean after the first."""
    from .. import api
    from ..predict.measured import MeasuredRun

    chosen = [Verified(r) for r in results if r.note is None and r.fits][:k]
    for round_ in range(rounds):
        for v in chosen:
            if v.failed:
                continue
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", v.estimate.candidate.label) + f"-r{round_}"
            run_dir = out / name
            args = launch_args(job.overrides, v.estimate.candidate.overrides, cluster)
            args += [
                f"dist.nprocs={cluster.devices}",
                "trainer.threads=1",
                f"trainer.epochs={epochs}",
                "trainer.progress=false",
                f"hydra.run.dir={run_dir}",
            ]
            result = api.run(args)
            v.run_dirs.append(run_dir)
            if result.status != "completed":
                v.failed = f"{result.status} (see {run_dir}/ddpexp.log)"
                continue
            v.measured_s.append(MeasuredRun.read(run_dir).mean("perf/step_time_s"))
    return chosen


def render(verified: list[Verified], cluster: Cluster, rounds: int, epochs: int, out: Path) -> str:
    """The plans' predicted and measured step times, and the regret of the first choice."""
    head = ("plan", "predicted step s", "measured step s", "measured / predicted")
    rows = []
    for v in verified:
        measured = v.step_s
        if math.isnan(measured):
            rows.append((v.estimate.candidate.label, f"{v.estimate.step_s:.3f}", v.failed or "-", "-"))
            continue
        spread = f" ({min(v.measured_s):.3f}-{max(v.measured_s):.3f})" if len(v.measured_s) > 1 else ""
        rows.append(
            (
                v.estimate.candidate.label,
                f"{v.estimate.step_s:.3f}",
                f"{measured:.3f}{spread}",
                f"{measured / v.estimate.step_s:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    table = "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *rows]
    )
    lines = [
        f"Verified here: the first {len(verified)} plans that fit, {cluster.devices} processes on gloo, "
        f"{epochs} epochs a run (the first left out), {rounds} round(s) in turn, medians; runs in {out}",
        table,
        "",
        regret(verified),
    ]
    busy = host_warnings(verified)
    if busy:
        lines += [
            "",
            "The host was not these runs' alone, so the measured times include other work and their ratios "
            "to the predictions say little (ddpexp-report's warnings; rerun on an idle machine):",
            *(f"  {w}" for w in busy),
        ]
    return "\n".join(lines) + "\n"


def host_warnings(verified: list[Verified]) -> list[str]:
    """What ddpexp-report would warn about the host these runs shared: other load at their start or
    during them, jobs that overlapped, oversubscribed cores."""
    from ..report.host_warnings import run_warnings
    from ..report.runs import load_run

    runs = [load_run(d, d.name) for v in verified for d in v.run_dirs]
    return run_warnings(runs, runs)


def regret(verified: list[Verified]) -> str:
    ran = [v for v in verified if not math.isnan(v.step_s)]
    if not verified or math.isnan(verified[0].step_s):
        return "Regret: unknown, the recommended plan did not run to the end."
    best = min(ran, key=lambda v: v.step_s)
    first = verified[0]
    value = first.step_s / best.step_s - 1
    if best is first:
        return (
            f"Regret: 0%: the recommended plan, {first.estimate.candidate.label}, was the fastest measured."
        )
    return (
        f"Regret: {value:.0%}: the recommended plan, {first.estimate.candidate.label}, ran {value:.0%} "
        f"slower than the fastest measured, {best.estimate.candidate.label}."
    )


def default_out() -> Path:
    return Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S_plan_verify")

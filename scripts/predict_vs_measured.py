"""The cost model (ddpexp.predict) against what this machine measures, held out the way simulators are
judged: it reads one `single` run (one process) and commbench results of this host, then predicts each
strategy at W = 2, 3, 4 processes on gloo with the same model and global batch, which are measured
after; predicted vs measured step time, samples/s and bytes per step, the error in percent, and over
all cases the median and worst error, the rank correlation of predicted and measured throughput, and
how often the fastest strategy predicted at a W is the fastest measured there (the planner's choice).

    python scripts/predict_vs_measured.py                       # digits, ddp and fsdp at W = 2, 3, 4
    python scripts/predict_vs_measured.py --strategies ddp,zero,fsdp --epochs 5 --commbench FILE
    python scripts/predict_vs_measured.py --repeats 3          # medians over 3 rounds, with ranges
    python scripts/predict_vs_measured.py --repeats 3 --record ddpexp/predict/validation.json

--record FILE keeps every (strategy, W, round) predicted and measured, with the machine and the date:
the record `ddpexp plan` draws its intervals from (ddpexp/predict/validation.json is the one it ships;
`ddpexp plan --validation FILE` takes yours).

The commbench results (one per W and burst length, measured first) time each collective after
--burst-ms of compute (1 and 10 ms; a call's wait is interpolated between the lengths), as
a step's collectives follow its compute, and record what W processes computing at once do to each
one's compute; --back-to-back measures collectives as
nccl-tests does instead, and --commbench FILE (repeatable) or --interconnect NAME skip the measuring.
Every run gets trainer.threads=1: the model assumes compute scales with the cores a process gets,
which intra-op threads do not do perfectly; with one thread per process everywhere that question stays
out of the comparison. Results are for the machine and the minute they were measured on: run it on an
otherwise idle machine, and read the load averages it prints.

With several --worlds each strategy is also predicted calibrated on its own run at the smallest
(--calibrate-at; ddpexp-predict --calibrate): the issue's protocol, calibrate on W = 1 and 2 and
predict the rest. Its column and summary line come beside the uncalibrated ones; the record keeps the
uncalibrated predictions, as `ddpexp plan` makes them (no run on the cluster to calibrate on).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import ddpexp
from ddpexp.predict import MeasuredRun, Predictor
from ddpexp.predict.interconnect import fabric as make_fabric
from ddpexp.predict.validation import Case, Validation, save

HERE = Path(__file__).resolve().parent.parent


def train(out: Path, name: str, overrides: list[str]) -> MeasuredRun:
    run_dir = out / name
    result = ddpexp.run([*overrides, "trainer.progress=false", f"hydra.run.dir={run_dir}"])
    if result.status != "completed":
        raise SystemExit(f"{name}: the run {result.status} (see {run_dir}/ddpexp.log)")
    return MeasuredRun.read(run_dir)


def commbench(out: Path, world: int, burst_ms: float) -> Path | None:
    """This host's collectives on gloo at `world` processes (python -m ddpexp.commbench), each call after
    `burst_ms` of compute (0: back to back), or None where that fails."""
    run_dir = out / f"commbench-{world}" / f"{burst_ms:g}ms"
    command = [
        sys.executable,
        "-m",
        "ddpexp.commbench",
        "backend=gloo",
        f"dist.nprocs={world}",
        "trainer.threads=1",
        "commbench.ops=[all_reduce,all_gather,reduce_scatter,broadcast,sendrecv]",
        "commbench.min_bytes=1024",
        "commbench.max_bytes=4194304",
        f"commbench.after_compute_ms={burst_ms}",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(command, cwd=HERE, capture_output=True, text=True)
    path = run_dir / "commbench.json"
    if proc.returncode != 0 or not path.is_file():
        print(f"commbench failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
        return None
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs") / f"predict-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument(
        "--strategies", default="ddp,fsdp", help="comma-separated (ddp, fsdp, zero, naive_allreduce...)"
    )
    p.add_argument("--worlds", default="2,3,4", help="process counts")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (the first is left out)")
    p.add_argument("--batch", type=int, default=48, help="global batch (a multiple of every world size)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every run, in turn (medians + ranges)")
    p.add_argument(
        "--commbench",
        type=Path,
        action="append",
        help="a commbench.json to use instead of measuring (repeat it: one per process count)",
    )
    p.add_argument(
        "--burst-ms", default="1,10", help="compute before each benchmarked call: one commbench per length"
    )
    p.add_argument("--back-to-back", action="store_true", help="benchmark collectives back to back")
    p.add_argument("--interconnect", help="a profile to use instead of a commbench (e.g. localhost_gloo)")
    p.add_argument(
        "--calibrate-at",
        type=int,
        default=None,
        help="also predict each strategy calibrated on its own run at this W (default: the smallest of "
        "--worlds when there are several; 0: not)",
    )
    p.add_argument("--record", type=Path, help="write every case here (the planner's intervals)")
    p.add_argument("--machine", help="what --record says it ran on (default: cores, CPU, OS)")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    calibrate_at = min(worlds) if args.calibrate_at is None and len(worlds) > 1 else args.calibrate_at or 0
    strategies = args.strategies.split(",")
    common = [f"trainer.epochs={args.epochs}", f"trainer.batch_size={args.batch}", "trainer.threads=1"]
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; "
        f"runs in {args.out}"
    )

    source: dict[str, object] = {"interconnect": args.interconnect}
    if args.interconnect is None:
        bursts = [0.0] if args.back_to_back else [float(b) for b in args.burst_ms.split(",")]
        benches = args.commbench or [commbench(args.out, w, b) for w in worlds for b in bursts]
        source = {"commbench": benches} if all(benches) else {"interconnect": "localhost_gloo"}
    print(f"fabric: {make_fabric(**source).name}")  # type: ignore[arg-type]

    # Each round: a single run, then every strategy at every size, each predicted from that round's
    # single run; so drifting machine load hits a prediction and its measurement alike.
    rounds: list[dict[tuple[str, int], Row]] = []
    singles = []
    for r in range(args.repeats):
        tag = f"-r{r}" if args.repeats > 1 else ""
        single = train(args.out, f"single{tag}", ["strategy=single", *common])
        singles.append(single.mean("perf/step_time_s"))
        rows: dict[tuple[str, int], Row] = {}
        for strategy in strategies:
            predictor = Predictor.build(single.path, strategy=strategy, **source)  # type: ignore[arg-type]
            for world in worlds:
                measured = train(
                    args.out,
                    f"{strategy}-{world}{tag}",
                    [f"strategy={strategy}", f"dist.nprocs={world}", *common],
                )
                point = predictor.point(world)
                rows[(strategy, world)] = Row(
                    point.step_s,
                    measured.mean("perf/step_time_s"),
                    point.counted_bytes,
                    float(measured.final.get("comm/bytes_per_step", 0.0)),
                    point.exposed_s,
                    measured.mean("comm/time_per_step_s"),
                )
            if calibrate_at in worlds:  # the protocol: calibrate on W = 1 and 2, predict the rest
                predictor.calibrate(args.out / f"{strategy}-{calibrate_at}{tag}")
                for world in worlds:
                    if world != calibrate_at:
                        row = rows[(strategy, world)]
                        rows[(strategy, world)] = replace(row, step_cal=predictor.point(world).step_s)
        rounds.append(rows)
    print(
        f"\nload average {os.getloadavg()[0]:.2f} at the end; single: "
        f"{statistics.median(singles) * 1e3:.2f} ms/step{spread(singles, 1e3)} (epochs after the first)\n"
    )
    print(render(rounds, args.batch))
    machine = args.machine or f"{os.cpu_count()} cores, {platform.machine()}, {platform.system()}"
    held = record(rounds, machine)
    print(summary(held, rounds, worlds))
    if calibrate_at in worlds:
        print(calibrated_summary(rounds, worlds, calibrate_at))
    if args.record:
        print(f"\nwrote {save(held, args.record)}")
    print(
        "\nerr = (predicted - measured) / measured, of the medians over rounds; in brackets, with several "
        "rounds, the smallest and largest error of one round (each prediction against its own round's "
        "measurement). comm ms meas is the metered busy time per step (it includes waiting for the "
        "slowest rank); exposed pred is what the model says the step waits for."
    )
    return 0


@dataclass(frozen=True)
class Row:
    step_pred: float
    step_meas: float
    bytes_pred: float
    bytes_meas: float
    exposed_pred: float
    comm_meas: float
    step_cal: float = math.nan  # predicted with the strategy's own run at --calibrate-at


def record(
    rounds: list[dict[tuple[str, int], Row]],
    machine: str,
    predicted: Callable[[Row], float] = lambda row: row.step_pred,
) -> Validation:
    """Every (strategy, W, round), `predicted` against measured."""
    cases = tuple(
        Case(strategy, world, r, predicted(row), row.step_meas)
        for r, rows in enumerate(rounds)
        for (strategy, world), row in rows.items()
    )
    command = shlex.join(["python", "scripts/predict_vs_measured.py", *sys.argv[1:]])
    return Validation(machine, time.strftime("%Y-%m-%d"), command, cases)


def summary(held: Validation, rounds: list[dict[tuple[str, int], Row]], worlds: list[int]) -> str:
    """Over every (strategy, W) and round: the errors' median and worst (the record's, as the planner
    and the docs read them), Spearman's rank correlation of predicted and measured throughput, and at
    each W of each round whether the strategy predicted fastest was the one measured fastest."""
    pred = [1 / r.step_pred for rows in rounds for r in rows.values()]
    meas = [1 / r.step_meas for rows in rounds for r in rows.values()]
    choice = first_choice(rounds, worlds, lambda r: r.step_pred)
    return (
        f"\n{len(held.cases)} predictions: |error| median {held.median_error:.0%}, worst "
        f"{held.worst_error:.0%}; rank correlation of samples/s {spearman(pred, meas):+.2f}{choice}"
    )


def calibrated_summary(rounds: list[dict[tuple[str, int], Row]], worlds: list[int], at: int) -> str:
    """The same figures for the predictions calibrated on each strategy's own run at W = `at`, over
    the other sizes (the calibration's own size is fitted, not predicted)."""
    calibrated = [{k: r for k, r in rs.items() if not math.isnan(r.step_cal)} for rs in rounds]
    held = record(calibrated, "", lambda r: r.step_cal)
    rho = spearman([1 / c.predicted_s for c in held.cases], [1 / c.measured_s for c in held.cases])
    choice = first_choice(rounds, worlds, lambda r: r.step_cal)
    return (
        f"calibrated on each strategy's own run at W = {at} as well ({len(held.cases)} predictions at the "
        f"other sizes): |error| median {held.median_error:.0%}, worst {held.worst_error:.0%}; rank "
        f"correlation of samples/s {rho:+.2f}{choice}"
    )


def first_choice(
    rounds: list[dict[tuple[str, int], Row]], worlds: list[int], predicted: Callable[[Row], float]
) -> str:
    """At each W of each round with two strategies or more predicted: was the one predicted fastest
    the one measured fastest?"""
    right = scenarios = 0
    for rows in rounds:
        for world in worlds:
            here = {k: r for k, r in rows.items() if k[1] == world and not math.isnan(predicted(r))}
            if len(here) > 1:
                scenarios += 1
                chosen = min(here, key=lambda k: predicted(here[k]))
                right += chosen == min(here, key=lambda k: here[k].step_meas)
    return f"; first choice right in {right} of {scenarios} (W, round)" if scenarios else ""


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties share their mean rank)."""
    if len(a) < 2:
        return float("nan")

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    if len(set(ra)) < 2 or len(set(rb)) < 2:
        return float("nan")
    return statistics.correlation(ra, rb)


def spread(values: list[float], scale: float) -> str:
    return f" ({min(values) * scale:.2f}-{max(values) * scale:.2f})" if len(values) > 1 else ""


def render(rounds: list[dict[tuple[str, int], Row]], batch: int) -> str:
    header = (
        "strategy",
        "W",
        "step ms pred",
        "meas",
        "err",
        "samples/s pred",
        "meas",
        "bytes/step pred",
        "meas",
        "comm ms exposed pred",
        "comm ms meas",
        "calibrated pred",
        "err",
    )
    table = [header]
    for key in rounds[0]:
        rows = [r[key] for r in rounds]
        pred = statistics.median(r.step_pred for r in rows)
        meas = statistics.median(r.step_meas for r in rows)
        errors = [(r.step_pred - r.step_meas) / r.step_meas for r in rows]
        err = f"{(pred - meas) / meas:+.0%}"
        if len(rows) > 1:
            err += f" ({min(errors):+.0%} to {max(errors):+.0%})"
        cal = statistics.median(r.step_cal for r in rows)
        cal_err = "-" if math.isnan(cal) else f"{(cal - meas) / meas:+.0%}"
        table.append(
            (
                key[0],
                str(key[1]),
                f"{pred * 1e3:.2f}",
                f"{meas * 1e3:.2f}" + spread([r.step_meas for r in rows], 1e3),
                err,
                f"{batch / pred:,.0f}",
                f"{batch / meas:,.0f}",
                f"{statistics.median(r.bytes_pred for r in rows):,.0f}",
                f"{statistics.median(r.bytes_meas for r in rows):,.0f}",
                f"{statistics.median(r.exposed_pred for r in rows) * 1e3:.2f}",
                f"{statistics.median(r.comm_meas for r in rows) * 1e3:.2f}",
                "-" if math.isnan(cal) else f"{cal * 1e3:.2f}",
                cal_err,
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(wd) for c, wd in zip(row, widths, strict=True)) for row in table)


if __name__ == "__main__":
    sys.exit(main())

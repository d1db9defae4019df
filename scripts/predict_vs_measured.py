"""The cost model (ddpexp.predict) against what this machine measures: a one-process `single` run, a
commbench of this host (or a file, or a profile), then each strategy at W = 2, 3, 4 processes on
gloo with the same model and global batch; predicted vs measured step time and samples/s, and the
error in percent. The prediction for every size reads only the single run and the interconnect.

    python scripts/predict_vs_measured.py                       # digits, ddp and fsdp at W = 2, 3, 4
    python scripts/predict_vs_measured.py --strategies ddp,zero,fsdp --epochs 5 --commbench FILE

Every run gets trainer.threads=1: the model assumes compute scales with the cores a process gets, which
intra-op threads do not do perfectly; with one thread per process everywhere that question stays out
of the comparison (a process then gets min(1, cores / processes) cores: on a host with fewer cores
than processes, the sharing is what is predicted). Results are for the machine and the minute they
were measured on: run it on an otherwise idle machine, and read the load averages it prints.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import ddpexp
from ddpexp.predict import MeasuredRun, Predictor
from ddpexp.predict import fabric as make_fabric

HERE = Path(__file__).resolve().parent.parent


def train(out: Path, name: str, overrides: list[str]) -> MeasuredRun:
    run_dir = out / name
    result = ddpexp.run([*overrides, "trainer.progress=false", f"hydra.run.dir={run_dir}"])
    if result.status != "completed":
        raise SystemExit(f"{name}: the run {result.status} (see {run_dir}/ddpexp.log)")
    return MeasuredRun.read(run_dir)


def commbench(out: Path, world: int) -> Path | None:
    """This host's collectives on gloo (python -m ddpexp.commbench), or None where that fails."""
    run_dir = out / "commbench"
    command = [
        sys.executable,
        "-m",
        "ddpexp.commbench",
        "backend=gloo",
        f"dist.nprocs={world}",
        "trainer.threads=1",
        "commbench.ops=[all_reduce,all_gather,reduce_scatter,broadcast,sendrecv]",
        "commbench.max_bytes=4194304",
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
    p.add_argument("--commbench", type=Path, help="a commbench.json to use instead of measuring one")
    p.add_argument("--interconnect", help="a profile to use instead of a commbench (e.g. localhost_gloo)")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    strategies = args.strategies.split(",")
    common = [f"trainer.epochs={args.epochs}", f"trainer.batch_size={args.batch}", "trainer.threads=1"]
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; "
        f"runs in {args.out}"
    )

    single = train(args.out, "single", ["strategy=single", *common])
    source: dict[str, object] = {"interconnect": args.interconnect}
    if args.interconnect is None:
        bench = args.commbench or commbench(args.out, min(worlds))
        source = {"commbench": bench} if bench else {"interconnect": "localhost_gloo"}
    print(f"fabric: {make_fabric(**source).name}")  # type: ignore[arg-type]

    rows = []
    for strategy in strategies:
        predictor = Predictor.build(single.path, strategy=strategy, **source)  # type: ignore[arg-type]
        for world in worlds:
            measured = train(
                args.out, f"{strategy}-{world}", [f"strategy={strategy}", f"dist.nprocs={world}", *common]
            )
            point = predictor.point(world)
            step = measured.mean("perf/step_time_s")
            rows.append(
                (
                    strategy,
                    world,
                    point.step_s,
                    step,
                    point.samples_per_s,
                    measured.mean("perf/samples_per_s"),
                    point.counted_bytes,
                    float(measured.final.get("comm/bytes_per_step", 0.0)),
                    point.exposed_s,
                    measured.mean("comm/time_per_step_s"),
                )
            )
    print(
        f"\nload average {os.getloadavg()[0]:.2f} at the end; single: "
        f"{single.mean('perf/step_time_s') * 1e3:.2f} "
        f"ms/step, {single.mean('perf/samples_per_s'):,.0f} samples/s (epochs after the first)\n"
    )
    header = (
        "strategy",
        "W",
        "step ms pred",
        "meas",
        "err",
        "samples/s pred",
        "meas",
        "err",
        "bytes/step pred",
        "meas",
        "comm ms exposed pred",
        "comm ms meas",
    )
    table = [header]
    for s, w, ps, ms, pt, mt, pb, mb, pe, mc in rows:
        table.append(
            (
                s,
                str(w),
                f"{ps * 1e3:.2f}",
                f"{ms * 1e3:.2f}",
                f"{(ps - ms) / ms:+.0%}",
                f"{pt:,.0f}",
                f"{mt:,.0f}",
                f"{(pt - mt) / mt:+.0%}",
                f"{pb:,.0f}",
                f"{mb:,.0f}",
                f"{pe * 1e3:.2f}",
                f"{mc * 1e3:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.rjust(wd) for c, wd in zip(row, widths, strict=True)))
    print(
        "\nerr = (predicted - measured) / measured. comm ms meas is the metered busy time per step (it "
        "includes waiting for the slowest rank); exposed pred is what the model says the step waits for."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

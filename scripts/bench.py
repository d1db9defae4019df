"""Benchmark: ddpexp against hand-written PyTorch loops, interleaved in one invocation.

For each model (mlp: data handling dominates; convnet: compute dominates) and strategy (single; ddp
with 2 gloo ranks), repeated --repeats times in turn:

  ddpexp     python -m ddpexp ... data=synthetic (device-resident batches, the automatic choice)
  plain      scripts/plain_loop.py: DataLoader + DistributedSampler (+ DDP), the tutorials' loop
  bare       (single only) one batch re-used on the device: compute only, the ceiling

Throughput is the last epoch's training samples/s (epoch 1 is warm-up; evaluation is not timed), the
median over repeats. Also printed: ddpexp's time from command to first optimizer step, its per-step
data-wait and communication share, and peak memory (max RSS) of its workers.

    python scripts/bench.py                 # full: 3 repeats, 16384 samples per epoch
    python scripts/bench.py --smoke         # under a minute: mlp only, 1 repeat, tiny data (CI runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_ddpexp(model: str, strategy: str, n: int, work: Path, tag: str) -> dict[str, float]:
    run_dir = work / tag
    cmd = [
        sys.executable, "-m", "ddpexp", f"strategy={strategy}", f"model={model}", "data=synthetic",
        f"data.num_train={n}", "data.num_eval=256", "trainer.epochs=2", "trainer.batch_size=64",
        "trainer.progress=false", "checkpoint.every_epochs=null", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "DDPEXP_T0": str(time.time())}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"ddpexp failed:\n{proc.stderr[-2000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    last = m["history"][-1]
    return {
        "samples_per_s": last["perf/samples_per_s"],
        "startup_s": m.get("time_to_first_step_s", float("nan")),
        "data_wait": last.get("perf/data_wait_frac", 0.0),
        "comm_share": last.get("comm/share", 0.0),
        "peak_mb": last.get("mem/peak_mb", float("nan")),
    }


def run_plain(model: str, world: int, n: int, *, bare: bool = False) -> float:
    cmd = [
        sys.executable,
        str(HERE / "plain_loop.py"),
        f"--model={model}",
        f"--world={world}",
        f"--num-train={n}",
    ]
    if bare:
        cmd.append("--bare")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"plain loop failed:\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["samples_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny and fast: checks that everything runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-train", type=int, default=16384)
    p.add_argument("--models", default="mlp,convnet")
    p.add_argument("--strategies", default="single,ddp")
    args = p.parse_args()
    repeats, n = (1, 512) if args.smoke else (args.repeats, args.num_train)
    models = "mlp" if args.smoke else args.models
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in models.split(","):
            for strategy in args.strategies.split(","):
                world = 2 if strategy == "ddp" else 1
                ours, plain, bare = [], [], []
                for i in range(repeats):  # interleaved, so drifting machine load hits all alike
                    ours.append(run_ddpexp(model, strategy, n, work, f"{model}-{strategy}-{i}"))
                    plain.append(run_plain(model, world, n))
                    if strategy == "single":
                        bare.append(run_plain(model, world, n, bare=True))
                med = {k: statistics.median(r[k] for r in ours) for k in ours[0]}
                p_med = statistics.median(plain)
                b_med = statistics.median(bare) if bare else float("nan")
                rows.append((model, strategy, med, p_med, b_med))
    cols = (
        "model",
        "strategy",
        "ddpexp/s",
        "plain/s",
        "ratio",
        "bare/s",
        "vs bare",
        "start s",
        "data",
        "comm",
    )
    widths = (8, 8, 10, 10, 6, 10, 7, 7, 6, 6)
    head = " ".join(
        f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cols, widths, strict=True))
    )
    head += f" {'peak MB':>8}"
    print(head)
    for model, strategy, m, plain_s, bare_s in rows:
        vs_bare = m["samples_per_s"] / bare_s if bare_s == bare_s else float("nan")
        print(
            f"{model:<8} {strategy:<8} {m['samples_per_s']:>10,.0f} {plain_s:>10,.0f} "
            f"{m['samples_per_s'] / plain_s:>6.2f} {bare_s:>10,.0f} {vs_bare:>7.2f} {m['startup_s']:>7.1f} "
            f"{m['data_wait']:>6.1%} {m['comm_share']:>6.1%} {m['peak_mb']:>8,.0f}"
        )
    cpus = os.cpu_count()
    print(f"(median of {repeats}; last-epoch training samples/s; {cpus} CPUs; threads per rank = CPUs/ranks)")


if __name__ == "__main__":
    main()

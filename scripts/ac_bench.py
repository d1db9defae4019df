"""What activation checkpointing buys: activation memory per rank against time per step.

For each strategy (single; ddp with 2 gloo ranks) and trainer.activation_checkpointing (none, full,
selective), in rounds that take turns (none, full, selective, none, ...), each a fresh
`python -m ddpexp` process on synthetic data:

  act_MB   mem/activations_mb: the peak of the tensors held for the backward in one micro-batch, per
           rank (the largest rank); measured, and the same every round
  step_s   perf/step_time_s of the last epoch (the first, a warm-up, holds the measured micro-batch)

Ratios against none of the same round (a drifting machine load hits the contenders of one round
alike): memory, and time per step as median (min-max over rounds).

    python scripts/ac_bench.py                   # resnet18 on 3x16x16 images, 3 rounds
    python scripts/ac_bench.py --model convnet   # the MNIST ConvNet: 3 blocks, one of them most of it
    python scripts/ac_bench.py --smoke           # about a minute: convnet, single, 1 round (CI runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("none", "full", "selective")
# ddpexp overrides per model; the samples per epoch and the global batch.
MODELS = {
    "resnet18": (["model=resnet18", "model.cifar_stem=true", "data.shape=[3,16,16]"], 192, 32),
    "convnet": (["model=convnet"], 1024, 64),
}


def run(model: str, strategy: str, mode: str, *, samples: int, epochs: int, work: Path) -> dict[str, float]:
    overrides, _, batch = MODELS[model]
    run_dir = work / f"{strategy}-{mode}-{len(list(work.iterdir()))}"
    cmd = [
        sys.executable, "-m", "ddpexp", f"strategy={strategy}", *overrides, "data=synthetic",
        f"data.num_train={samples}", "data.num_eval=64", f"trainer.epochs={epochs}",
        f"trainer.batch_size={batch}", f"trainer.activation_checkpointing={mode}",
        "trainer.progress=false", "checkpoint.every_epochs=null", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"ddpexp failed:\n{proc.stderr[-2000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    return {
        "act_mb": max(r["mem/activations_mb"] for r in m["memory_per_rank"]),
        "step_s": m["history"][-1]["perf/step_time_s"],
    }


def spread(values: list[float], fmt: str) -> str:
    shown = format(statistics.median(values), fmt)
    return shown if len(values) < 2 else f"{shown} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="resnet18")
    p.add_argument("--strategies", default="single,ddp", help="smoke: single")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2, help="per process; the last one is timed")
    p.add_argument("--smoke", action="store_true", help="tiny and fast: checks that everything runs")
    args = p.parse_args()
    model = "convnet" if args.smoke else args.model
    samples = 256 if args.smoke else MODELS[model][1]
    rounds = 1 if args.smoke else args.rounds
    strategies = "single" if args.smoke else args.strategies
    print(f"{model}, {samples} samples per epoch, global batch {MODELS[model][2]}, {os.cpu_count()} CPUs")
    header = f"{'strategy':<9} {'mode':<10} {'act_MB':>8} {'step_s':>22} {'act/none':>9} {'step/none':>20}"
    print(header)
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in strategies.split(","):
            results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for _ in range(rounds):
                for mode in MODES:
                    results[mode].append(
                        run(model, strategy, mode, samples=samples, epochs=args.epochs, work=Path(tmp))
                    )
            for mode in MODES:
                ours, none = results[mode], results["none"]
                act = [r["act_mb"] / n["act_mb"] for r, n in zip(ours, none, strict=True)]
                step = [r["step_s"] / n["step_s"] for r, n in zip(ours, none, strict=True)]
                print(
                    f"{strategy:<9} {mode:<10} {statistics.median(r['act_mb'] for r in ours):>8.2f} "
                    f"{spread([r['step_s'] for r in ours], '.3f'):>22} {statistics.median(act):>9.2f} "
                    f"{spread(step, '.2f'):>20}"
                )


if __name__ == "__main__":
    main()

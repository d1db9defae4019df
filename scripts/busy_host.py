"""How much a run slows when one other busy process shares the host, and how fairly contenders share it.

Each contender trains the default experiment (convnet on digits) for --epochs epochs, a fresh
`python -m ddpexp` per run, contenders and conditions alternating in one invocation:

  idle   nothing else started by this script
  busy   one other process spinning on a core, in a session of its own (another user's job)

Contenders: `single` as ddpexp runs it (OpenMP threads wait passively), `single` with libgomp's
default spin before sleeping (GOMP_SPINCOUNT=300000: how ddpexp ran before it set the wait policy),
`single` with one thread, and `ddp` with 2 ranks. Throughput is the last epoch's training samples/s
(the first is a warm-up); the table gives the median over repeats with min-max, and busy/idle.

    python scripts/busy_host.py                 # 3 repeats of 2 epochs (about 10 min on 2 idle cores)
    python scripts/busy_host.py --smoke         # one short repeat: it runs, no timing claims (CI)
    python scripts/busy_host.py --spins 10000,30000   # also `single` with those GOMP_SPINCOUNTs
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

CONTENDERS = {
    "single": (["strategy=single"], {}),
    "single, spin": (["strategy=single"], {"GOMP_SPINCOUNT": "300000"}),
    "single, 1 thread": (["strategy=single", "trainer.threads=1"], {}),
    "ddp, 2 ranks": (["strategy=ddp", "dist.nprocs=2"], {}),
}
SPIN = "while True: pass"


def run_once(overrides: list[str], env: dict[str, str], epochs: int, extra: list[str]) -> float:
    """The last epoch's training samples/s of one fresh run."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "ddpexp",
            *overrides,
            f"trainer.epochs={epochs}",
            "trainer.progress=false",
        ]
        clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        subprocess.run(
            [*cmd, *extra, f"hydra.run.dir={tmp}/run"], env={**clean, **env}, check=True, capture_output=True
        )
        history = json.loads((Path(tmp) / "run" / "metrics.json").read_text())["history"]
        return float(history[-1]["perf/samples_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="one repeat of a few steps: it runs, no claims")
    parser.add_argument(
        "--spins", default="", help="GOMP_SPINCOUNT values to try `single` with, e.g. 10000,30000"
    )
    args = parser.parse_args()
    for count in filter(None, args.spins.split(",")):
        CONTENDERS[f"single, spin {int(count)}"] = (["strategy=single"], {"GOMP_SPINCOUNT": str(int(count))})
    extra = ["trainer.max_steps=4"] if args.smoke else []
    repeats, epochs = (1, 1) if args.smoke else (args.repeats, args.epochs)
    speeds: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for condition in ("idle", "busy"):
            spinner = (
                subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True)
                if condition == "busy"
                else None
            )
            try:
                for name, (overrides, env) in CONTENDERS.items():
                    speeds.setdefault((name, condition), []).append(run_once(overrides, env, epochs, extra))
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    print(f"samples/s, median [min-max] of {repeats} repeats; busy: one other process spinning on a core")
    print(f"{'contender':18} {'idle':>24} {'busy':>24} {'busy/idle':>10}")
    for name in CONTENDERS:
        cells = []
        for condition in ("idle", "busy"):
            values = speeds[(name, condition)]
            cells.append(f"{statistics.median(values):8.0f} [{min(values):.0f}-{max(values):.0f}]")
        ratio = statistics.median(speeds[(name, "busy")]) / statistics.median(speeds[(name, "idle")])
        print(f"{name:18} {cells[0]:>24} {cells[1]:>24} {ratio:10.2f}")
    print(f"host: {os.cpu_count()} cores, 1-min load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""How much a run slows when one other busy process shares the host, and how fairly contenders share it.

Each contender trains the default experiment (convnet on digits) for --epochs epochs, a fresh
`python -m ddpexp` per run, contenders and conditions alternating in one invocation:

  idle   nothing else started by this script
  busy   one other process spinning on a core, in a session of its own (another user's job)

Contenders: `single` as ddpexp runs it (OpenMP threads wait passively), `single` with libgomp's
default spin before sleeping (GOMP_SPINCOUNT=300000: how ddpexp ran before it set the wait policy),
`single` with one thread, `ddp` with 2 ranks, and `single` from Python (`ddpexp.run` in a script),
plain and after the script imported torch itself (as a notebook does: its OpenMP threads spin, so
ddpexp runs the job in a worker of its own). Throughput is the last epoch's training samples/s
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

# name: (overrides, environment, the Python script's first lines, or None for the command line)
CONTENDERS: dict[str, tuple[list[str], dict[str, str], str | None]] = {
    "single": (["strategy=single"], {}, None),
    "single, spin": (["strategy=single"], {"GOMP_SPINCOUNT": "300000"}, None),
    "single, 1 thread": (["strategy=single", "trainer.threads=1"], {}, None),
    "ddp, 2 ranks": (["strategy=ddp", "dist.nprocs=2"], {}, None),
    "single, ddpexp.run": (["strategy=single"], {}, ""),
    "single, torch first": (["strategy=single"], {}, "import torch\n"),
}
SPIN = "while True: pass"


def run_once(
    overrides: list[str], env: dict[str, str], prelude: str | None, epochs: int, extra: list[str]
) -> float:
    """The last epoch's training samples/s of one fresh run: from the command line, or from a Python
    script that starts with `prelude`."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            *overrides,
            f"trainer.epochs={epochs}",
            "trainer.progress=false",
            *extra,
            f"hydra.run.dir={tmp}/run",
        ]
        if prelude is None:
            cmd = [sys.executable, "-m", "ddpexp", *args]
        else:
            cmd = [sys.executable, "-c", f"{prelude}import ddpexp\nddpexp.run({args!r})\n"]
        clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        subprocess.run(cmd, env={**clean, **env}, check=True, capture_output=True)
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
        CONTENDERS[f"single, spin {int(count)}"] = (
            ["strategy=single"],
            {"GOMP_SPINCOUNT": str(int(count))},
            None,
        )
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
                for name, (overrides, env, prelude) in CONTENDERS.items():
                    speed = run_once(overrides, env, prelude, epochs, extra)
                    speeds.setdefault((name, condition), []).append(speed)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    print(f"samples/s, median [min-max] of {repeats} repeats; busy: one other process spinning on a core")
    print(f"{'contender':20} {'idle':>24} {'busy':>24} {'busy/idle':>10}")
    for name in CONTENDERS:
        cells = []
        for condition in ("idle", "busy"):
            values = speeds[(name, condition)]
            cells.append(f"{statistics.median(values):8.0f} [{min(values):.0f}-{max(values):.0f}]")
        ratio = statistics.median(speeds[(name, "busy")]) / statistics.median(speeds[(name, "idle")])
        print(f"{name:20} {cells[0]:>24} {cells[1]:>24} {ratio:10.2f}")
    print(f"host: {os.cpu_count()} cores, 1-min load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

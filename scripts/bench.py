"""Benchmark: ddpexp against hand-written PyTorch loops, interleaved in one invocation.

For each model (MODELS: the default mlp; mlp64, small enough that data handling dominates; convnet,
compute-bound) and strategy (single; ddp, fsdp and zero with 2 gloo ranks), repeated --repeats times
in turn, each a fresh process:

  ddpexp:device  python -m ddpexp ... data=synthetic loader.mode=device   (the automatic choice)
  ddpexp:loader  the same with loader.mode=dataloader                       (torch DataLoader path)
  plain:loader   scripts/plain_loop.py: DataLoader + DistributedSampler (+ DDP), the tutorials' loop;
                 for fsdp and zero its twins as PyTorch's examples write them (fully_shard per block,
                 then the root; DDP + ZeroRedundancyOptimizer), same loop
  plain:index    the same loop over hand-written device-resident batches (tensor indexing)
  bare           (single only) one batch re-used on the device: compute only, the ceiling

Throughput is training samples/s (evaluation is not timed): in each process the median over the epochs
after the first (a warm-up), then the median over repeats. The ratios: framework overhead on the same
data path (ddpexp:loader / plain:loader and ddpexp:device / plain:index; 1.00 = none), what the
device-resident path gains over the tutorials' loop (ddpexp:device / plain:loader), and the distance
to the ceiling (ddpexp:device / bare). Also: ddpexp's time from command to first optimizer step, its
data-wait and communication shares, and peak memory (max RSS of the largest rank) of ddpexp and of
the plain loop.

    python scripts/bench.py                 # full: 5 repeats of 5 epochs (about an hour on 2 cores)
    python scripts/bench.py --smoke         # about a minute: mlp only, 1 repeat, tiny data (CI runs it)
    python scripts/bench.py --smoke --strategies fsdp,zero    # the sharded twins, smoke-sized

The smoke run's strategies are single and ddp unless --strategies names others.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


# Benchmarked models: ddpexp overrides, plain_loop.py arguments, training samples per epoch.
MODELS = {
    "mlp": (["model=mlp"], ["--model=mlp"], 16384),  # hidden 256, 128: compute still dominates on CPU
    "mlp64": (["model=mlp", "model.hidden=[64]"], ["--model=mlp", "--hidden=64"], 16384),  # data-bound
    "convnet": (["model=convnet"], ["--model=convnet"], 4096),  # compute-bound
}


@functools.cache
def torch_gpus() -> int:
    """GPUs visible to torch (asked in a subprocess, so this script itself never imports torch)."""
    code = "import torch; print(torch.cuda.device_count())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout or 0)


def run_ddpexp(
    model: str, strategy: str, world: int, n: int, loader: str, work: Path, tag: str, epochs: int
) -> dict[str, float]:
    run_dir = work / tag
    cmd = [
        sys.executable, "-m", "ddpexp", f"strategy={strategy}", *MODELS[model][0], "data=synthetic",
        f"data.num_train={n}", "data.num_eval=256", f"trainer.epochs={epochs}", "trainer.batch_size=64",
        f"loader.mode={loader}", "trainer.progress=false", "checkpoint.every_epochs=null",
        *([f"dist.nprocs={world}"] if strategy != "single" else []),
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "DDPEXP_T0": str(time.time())}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"ddpexp failed:\n{proc.stderr[-2000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    history = m["history"]
    last = history[-1]
    facts = m["facts"]  # command_started_at is DDPEXP_T0: this script's clock, before the interpreter
    first_step_at = facts["job_started_at"] + m.get("time_to_first_step_s", float("nan"))
    return {
        "samples_per_s": statistics.median(h["perf/samples_per_s"] for h in history[1:] or history),
        "startup_s": first_step_at - facts["command_started_at"],
        "data_wait": last.get("perf/data_wait_frac", 0.0),
        "comm_share": last.get("comm/share", 0.0),
        "peak_mb": last.get("mem/peak_mb", float("nan")),
    }


def run_script(name: str, args: list[str]) -> dict[str, float]:
    """Run one of the scripts beside this one; its last stdout line is its JSON result."""
    proc = subprocess.run([sys.executable, str(HERE / name), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_plain(model: str, strategy: str, world: int, n: int, loader: str, epochs: int) -> dict[str, float]:
    args = [*MODELS[model][1], f"--world={world}", f"--num-train={n}", f"--loader={loader}"]
    if strategy != "single":
        args.append(f"--strategy={strategy}")  # its hand-written twin (plain_loop.py)
    return run_script("plain_loop.py", [*args, f"--epochs={epochs}"])


def run_loop_overhead(model: str, *, smoke: bool, world: int = 1) -> dict[str, float]:
    rounds = ["--rounds=2", "--num-train=512"] if smoke else ["--rounds=15"]
    return run_script("loop_overhead.py", [f"--model={model}", *rounds, f"--world={world}"])


def measure(
    model: str, strategy: str, n: int, repeats: int, epochs: int, work: Path, *, smoke: bool = False
) -> dict[str, float]:
    """Medians over repeats; the variants take turns, so drifting machine load hits all alike. The smoke
    run skips the distributed rows' DataLoader variants (the single row already runs both data paths)."""
    world = (min(2, torch_gpus()) if torch_gpus() else 2) if strategy != "single" else 1
    ours = ("device",) if smoke and world > 1 else ("device", "dataloader")
    plain = (
        ("dataloader", "index", "bare") if world == 1 else ("index",) if smoke else ("dataloader", "index")
    )
    runs: dict[str, list[dict[str, float]]] = {}
    for i in range(repeats):
        for loader in ours:
            tag = f"{model}-{strategy}-{loader}-{i}"
            runs.setdefault(f"ddpexp:{loader}", []).append(
                run_ddpexp(model, strategy, world, n, loader, work, tag, epochs)
            )
        for loader in plain:
            result = run_plain(model, strategy, world, n, loader, epochs)
            runs.setdefault(f"plain:{loader}", []).append(result)
    med = {
        f"{variant}/{key}": statistics.median(r[key] for r in rs)
        for variant, rs in runs.items()
        for key in rs[0]
    }
    nan = float("nan")
    for missing in ("ddpexp:dataloader", "plain:dataloader", "plain:bare"):
        for key in ("samples_per_s", "peak_mb"):
            med.setdefault(f"{missing}/{key}", nan)
    return med


COLUMNS = [  # (header, width, format, value)
    ("ddpexp:device", 13, ",.0f", lambda m: m["ddpexp:device/samples_per_s"]),
    ("ddpexp:loader", 13, ",.0f", lambda m: m["ddpexp:dataloader/samples_per_s"]),
    ("plain:loader", 12, ",.0f", lambda m: m["plain:dataloader/samples_per_s"]),
    ("plain:index", 11, ",.0f", lambda m: m["plain:index/samples_per_s"]),
    ("bare", 8, ",.0f", lambda m: m["plain:bare/samples_per_s"]),
]
RATIOS = [
    (
        "loader/loader",
        13,
        ".2f",
        lambda m: m["ddpexp:dataloader/samples_per_s"] / m["plain:dataloader/samples_per_s"],
    ),
    ("device/index", 12, ".2f", lambda m: m["ddpexp:device/samples_per_s"] / m["plain:index/samples_per_s"]),
    (
        "device/loader",
        13,
        ".2f",
        lambda m: m["ddpexp:device/samples_per_s"] / m["plain:dataloader/samples_per_s"],
    ),
    ("device/bare", 11, ".2f", lambda m: m["ddpexp:device/samples_per_s"] / m["plain:bare/samples_per_s"]),
    ("start_s", 7, ".1f", lambda m: m["ddpexp:device/startup_s"]),
    ("data", 6, ".1%", lambda m: m["ddpexp:device/data_wait"]),
    ("comm", 6, ".1%", lambda m: m["ddpexp:device/comm_share"]),
    ("peak_MB", 8, ",.0f", lambda m: m["ddpexp:device/peak_mb"]),
    ("plain_MB", 8, ",.0f", lambda m: m["plain:dataloader/peak_mb"]),
]


def table(title: str, columns: list, rows: list[tuple[str, str, dict[str, float]]]) -> str:
    lines = [title, f"{'model':<8} {'strategy':<8} " + " ".join(f"{h:>{w}}" for h, w, _, _ in columns)]
    for model, strategy, m in rows:
        cells = " ".join(f"{value(m):>{w}{fmt}}" for _, w, fmt, value in columns)
        lines.append(f"{model:<8} {strategy:<8} {cells}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny and fast: checks that everything runs")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=int, default=5, help="per process; the first is a warm-up")
    p.add_argument("--num-train", type=int, default=None, help="default: per model (MODELS)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--strategies", default=None, help="default: single,ddp,fsdp,zero (smoke: single,ddp)")
    args = p.parse_args()
    repeats = 1 if args.smoke else args.repeats
    epochs = 2 if args.smoke else args.epochs
    models = "mlp" if args.smoke else args.models
    strategies = args.strategies or ("single,ddp" if args.smoke else "single,ddp,fsdp,zero")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models.split(","):
            n = 512 if args.smoke else args.num_train or MODELS[model][2]
            for strategy in strategies.split(","):
                rows.append(
                    (
                        model,
                        strategy,
                        measure(model, strategy, n, repeats, epochs, Path(tmp), smoke=args.smoke),
                    )
                )
    print(table("samples/s", COLUMNS, rows))
    print()
    print(table("ratios and costs", RATIOS, rows))
    print()
    print("loop overhead, one process, epochs in turn (scripts/loop_overhead.py): ddpexp / hand-written")
    for model in models.split(","):
        r = run_loop_overhead(model, smoke=args.smoke)
        print(
            f"{model:<8} {r['ddpexp']:>10,.0f} / {r['hand']:>10,.0f} samples/s = {r['ratio']:.3f} "
            f"(rounds {r['ratio_min']:.2f}-{r['ratio_max']:.2f}); vs bare: ddpexp {r['ddpexp_vs_bare']:.3f}, "
            f"hand {r['hand_vs_bare']:.3f}; ddpexp vs DataLoader loop {r['ddpexp_vs_loader']:.2f}, "
            f"ddpexp on its DataLoader path vs it {r['ddpexp_loader_vs_loader']:.2f}"
        )
    if "ddp" in strategies.split(","):
        print()
        print(
            "ddp loop overhead, in 2 gloo ranks, epochs in turn: ddpexp / hand DDP, with the comm meter as "
            "by default (time sampled) / timing every step / off"
        )
        for model in models.split(","):
            r = run_loop_overhead(model, smoke=args.smoke, world=2)
            lo, hi = r["ddpexp_vs_hand_range"]
            every, quiet = r["ddpexp_every_vs_hand"], r["ddpexp_quiet_vs_hand"]
            speeds = f"{r['ddpexp']:>10,.0f} / {r['hand']:>10,.0f} samples/s"
            print(
                f"{model:<8} {speeds} = {r['ddpexp_vs_hand']:.3f} (rounds {lo:.2f}-{hi:.2f}) "
                f"/ {every:.3f} / {quiet:.3f}"
            )
    cpus = os.cpu_count()
    print(
        f"(training samples/s: median of {repeats} processes, each the median of its epochs 2-{epochs}; "
        f"{cpus} CPUs; threads per rank = CPUs/ranks)"
    )


if __name__ == "__main__":
    main()

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
to the ceiling (ddpexp:device / bare); the two same-path ratios also repeat by repeat (the pair of
processes that ran one after another), their median and min-max: the spread. Also: ddpexp's time
from command to first optimizer step, its data-wait and communication shares, and peak memory (max
RSS of the largest rank) of ddpexp and of the plain loop.

    python scripts/bench.py                 # full: 5 repeats of 5 epochs (about an hour on 2 cores)
    python scripts/bench.py --smoke         # about a minute: mlp only, 1 repeat, tiny data (CI runs it)
    python scripts/bench.py --smoke --strategies fsdp,zero    # the sharded twins, smoke-sized

The smoke run's strategies are single and ddp unless --strategies names others.

--transformer measures the GPT instead (`model=gpt_small`, `data=synthetic_tokens`, `task=lm`,
`optim=adamw`, global batch 16 windows of 128 tokens, --gpt-steps optimizer steps an epoch) against
its hand-written twin, scripts/plain_gpt.py (plain PyTorch, DDP and FSDP2 as PyTorch's examples
write them), for single, ddp and fsdp (2 ranks on CPUs, one per GPU on GPUs), in two ways:

  between processes  each repeat one pair of fresh processes, `python -m ddpexp` and the twin, the order
                     swapped every repeat (drifting load falls on both alike), the strategies taking
                     turns within a repeat. Per strategy: the median tokens/s of each, the median of the
                     pairs' ratios ddpexp / twin with their min-max, ddpexp's start-up and peak memory
                     beside the twin's, the largest relative difference between the two contenders'
                     per-epoch training losses (both train the same model on the same batches: ~0, a
                     check, not a speed) and the 1-minute load average at each start (min-max)
  in turn            scripts/gpt_overhead.py: ddpexp's Engine on its strategy and the twin's loop in the
                     same process(es), one epoch each in turn, --gpt-rounds rounds: the median ratio
                     of the rounds (min-max), which resolves what the noise between processes hides;
                     on CPUs only (--gpt-rounds 0 leaves it out)

Both contenders' OpenMP threads sleep between parallel regions (ddpexp sets OMP_WAIT_POLICY=PASSIVE
for itself, this script for the twin), and both use ddpexp's threads rule (cores / processes).

    python scripts/bench.py --transformer                   # 7 pairs, 15 rounds (about 20 min)
    python scripts/bench.py --transformer --smoke           # gpt_tiny, 1 pair, 1 round (CI runs it)
    python scripts/bench.py --transformer --gpt-steps 64 --gpt-rounds 0   # on a GPU

On a GPU ddpexp's peak_MB is CUDA's peak allocated, the twin's its process's resident memory.
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
from typing import Any

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


def ddpexp_record(args: list[str], run_dir: Path) -> tuple[dict[str, Any], float]:
    """`python -m ddpexp ARGS` run into run_dir: its metrics.json, and its start-up in seconds, from
    this script's clock before the interpreter starts (DDPEXP_T0: facts.command_started_at) to the
    first step."""
    cmd = [sys.executable, "-m", "ddpexp", *args, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "DDPEXP_T0": str(time.time())}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"ddpexp failed:\n{proc.stderr[-2000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    facts = m["facts"]
    first_step_at = facts["job_started_at"] + m.get("time_to_first_step_s", float("nan"))
    return m, first_step_at - facts["command_started_at"]


def run_ddpexp(
    model: str, strategy: str, world: int, n: int, loader: str, work: Path, tag: str, epochs: int
) -> dict[str, float]:
    args = [
        f"strategy={strategy}", *MODELS[model][0], "data=synthetic",
        f"data.num_train={n}", "data.num_eval=256", f"trainer.epochs={epochs}", "trainer.batch_size=64",
        f"loader.mode={loader}", "trainer.progress=false", "checkpoint.every_epochs=null",
        *([f"dist.nprocs={world}"] if strategy != "single" else []),
    ]  # fmt: skip
    m, startup_s = ddpexp_record(args, work / tag)
    history = m["history"]
    last = history[-1]
    return {
        "samples_per_s": statistics.median(h["perf/samples_per_s"] for h in history[1:] or history),
        "startup_s": startup_s,
        "data_wait": last.get("perf/data_wait_frac", 0.0),
        "comm_share": last.get("comm/share", 0.0),
        "peak_mb": last.get("mem/peak_mb", float("nan")),
    }


def run_script(name: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one of the scripts beside this one; its last stdout line is its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(HERE / name), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
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
    # Each repeat's ratio on the same data path (its contenders ran one after another): the spread.
    for name, ours_, theirs in (
        ("loader", "ddpexp:dataloader", "plain:dataloader"),
        ("index", "ddpexp:device", "plain:index"),
    ):
        ratios = [
            a["samples_per_s"] / b["samples_per_s"]
            for a, b in zip(runs.get(ours_, []), runs.get(theirs, []), strict=False)
        ]
        for stat, f in (("median", statistics.median), ("min", min), ("max", max)):
            med[f"pairs_{name}/{stat}"] = f(ratios) if ratios else nan
    return med


# ------------------------------------------------------------------------------ --transformer

GPT_BATCH = 16  # global batch, in windows of block_size tokens (8 a rank at 2 ranks)
GPT_STRATEGIES = ("single", "ddp", "fsdp")
# ddpexp makes its OpenMP threads sleep between parallel regions (ddpexp/host.py); the twins' do too.
QUIET_WAITS = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def gpt_block_size(model: str) -> int:
    """The size's context length (conf/model/<model>.yaml, else conf/model/gpt.yaml's)."""
    import yaml

    conf = HERE.parent / "conf" / "model"
    for name in (model, "gpt"):
        block = yaml.safe_load((conf / f"{name}.yaml").read_text()).get("block_size")
        if block is not None:
            return int(block)
    raise SystemExit(f"{model}: no block_size")


def run_ddpexp_gpt(
    model: str, strategy: str, *, train_tokens: int, eval_tokens: int, epochs: int, run_dir: Path
) -> dict:
    args = [
        f"strategy={strategy}", f"model={model}", "data=synthetic_tokens",
        "task=lm", "optim=adamw", f"data.train_tokens={train_tokens}", f"data.eval_tokens={eval_tokens}",
        f"trainer.batch_size={GPT_BATCH}", f"trainer.epochs={epochs}", f"trainer.eval_every_epochs={epochs}",
        "trainer.progress=false", "checkpoint.every_epochs=null",
    ]  # fmt: skip
    m, startup_s = ddpexp_record(args, run_dir)
    history = m["history"]
    return {
        "tokens_per_s": statistics.median(h["perf/tokens_per_s"] for h in history[1:] or history),
        "startup_s": startup_s,
        "peak_mb": history[-1].get("mem/peak_mb", float("nan")),
        "epoch_losses": [h["train/epoch_loss"] for h in history],
    }


def run_twin_gpt(model: str, strategy: str, *, train_tokens: int, eval_tokens: int, epochs: int) -> dict:
    args = [f"--model={model}", f"--strategy={strategy}", f"--batch-size={GPT_BATCH}"]
    args += [f"--train-tokens={train_tokens}", f"--eval-tokens={eval_tokens}", f"--epochs={epochs}"]
    return run_script("plain_gpt.py", args, env=QUIET_WAITS)


def measure_gpt(
    model: str, strategies: list[str], *, steps: int, repeats: int, epochs: int, work: Path
) -> dict[str, dict[str, float]]:
    """Per strategy: pairs of runs, ddpexp and twin, in ABBA order, the strategies in turn in a repeat."""
    block = gpt_block_size(model)
    sizes = {"train_tokens": GPT_BATCH * block * steps + 1, "eval_tokens": GPT_BATCH * block + 1}
    runs: dict[str, dict[str, list]] = {s: {"ddpexp": [], "twin": [], "load": []} for s in strategies}
    for i in range(repeats):
        for strategy in strategies:
            order = ("ddpexp", "twin") if i % 2 == 0 else ("twin", "ddpexp")
            for who in order:
                runs[strategy]["load"].append(os.getloadavg()[0])
                if who == "ddpexp":
                    run_dir = work / f"gpt-{strategy}-{i}"
                    result = run_ddpexp_gpt(model, strategy, epochs=epochs, run_dir=run_dir, **sizes)
                else:
                    result = run_twin_gpt(model, strategy, epochs=epochs, **sizes)
                runs[strategy][who].append(result)
    return {strategy: gpt_summary(r) for strategy, r in runs.items()}


def gpt_summary(runs: dict[str, list]) -> dict[str, float]:
    ours, twin = runs["ddpexp"], runs["twin"]
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, twin, strict=True)]
    gaps = [
        abs(a - b) / abs(b)
        for x, y in zip(ours, twin, strict=True)
        for a, b in zip(x["epoch_losses"], y["epoch_losses"], strict=True)
    ]
    return {
        "ddpexp": statistics.median(r["tokens_per_s"] for r in ours),
        "twin": statistics.median(r["tokens_per_s"] for r in twin),
        "ratio": statistics.median(pairs),
        "ratio_min": min(pairs),
        "ratio_max": max(pairs),
        "start_s": statistics.median(r["startup_s"] for r in ours),
        "peak_mb": statistics.median(r["peak_mb"] for r in ours),
        "twin_mb": statistics.median(r["peak_mb"] for r in twin),
        "loss_gap": max(gaps),
        "load_min": min(runs["load"]),
        "load_max": max(runs["load"]),
    }


GPT_COLUMNS = [  # (header, width, format, value)
    ("ddpexp", 9, ",.0f", lambda m: m["ddpexp"]),
    ("twin", 9, ",.0f", lambda m: m["twin"]),
    ("ddpexp/twin", 11, ".3f", lambda m: m["ratio"]),
    ("pair_min", 8, ".3f", lambda m: m["ratio_min"]),
    ("pair_max", 8, ".3f", lambda m: m["ratio_max"]),
    ("start_s", 7, ".1f", lambda m: m["start_s"]),
    ("peak_MB", 8, ",.0f", lambda m: m["peak_mb"]),
    ("twin_MB", 8, ",.0f", lambda m: m["twin_mb"]),
    ("loss_gap", 8, ".1e", lambda m: m["loss_gap"]),
    ("load", 9, "", lambda m: f"{m['load_min']:.1f}-{m['load_max']:.1f}"),
]


def gpt_main(args: argparse.Namespace) -> None:
    model = "gpt_tiny" if args.smoke else args.gpt_model
    repeats = 1 if args.smoke else args.repeats or 7
    epochs = 2 if args.smoke else args.epochs or 4
    steps = 2 if args.smoke else args.gpt_steps
    strategies = (args.strategies or ",".join(GPT_STRATEGIES)).split(",")
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        results = measure_gpt(model, strategies, steps=steps, repeats=repeats, epochs=epochs, work=Path(tmp))
    block = gpt_block_size(model)
    print(f"tokens/s, {model}: global batch {GPT_BATCH} x {block} tokens, {steps} steps an epoch, AdamW")
    head = f"{'strategy':<8} " + " ".join(f"{h:>{w}}" for h, w, _, _ in GPT_COLUMNS)
    print(head)
    for strategy, m in results.items():
        print(f"{strategy:<8} " + " ".join(f"{value(m):>{w}{fmt}}" for _, w, fmt, value in GPT_COLUMNS))
    print(
        f"(median of {repeats} pairs of processes, each the median of its epochs 2-{epochs}; ddpexp/twin: "
        f"median of the pairs' ratios; load: 1-minute load average at each start; {os.cpu_count()} CPUs, "
        f"threads per rank = CPUs/ranks; {time.time() - started:.0f} s)"
    )
    rounds = 1 if args.smoke else args.gpt_rounds
    if rounds == 0:
        return
    print()
    print(
        f"in turn inside the same processes (scripts/gpt_overhead.py), {rounds} rounds: ddpexp / twin "
        "tokens/s = median ratio (min-max of the rounds), loss gap, load"
    )
    for strategy in strategies:
        load = os.getloadavg()[0]
        common = [f"--model={model}", f"--strategy={strategy}", f"--steps={steps}", f"--rounds={rounds}"]
        r = run_script("gpt_overhead.py", common, env=QUIET_WAITS)
        print(
            f"{strategy:<8} {r['ddpexp']:>9,.0f} / {r['twin']:>9,.0f} = {r['ratio']:.3f} "
            f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f})  loss_gap {r['loss_gap']:.1e}  "
            f"load {load:.1f}-{os.getloadavg()[0]:.1f}"
        )


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


# The like-for-like ratios repeat by repeat: median (min-max) over the repeats.
SPREAD = [
    (
        "loader/loader per repeat",
        24,
        "",
        lambda m: f"{m['pairs_loader/median']:.3f} ({m['pairs_loader/min']:.2f}-{m['pairs_loader/max']:.2f})",
    ),
    (
        "device/index per repeat",
        23,
        "",
        lambda m: f"{m['pairs_index/median']:.3f} ({m['pairs_index/min']:.2f}-{m['pairs_index/max']:.2f})",
    ),
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
    p.add_argument("--repeats", type=int, default=None, help="default: 5 (--transformer: 7)")
    p.add_argument("--epochs", type=int, default=None, help="per process, the first a warm-up: 5 (4)")
    p.add_argument("--num-train", type=int, default=None, help="default: per model (MODELS)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--strategies", default=None, help="default: single,ddp,fsdp,zero (smoke: single,ddp)")
    p.add_argument("--transformer", action="store_true", help="the GPT against its twin (docstring)")
    p.add_argument("--gpt-model", default="gpt_small", help="--transformer: the size (smoke: gpt_tiny)")
    p.add_argument("--gpt-steps", type=int, default=8, help="--transformer: optimizer steps an epoch")
    p.add_argument(
        "--gpt-rounds", type=int, default=15, help="--transformer: gpt_overhead.py rounds (0: none)"
    )
    args = p.parse_args()
    if args.transformer:
        gpt_main(args)
        return
    repeats = 1 if args.smoke else args.repeats or 5
    epochs = 2 if args.smoke else args.epochs or 5
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
    print(table("ddpexp / its hand-written twin on the same data path, repeat by repeat", SPREAD, rows))
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

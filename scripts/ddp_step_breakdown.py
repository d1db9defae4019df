"""Where a DDP step's time goes on a CPU host, added one piece at a time, for the cost model's misses.

The default ConvNet on 28x28 inputs (digits as ddpexp runs it), SGD with momentum, 1 thread per
process, synthetic batches; each variant is run --repeats times in turn, fresh processes each time:

  alone     one process, the global batch              (the single run the cost model reads)
  alone/W   one process, the per-rank batch            (does compute divide with the batch?)
  side      W processes of the per-rank batch, no communication     (sharing the host's cores)
  allreduce the same, plus one blocking all-reduce of all gradients after backward, by hand
  ddp       DistributedDataParallel (bucketed all-reduce from autograd hooks, buffers broadcast)
  lockstep  W processes that only all-reduce the same gradient buffer, call after call, as
            ddpexp.commbench times a collective                    (what the fabric's fit sees)

    python scripts/ddp_step_breakdown.py                 # W = 2, global batch 48, 3 repeats
    python scripts/ddp_step_breakdown.py --world 4 --batch 48

A step's time is the median over steps after a warm-up; with W processes, the slowest rank's (they
run in lockstep once they communicate). Prints every repeat, then the median. For the two variants
that all-reduce by hand, each rank also records when it entered and left each all-reduce (one host:
one monotonic clock for every process), which splits the all-reduce's cost in two: the arrival skew
(the last rank's entry less the first's: waiting for the slowest) and the all-reduce itself, from the
last rank's entry until every rank has left it; compared between a step with compute before it and
the lockstep loop.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ddpexp import distributed
from ddpexp.models.convnet import convnet

VARIANTS = ("alone", "alone/W", "side", "allreduce", "ddp", "lockstep")
TIMED_ALLREDUCE = ("allreduce", "lockstep")  # variants whose ranks record each all-reduce's entry and exit


def rank_main(rank: int, world: int, batch: int, variant: str, init: str, steps: int, out: Any) -> None:
    """One process of `variant`: puts (rank, its median step time in s, [(entry, exit) of each timed
    all-reduce]) on `out`. A variant that communicates joins the process group at `init` (or uses the
    one this process is already in, as a test does)."""
    torch.set_num_threads(1)
    talks = variant in (*TIMED_ALLREDUCE, "ddp") and not dist.is_initialized()
    if talks:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model: torch.nn.Module = convnet(channels=[16, 32], num_classes=10, input_shape=[1, 28, 28])
    if variant == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    if variant in TIMED_ALLREDUCE and dist.is_initialized():
        dist.barrier()  # every rank starts together: the first steps' skew is not start-up's
    times, stamps = [], []
    for step in range(steps):
        start = time.perf_counter()
        if variant != "lockstep":
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
        if variant in TIMED_ALLREDUCE:
            if variant == "allreduce":
                flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            entered = time.perf_counter()
            dist.all_reduce(flat)
            stamps.append((entered, time.perf_counter()))
        if variant != "lockstep":
            optimizer.step()
        if step >= steps // 5:  # the first fifth warms up
            times.append(time.perf_counter() - start)
    out.put((rank, statistics.median(times), stamps[steps // 5 :]))
    if talks:  # free DDP's reducer (reference cycles) and meet before tearing gloo down
        del model, optimizer
        distributed.finish()
        distributed.stop()


def arrivals(stamps: list[list[tuple[float, float]]]) -> tuple[float, float]:
    """From each rank's (entry, exit) of the same all-reduces, on one clock: the median arrival skew
    (last entry less first) and the median time of the all-reduce itself (the last rank's entry to the
    last rank's exit), in ms."""
    skews, own = [], []
    for calls in zip(*stamps, strict=True):
        entries, exits = [c[0] for c in calls], [c[1] for c in calls]
        skews.append(max(entries) - min(entries))
        own.append(max(exits) - max(entries))
    return statistics.median(skews) * 1e3, statistics.median(own) * 1e3


def measure(variant: str, world: int, global_batch: int, steps: int) -> tuple[float, float, float]:
    """The slowest rank's median step time in ms, and for TIMED_ALLREDUCE variants the all-reduce's
    median arrival skew and own time in ms (nan for the others)."""
    processes = 1 if variant.startswith("alone") else world
    batch = global_batch if variant == "alone" else global_batch // world
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [
            ctx.Process(target=rank_main, args=(r, processes, batch, variant, init, steps, out))
            for r in range(processes)
        ]
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"{variant}: a process exited with {p.exitcode}")
    step_ms = max(median for _, median, _ in results) * 1e3
    if variant not in TIMED_ALLREDUCE:
        return step_ms, math.nan, math.nan
    return (step_ms, *arrivals([stamps for _, _, stamps in results]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=48, help="global batch (a multiple of --world)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    if args.batch % args.world:
        p.error("--batch must be a multiple of --world")
    results: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            results[variant].append(measure(variant, args.world, args.batch, args.steps))
    per_rank = args.batch // args.world
    print(f"W={args.world}, global batch {args.batch} ({per_rank} per rank), step ms: repeats -> median")
    for variant, rows in results.items():
        label = variant.replace("/W", f"/{args.world}")
        runs = " ".join(f"{step:6.2f}" for step, _, _ in rows)
        print(f"  {label:<10} {runs}  -> {statistics.median(step for step, _, _ in rows):6.2f}")
    print("the all-reduce of the gradients, ms (median over steps; repeats -> median): arrival skew, then")
    print("the all-reduce itself (the last rank's entry to the last exit)")
    for variant in TIMED_ALLREDUCE:
        for i, what in ((1, "skew"), (2, "itself")):
            values = [row[i] for row in results[variant]]
            runs = " ".join(f"{v:6.2f}" for v in values)
            print(f"  {variant:<10} {what:<7} {runs}  -> {statistics.median(values):6.2f}")


if __name__ == "__main__":
    main()

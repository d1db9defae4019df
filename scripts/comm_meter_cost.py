"""What ddpexp's communication meter costs per DDP step, in microseconds, against DDP's own C++ all-reduce.

Between processes, and even epoch by epoch inside two ranks, a DDP step's time moves by 10-20% on a
small shared machine, which hides a cost of 0.1 ms. Here one process (a gloo world of one, 1 thread:
the all-reduce itself is nearly free, so what remains is the hooks' own cost) runs the same small MLP
steps through five DDP wrappers in turn, round by round:

  every    ddpexp's ddp strategy, the meter timing every step (trainer.time_comm_every_steps=1)
  sampled  the same timing one step in 10 (the default)
  pyhook   plain DDP with torch's Python allreduce_hook registered: what any Python comm hook costs
  quiet    ddpexp's ddp strategy with trainer.measure_comm=false (DDP's C++ all-reduce)
  hand     plain DistributedDataParallel(model)

    python scripts/comm_meter_cost.py --rounds 15

Prints one JSON line: per variant the median over rounds of (its µs per step - hand's, same round).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpexp.config import TrainerConfig
from ddpexp.strategies.ddp import Ddp, DdpConfig

VARIANTS = ("every", "sampled", "pyhook", "quiet", "hand")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=400, help="steps per variant per round")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            print(json.dumps(measure(args.rounds, args.steps)))
        finally:
            dist.destroy_process_group()


def measure(rounds: int, steps: int) -> dict[str, Any]:
    """Median extra µs per step over plain DDP, per variant (needs a process group)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
        torch.nn.ReLU(), torch.nn.Linear(128, 10),
    )  # fmt: skip
    ctx: Any = SimpleNamespace(device=torch.device("cpu"))  # all that Ddp.wrap reads of the context
    sampled_every = TrainerConfig.time_comm_every_steps
    ours = {
        "every": (Ddp(DdpConfig()).wrap(copy.deepcopy(base), ctx=ctx, measure_comm=True), 1),
        "sampled": (Ddp(DdpConfig()).wrap(copy.deepcopy(base), ctx=ctx, measure_comm=True), sampled_every),
        "quiet": (Ddp(DdpConfig()).wrap(copy.deepcopy(base), ctx=ctx, measure_comm=False), 1),
    }
    pyhook = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    pyhook.register_comm_hook(None, default_hooks.allreduce_hook)
    hand = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def run(name: str) -> float:
        if name in ours:
            wrapped, every = ours[name]
            module, meter = wrapped.module, wrapped.comm
        else:
            module, meter, every = (pyhook if name == "pyhook" else hand), None, 1
        start = time.perf_counter()
        for _ in range(steps):
            if meter is not None:
                meter.begin_step(every)
            F.cross_entropy(module(x), y).backward()
            for param in module.parameters():
                param.grad = None
            if meter is not None:
                meter.end_step()
        if meter is not None:
            meter.take()
        return (time.perf_counter() - start) / steps * 1e6

    per_step: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds + 1):  # round 0 warms up and is not kept; the order rotates every round
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        results = {name: run(name) for name in order}
        if r:
            for name, us in results.items():
                per_step[name].append(us)
    out: dict[str, Any] = {"hand_us_per_step": statistics.median(per_step["hand"])}
    for name in VARIANTS[:-1]:
        extra = [a - b for a, b in zip(per_step[name], per_step["hand"], strict=True)]
        out[f"{name}_extra_us"] = statistics.median(extra)
    out["time_comm_every_steps"] = sampled_every
    out["rounds"] = rounds
    return out


if __name__ == "__main__":
    main()

"""ddpexp's training loop against a hand-written one, in one process, epoch by epoch in turn.

Process start-up and machine drift dominate run-to-run noise on a small shared machine (±15% on the
2-core development VM), which hides a 2% overhead. Here both loops train their own copy of the same
model on the same device-resident batches (ddpexp's TensorLoader), alternating epochs, so both see
the same machine state; the median of the per-round ratios is the framework's loop overhead:

  ddpexp   Engine.train_epoch with a real rank-0 Recorder (TensorBoard scalars every 50 steps, the default)
  hand     for x, y in loader: loss = F.cross_entropy(model(x), y); zero_grad; backward; step
  bare     the hand loop on one batch re-used, no data handling at all: the ceiling; hand / bare is
           what reading each epoch's fresh batches costs, whoever writes the loop
  loader   the hand loop over the tutorials' DataLoader + DistributedSampler (shuffle, set_epoch):
           ddpexp / loader is what device-resident batching gains over it
  ddpexp_loader  ddpexp's Engine over its own DataLoader path (loader.mode=dataloader):
           ddpexp_loader / loader is the framework's overhead on that path

    python scripts/loop_overhead.py --model mlp64 --rounds 9

Prints one JSON line: median samples/s of each, and the median per-round ratios ddpexp / hand (with
its range), ddpexp / bare, hand / bare, ddpexp / loader and ddpexp_loader / loader.

With --world N (gloo on CPU, N processes, threads per process = cores / N, the global batch split
among them) the same comparison for DDP, inside the ranks, every rank running the same loop at the
same time:

  ddpexp        Engine.train_epoch on ddpexp's ddp strategy as a run wraps it: its comm meter on
                (trainer.measure_comm), bytes counted every step, time on one step in
                trainer.time_comm_every_steps (the defaults)
  ddpexp_every  the same, timing every step (trainer.time_comm_every_steps=1)
  ddpexp_quiet  the same with trainer.measure_comm=false (DDP's own all-reduce, nothing measured)
  hand          DistributedDataParallel(model) and the hand loop, on the same per-rank batches

    python scripts/loop_overhead.py --model convnet --world 2 --batch-size 128 --rounds 9
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from plain_loop import make_model  # the models the plain loop trains (scripts/ is on sys.path)
from torch.utils.data import DataLoader, DistributedSampler

from ddpexp import distributed
from ddpexp.config import TrainerConfig
from ddpexp.context import intra_op_threads
from ddpexp.data import loaders
from ddpexp.data.loaders import Batch
from ddpexp.data.synthetic import synthetic
from ddpexp.engine import Engine, LoopSettings
from ddpexp.recorder import NullRecorder, Recorder
from ddpexp.strategies import Wrapped
from ddpexp.strategies.ddp import Ddp, DdpConfig

HIDDEN = {"mlp": None, "mlp64": [64]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mlp64", choices=[*HIDDEN, "convnet"])
    p.add_argument("--num-train", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--world", type=int, default=1, help="DDP ranks (gloo); 1: the one-process loops")
    args = p.parse_args()
    if args.world > 1:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_ddp_rank, args=(args, tmp), nprocs=args.world, start_method="spawn")
            print(Path(tmp, "result.json").read_text())
        return
    splits, train, evals, ours = setup(args, rank=0, world=1)
    hand, bare, tut, ours_dl = (copy.deepcopy(ours) for _ in range(4))
    opt_ours, opt_hand, opt_bare, opt_tut, opt_ours_dl = (
        torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ours, hand, bare, tut, ours_dl)
    )
    kw = dict(batch_size=args.batch_size, rank=0, world=1, seed=0, device=torch.device("cpu"))
    train_dl = loaders.build(splits.train, mode="dataloader", train=True, **kw)
    sampler = DistributedSampler(splits.train.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    tutorial = DataLoader(splits.train.dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    settings = LoopSettings(
        epochs=1, max_steps=None, log_every_steps=50, eval_every_epochs=1, global_batch=args.batch_size
    )
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(Path(tmp), facts={}, progress=False)

        def run_ddpexp(epoch: int) -> float:
            plain = Wrapped(module=ours, base=ours)
            return engine_epoch(plain, opt_ours, train, evals, recorder, settings, epoch)

        def run_ddpexp_loader(epoch: int) -> float:
            plain = Wrapped(module=ours_dl, base=ours_dl)
            return engine_epoch(plain, opt_ours_dl, train_dl, evals, recorder, settings, epoch)

        def timed(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Batch]) -> float:
            return hand_epoch(model, opt, batches, args.batch_size)

        def run_hand(epoch: int) -> float:
            train.set_epoch(epoch)
            return timed(hand, opt_hand, train)

        def run_bare(epoch: int) -> float:
            train.set_epoch(epoch)
            fixed = tuple(t.clone() for t in next(iter(train)))
            return timed(bare, opt_bare, (fixed for _ in range(len(train))))

        def run_loader(epoch: int) -> float:
            sampler.set_epoch(epoch)
            return timed(tut, opt_tut, tutorial)

        loops = {
            "ddpexp": run_ddpexp,
            "hand": run_hand,
            "bare": run_bare,
            "loader": run_loader,
            "ddpexp_loader": run_ddpexp_loader,
        }
        speeds = rounds_in_turn(loops, args.rounds)
        recorder.close("completed")

    overhead = per_round(speeds, "ddpexp", "hand")
    out = {"model": args.model, **{name: statistics.median(v) for name, v in speeds.items()}}
    out |= {"ratio": statistics.median(overhead), "ratio_min": min(overhead), "ratio_max": max(overhead)}
    out |= {"ddpexp_vs_bare": statistics.median(per_round(speeds, "ddpexp", "bare"))}
    out |= {"hand_vs_bare": statistics.median(per_round(speeds, "hand", "bare"))}
    out |= {"ddpexp_vs_loader": statistics.median(per_round(speeds, "ddpexp", "loader"))}
    out |= {"ddpexp_loader_vs_loader": statistics.median(per_round(speeds, "ddpexp_loader", "loader"))}
    out["rounds"] = args.rounds
    print(json.dumps(out))


def setup(args: argparse.Namespace, *, rank: int, world: int) -> tuple[Any, Any, Any, torch.nn.Module]:
    """(the data, this rank's device-resident training and eval batches of global batch / world, the
    model with seed-0 weights): the same for every loop compared."""
    splits = synthetic(num_train=args.num_train, num_eval=64).load(Path("."))
    kw = dict(batch_size=args.batch_size // world, rank=rank, world=world, seed=0, device=torch.device("cpu"))
    train = loaders.build(splits.train, mode="device", train=True, **kw)
    evals = loaders.build(splits.eval, mode="device", train=False, **kw)
    torch.manual_seed(0)
    model = make_model("mlp" if args.model in HIDDEN else args.model, HIDDEN.get(args.model))
    return splits, train, evals, model


def per_round(speeds: dict[str, list[float]], a: str, b: str) -> list[float]:
    """Loop a's speed over loop b's, round by round (both ran in the same round)."""
    return [x / y for x, y in zip(speeds[a], speeds[b], strict=True)]


def hand_epoch(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Batch], global_batch: int
) -> float:
    """The hand-written loop: samples/s of one pass over `batches`."""
    start, steps = time.perf_counter(), 0
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    return steps * global_batch / (time.perf_counter() - start)


def engine_epoch(
    model: Wrapped,
    opt: torch.optim.Optimizer,
    train: Any,
    evals: Any,
    recorder: Any,
    settings: LoopSettings,
    epoch: int,
) -> float:
    """ddpexp's loop: samples/s of one epoch of a fresh Engine (its position is one epoch's)."""
    engine = Engine(
        model=model,
        optimizer=opt,
        train_loader=train,
        eval_loader=evals,
        recorder=recorder,
        settings=settings,
        device=torch.device("cpu"),
    )
    return engine.train_epoch(epoch)["perf/samples_per_s"]


def rounds_in_turn(loops: dict[str, Callable[[int], float]], rounds: int) -> dict[str, list[float]]:
    """Each loop once per round, the order rotated every round (so none always inherits another's
    cache state); round 0 warms them all up and is not kept."""
    names = list(loops)
    speeds: dict[str, list[float]] = {name: [] for name in loops}
    for epoch in range(rounds + 1):
        order = names[epoch % len(names) :] + names[: epoch % len(names)]
        results = {name: loops[name](epoch) for name in order}
        if epoch > 0:
            for name, speed in results.items():
                speeds[name].append(speed)
    return speeds


def _ddp_rank(rank: int, args: argparse.Namespace, tmp: str) -> None:
    """One rank of --world: ddpexp's Engine on its ddp strategy (meter on and off) against DDP + the
    hand loop, every rank running the same loop in the same round."""
    torch.set_num_threads(intra_op_threads(None, args.world, os.environ))  # ddpexp's default rule
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=args.world)
    _ddp_rounds(rank, args, tmp)
    # ddpexp's own teardown: free the DDP modules (their reducers sit in reference cycles holding the
    # process group) and meet before tearing gloo down; otherwise a rank now and then aborts at exit
    # ("terminate called without an active exception").
    distributed.finish()
    distributed.stop()


def _ddp_rounds(rank: int, args: argparse.Namespace, tmp: str) -> None:
    world = args.world
    _, train, evals, base = setup(args, rank=rank, world=world)
    ctx: Any = SimpleNamespace(device=torch.device("cpu"))  # all that Ddp.wrap reads of the context
    variants = {  # name: (measure_comm, time_comm_every_steps)
        "ddpexp": (True, TrainerConfig.time_comm_every_steps),
        "ddpexp_every": (True, 1),
        "ddpexp_quiet": (False, 1),
    }
    wrapped = {
        name: Ddp(DdpConfig()).wrap(copy.deepcopy(base), ctx=ctx, measure_comm=measure)
        for name, (measure, _) in variants.items()
    }
    hand = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    settings = {
        name: LoopSettings(
            epochs=1,
            max_steps=None,
            log_every_steps=50,
            eval_every_epochs=1,
            global_batch=args.batch_size,
            devices=world,
            time_comm_every_steps=every,
        )
        for name, (_, every) in variants.items()
    }
    recorder = Recorder(Path(tmp, "run"), facts={}, progress=False) if rank == 0 else NullRecorder()
    optimizers = {
        name: torch.optim.SGD(w.module.parameters(), lr=0.01, momentum=0.9) for name, w in wrapped.items()
    }
    opt_hand = torch.optim.SGD(hand.parameters(), lr=0.01, momentum=0.9)

    def run_hand(epoch: int) -> float:
        train.set_epoch(epoch)
        return hand_epoch(hand, opt_hand, train, args.batch_size)

    def engine_loop(name: str) -> Callable[[int], float]:
        return lambda epoch: engine_epoch(
            wrapped[name], optimizers[name], train, evals, recorder, settings[name], epoch
        )

    loops = {name: engine_loop(name) for name in variants} | {"hand": run_hand}
    speeds = rounds_in_turn(loops, args.rounds)
    recorder.close("completed")
    if rank == 0:
        out: dict[str, Any] = {"model": args.model, "world": world, "global_batch": args.batch_size}
        out |= {name: statistics.median(v) for name, v in speeds.items()}
        for name in variants:
            r = per_round(speeds, name, "hand")
            out |= {f"{name}_vs_hand": statistics.median(r), f"{name}_vs_hand_range": [min(r), max(r)]}
        out["rounds"] = args.rounds
        Path(tmp, "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()

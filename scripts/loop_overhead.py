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

    python scripts/loop_overhead.py --model mlp64 --rounds 9

Prints one JSON line: median samples/s of each, and the median per-round ratios ddpexp / hand (with
its range), ddpexp / bare, hand / bare and ddpexp / loader.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from plain_loop import make_model  # the models the plain loop trains (scripts/ is on sys.path)
from torch.utils.data import DataLoader, DistributedSampler

from ddpexp.data import loaders
from ddpexp.data.loaders import Batch
from ddpexp.data.synthetic import synthetic
from ddpexp.engine import Engine, LoopSettings
from ddpexp.recorder import Recorder
from ddpexp.strategies import Wrapped

HIDDEN = {"mlp": None, "mlp64": [64]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mlp64", choices=[*HIDDEN, "convnet"])
    p.add_argument("--num-train", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    device = torch.device("cpu")
    splits = synthetic(num_train=args.num_train, num_eval=64).load(Path("."))
    kw = dict(batch_size=args.batch_size, rank=0, world=1, seed=0, device=device)
    train = loaders.build(splits.train, mode="device", train=True, **kw)
    evals = loaders.build(splits.eval, mode="device", train=False, **kw)
    torch.manual_seed(0)
    ours = make_model("mlp" if args.model in HIDDEN else args.model, HIDDEN.get(args.model))
    hand, bare, tut = copy.deepcopy(ours), copy.deepcopy(ours), copy.deepcopy(ours)
    opt_ours, opt_hand, opt_bare, opt_tut = (
        torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ours, hand, bare, tut)
    )
    sampler = DistributedSampler(splits.train.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    tutorial = DataLoader(splits.train.dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    settings = LoopSettings(
        epochs=1, max_steps=None, log_every_steps=50, eval_every_epochs=1, global_batch=args.batch_size
    )
    speeds: dict[str, list[float]] = {"ddpexp": [], "hand": [], "bare": [], "loader": []}
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(Path(tmp), facts={}, progress=False)

        def run_ddpexp(epoch: int) -> float:
            engine = Engine(
                model=Wrapped(module=ours, base=ours),
                optimizer=opt_ours,
                train_loader=train,
                eval_loader=evals,
                recorder=recorder,
                settings=settings,
                device=device,
            )
            return engine.train_epoch(epoch)["perf/samples_per_s"]

        def timed(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Batch]) -> float:
            """The hand-written loop: samples/s of one pass over `batches`."""
            start, steps = time.perf_counter(), 0
            for x, y in batches:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps += 1
            return steps * args.batch_size / (time.perf_counter() - start)

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

        loops = {"ddpexp": run_ddpexp, "hand": run_hand, "bare": run_bare, "loader": run_loader}
        names = list(loops)
        for epoch in range(args.rounds + 1):  # round 0 warms all up and is not counted
            # Rotate which loop goes first, so none always inherits another's cache state.
            order = names[epoch % len(names) :] + names[: epoch % len(names)]
            results = {name: loops[name](epoch) for name in order}
            if epoch > 0:
                for name, speed in results.items():
                    speeds[name].append(speed)
        recorder.close("completed")

    def ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(speeds[a], speeds[b], strict=True)]

    overhead = ratios("ddpexp", "hand")
    out = {"model": args.model, **{name: statistics.median(v) for name, v in speeds.items()}}
    out |= {"ratio": statistics.median(overhead), "ratio_min": min(overhead), "ratio_max": max(overhead)}
    out |= {"ddpexp_vs_bare": statistics.median(ratios("ddpexp", "bare"))}
    out |= {"hand_vs_bare": statistics.median(ratios("hand", "bare"))}
    out |= {"ddpexp_vs_loader": statistics.median(ratios("ddpexp", "loader")), "rounds": args.rounds}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""ddpexp's training loop against a hand-written one, in one process, epoch by epoch in turn.

Process start-up and machine drift dominate run-to-run noise on a small shared machine (±15% on the
2-core development VM), which hides a 2% overhead. Here both loops train their own copy of the same
model on the same device-resident batches (ddpexp's TensorLoader), alternating epochs, so both see
the same machine state; the median of the per-round ratios is the framework's loop overhead:

  ddpexp   Engine.train_epoch with a real rank-0 Recorder (TensorBoard scalars every 50 steps, the default)
  hand     for x, y in loader: loss = F.cross_entropy(model(x), y); zero_grad; backward; step

    python scripts/loop_overhead.py --model mlp64 --rounds 9

Prints one JSON line: median samples/s of each and the median ratio with its range.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from plain_loop import make_model  # the models the plain loop trains (scripts/ is on sys.path)

from ddpexp.data import loaders
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
    hand = copy.deepcopy(ours)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.01, momentum=0.9)
    opt_hand = torch.optim.SGD(hand.parameters(), lr=0.01, momentum=0.9)
    settings = LoopSettings(
        epochs=1, max_steps=None, log_every_steps=50, eval_every_epochs=1, global_batch=args.batch_size
    )
    speeds: dict[str, list[float]] = {"ddpexp": [], "hand": []}
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

        def run_hand(epoch: int) -> float:
            train.set_epoch(epoch)
            start, steps = time.perf_counter(), 0
            for x, y in train:
                loss = F.cross_entropy(hand(x), y)
                opt_hand.zero_grad()
                loss.backward()
                opt_hand.step()
                steps += 1
            return steps * args.batch_size / (time.perf_counter() - start)

        for epoch in range(args.rounds + 1):  # round 0 warms both up and is not counted
            # Alternate which loop goes first, so neither always inherits the other's cache state.
            order = (run_ddpexp, run_hand) if epoch % 2 else (run_hand, run_ddpexp)
            results = {fn.__name__: fn(epoch) for fn in order}
            if epoch > 0:
                speeds["ddpexp"].append(results["run_ddpexp"])
                speeds["hand"].append(results["run_hand"])
        recorder.close("completed")
    ratios = [a / b for a, b in zip(speeds["ddpexp"], speeds["hand"], strict=True)]
    print(
        json.dumps(
            {
                "model": args.model,
                "ddpexp": statistics.median(speeds["ddpexp"]),
                "hand": statistics.median(speeds["hand"]),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "rounds": args.rounds,
            }
        )
    )


if __name__ == "__main__":
    main()

"""ddpexp's loop on the GPT against its hand-written twin's, inside the same processes, epochs in turn.

Between processes (bench.py --transformer) a ratio moves by tens of percent on a busy shared machine,
which hides a 2% overhead. Here both contenders train their own copy of the same GPT (the same seed-0
weights) on the same tokens, one epoch each in turn, inside the same process (single) or the same two
gloo ranks (ddp, fsdp), so both see the same machine state; the median of the per-round ratios is
ddpexp's overhead:

  ddpexp   Engine.train_epoch on ddpexp's strategy as a run wraps it (ddp and fsdp with the comm meter
           on, as by default), its device-resident loader over data=synthetic_tokens' windows, AdamW as
           optim=adamw builds it, a real TensorBoard Recorder on rank 0
  twin     scripts/plain_gpt.py's epoch: the model wrapped as PyTorch's examples wrap it (DDP; FSDP2
           fully_shard per block, then the root), its own batches, torch's AdamW
  ddpexp_quiet  (--quiet) ddpexp with trainer.measure_comm=false: what its communication meter costs

Each round runs each once, the order rotated every round; round 0 warms them up and is not kept.
Threads per process: ddpexp's rule (cores / processes) for all.

    python scripts/gpt_overhead.py --strategy fsdp --rounds 15

Prints one JSON line: the median tokens/s of each, the median of the per-round ratios ddpexp / twin
with their min-max (ratio; ddpexp_quiet_ratio), and the largest relative difference between two
contenders' training losses of one round (all train the same model on the same batches, so ~0: a
check that the speeds compare like for like).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from plain_gpt import make_model, make_tokens, model_settings, train_epoch, wrap  # scripts/ is on sys.path
from torch.utils.data import DistributedSampler

from ddpexp import distributed, optim, strategies
from ddpexp.config import OptimConfig, OptimizerName, TrainerConfig
from ddpexp.context import intra_op_threads
from ddpexp.data import loaders
from ddpexp.data.tokens import synthetic_tokens
from ddpexp.engine import Engine, LoopSettings, Position
from ddpexp.recorder import NullRecorder, Recorder
from ddpexp.tasks import LanguageModel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt_small", help="a conf/model/gpt*.yaml size")
    p.add_argument("--strategy", default="single", choices=["single", "ddp", "fsdp"])
    p.add_argument("--batch-size", type=int, default=16, help="global, in windows of block_size tokens")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps an epoch")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--quiet", action="store_true", help="also ddpexp with trainer.measure_comm=false")
    args = p.parse_args()
    world = 1 if args.strategy == "single" else 2
    with tempfile.TemporaryDirectory() as tmp:
        if world == 1:
            compare(0, world, args, tmp)
        else:
            mp.start_processes(compare, args=(world, args, tmp), nprocs=world, start_method="spawn")
        print(Path(tmp, "result.json").read_text())


def compare(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(intra_op_threads(None, world, os.environ))  # ddpexp's default rule
    block = model_settings(args.model)["block_size"]
    sizes = {"train_tokens": args.batch_size * block * args.steps + 1}
    sizes["eval_tokens"] = args.batch_size * block + 1
    torch.manual_seed(0)
    base = make_model(args.model)
    recorders, loops = [], {}
    for name, measure in [("ddpexp", True), *([("ddpexp_quiet", False)] if args.quiet else [])]:
        model = copy.deepcopy(base)
        recorder, loops[name] = ddpexp_loop(
            model, args, rank=rank, world=world, tmp=tmp, sizes=sizes, measure=measure
        )
        recorders.append(recorder)
    twin = wrap(copy.deepcopy(base), args.strategy, rank=rank, cuda=False)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    data = make_tokens(sizes["train_tokens"], sizes["eval_tokens"], block)
    sampler = DistributedSampler(range(len(data[0])), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loops["twin"] = lambda e: train_epoch(twin, twin_opt, data, sampler, epoch=e, batch_size=args.batch_size)
    speeds: dict[str, list[float]] = {name: [] for name in loops}
    gaps = []
    names = list(loops)
    for r in range(args.rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]  # none always follows the same one
        results = {name: loops[name](r) for name in order}
        if r > 0:  # round 0 warms every contender up
            for name, (speed, _) in results.items():
                speeds[name].append(speed)
        twin_loss = results["twin"][1]
        gaps += [abs(loss - twin_loss) / abs(twin_loss) for _, loss in results.values()]
    for recorder in recorders:
        recorder.close("completed")
    if rank == 0:
        out: dict[str, Any] = {"model": args.model, "strategy": args.strategy, "world": world}
        out |= {name: statistics.median(v) for name, v in speeds.items()}
        for name in loops:
            if name != "twin":
                r = [a / b for a, b in zip(speeds[name], speeds["twin"], strict=True)]
                key = "ratio" if name == "ddpexp" else f"{name}_ratio"
                out |= {key: statistics.median(r), f"{key}_min": min(r), f"{key}_max": max(r)}
        out |= {"loss_gap": max(gaps), "rounds": args.rounds}
        Path(tmp, "result.json").write_text(json.dumps(out))
    if world > 1:
        distributed.finish()  # ddpexp's teardown: DDP's reducers freed, every rank met, then the group
        distributed.stop()


def ddpexp_loop(
    model: torch.nn.Module,
    args: argparse.Namespace,
    *,
    rank: int,
    world: int,
    tmp: str,
    sizes: dict,
    measure: bool,
) -> tuple[NullRecorder, Any]:
    """(rank 0's Recorder, a function running epoch e of ddpexp's Engine: (tokens/s, epoch loss)). One
    Engine for every epoch, as in a run: what it does once (measuring resident memory on its first
    step) falls in the warm-up round."""
    device = torch.device("cpu")
    block = model_settings(args.model)["block_size"]
    splits = synthetic_tokens(block_size=block, **sizes).load(Path(tmp))
    kw = dict(batch_size=args.batch_size // world, rank=rank, world=world, seed=0, device=device)
    train = loaders.build(splits.train, mode="device", train=True, **kw)
    evals = loaders.build(splits.eval, mode="device", train=False, **kw)
    strategy = strategies.resolve({"name": args.strategy})
    # All that the strategies' wrap reads of the context: the device, and the training's precision.
    ctx: Any = argparse.Namespace(device=device, plan=argparse.Namespace(precision="fp32"))
    wrapped = strategy.wrap(model, ctx=ctx, measure_comm=measure)
    adamw = OmegaConf.merge(OmegaConf.structured(OptimConfig), {"name": OptimizerName.adamw, "lr": 1e-3})
    adamw.weight_decay = 0.01  # conf/optim/adamw.yaml
    opt = strategy.build_optimizer(wrapped, optim.spec(adamw))
    settings = LoopSettings(
        epochs=1,
        max_steps=None,
        log_every_steps=TrainerConfig.log_every_steps,
        eval_every_epochs=1,
        global_batch=args.batch_size,
        devices=world,
        time_comm_every_steps=TrainerConfig.time_comm_every_steps,
        tokens_per_sample=block,
    )
    recorder = (
        Recorder(Path(tmp, f"run-{measure}"), facts={}, progress=False) if rank == 0 else NullRecorder()
    )
    engine = Engine(
        model=wrapped,
        optimizer=opt,
        train_loader=train,
        eval_loader=evals,
        recorder=recorder,
        settings=settings,
        device=device,
        task=LanguageModel(),
    )

    def epoch(e: int) -> tuple[float, float]:
        engine.pos = Position(epoch=e, step=engine.step)  # as Engine.fit moves on to the next epoch
        values = engine.train_epoch(e)
        return values["perf/tokens_per_s"], values["train/epoch_loss"]

    return recorder, epoch


if __name__ == "__main__":
    main()

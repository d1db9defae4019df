"""The baseline ddpexp is measured against: training written by hand the way the tutorials write it.

DataLoader + DistributedSampler (set_epoch every epoch), DistributedDataParallel, SGD; the same model
classes and the same synthetic data as ddpexp's `data=synthetic`. With --world > 1, --strategy picks
how the loop is made distributed, each written the way PyTorch's own examples write it:

    --strategy ddp    DistributedDataParallel (default)
    --strategy fsdp   FSDP2: fully_shard on each block (the model's stages, as ddpexp shards them), then
                      on the whole model; the optimizer on the sharded parameters
    --strategy zero   DistributedDataParallel + ZeroRedundancyOptimizer(optimizer_class=SGD)

Other data paths, same loop:

    --loader dataloader   the tutorials' DataLoader + DistributedSampler (default)
    --loader index        hand-written device-resident batching: index the data tensor with each
                          rank's share of a per-epoch permutation (what ddpexp's loader.mode=device does)
    --loader bare         one batch re-used, already on the device: no data handling at all (the ceiling)

    python scripts/plain_loop.py --model mlp --world 2 --num-train 8192 --epochs 2

Prints one JSON line: samples/s (rank 0's wall clock, all ranks together; the median over the epochs
after the first, which warms up), the peak resident memory of the largest rank in MB, and the trained
model's loss on the first 256 training samples (after timing: the twins of one loop must agree on it).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g)
    teacher = torch.randn(784, 10, generator=g) / math.sqrt(784)
    return TensorDataset(x, (x.reshape(n, -1) @ teacher).argmax(1))


def make_model(name: str, hidden: list[int] | None) -> torch.nn.Module:
    if name == "mlp":
        from ddpexp.models.mlp import mlp

        return mlp(num_classes=10, input_shape=[1, 28, 28], hidden=hidden)
    from ddpexp.models.convnet import convnet

    return convnet(num_classes=10, input_shape=[1, 28, 28])


def wrap(model: torch.nn.Module, strategy: str, *, rank: int, cuda: bool) -> torch.nn.Module:
    """The model made distributed as PyTorch's examples do it (DDP tutorial, FSDP2 example)."""
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.stages():  # type: ignore[operator]  # mlp: body, head; convnet: 2 layers, head
            fully_shard(block)
        fully_shard(model)
        return model
    return DistributedDataParallel(model, device_ids=[rank] if cuda else None)  # ddp, zero


def make_optimizer(model: torch.nn.Module, strategy: str) -> torch.optim.Optimizer:
    if strategy == "zero":  # ZeroRedundancyOptimizer's example: the optimizer class and its arguments
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=0.01, momentum=0.9
        )
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def train(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    world = args.world
    cuda = torch.cuda.is_available()  # like ddpexp's device=auto: one GPU per rank, NCCL
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    # ddpexp's default rule (trainer.threads=null): the host's cores shared out among the ranks.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.manual_seed(0)
    model = make_model(args.model, args.hidden).to(device)
    if world > 1:
        model = wrap(model, args.strategy, rank=rank, cuda=cuda)
    opt = make_optimizer(model, args.strategy if world > 1 else "ddp")
    data = make_data(args.num_train)
    per_rank = args.batch_size // world
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=per_rank, sampler=sampler, drop_last=True, pin_memory=cuda)
    fixed = tuple(t.to(device) for t in next(iter(loader)))
    x_all, y_all = (t.to(device) for t in data.tensors)
    speeds = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if world > 1:
            dist.barrier()
        start, steps = time.perf_counter(), 0
        if args.loader == "bare":
            batches = (fixed for _ in range(len(loader)))
        elif args.loader == "index":
            perm = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(epoch))[rank::world]
            perm = perm.to(device)
            batches = (
                (x_all[perm[i : i + per_rank]], y_all[perm[i : i + per_rank]])
                for i in range(0, len(loader) * per_rank, per_rank)
            )
        else:
            batches = loader
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        if cuda:
            torch.cuda.synchronize(device)
        if world > 1:
            dist.barrier()
        speeds.append(steps * args.batch_size / (time.perf_counter() - start))
    with torch.no_grad():  # untimed; collective under fsdp, so every rank runs it
        final_loss = float(F.cross_entropy(model(x_all[:256]), y_all[:256]))
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        out["samples_per_s"] = statistics.median(speeds[1:] or speeds)
        out["peak_mb"] = float(peak)
        out["final_loss"] = final_loss
    if world > 1:
        # DDP's reducer sits in reference cycles that hold the process group: free it, and let every
        # rank get here, before tearing gloo down. Otherwise a rank now and then aborts at exit
        # ("terminate called without an active exception") while its peer still talks to it.
        del model, opt
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _worker(rank: int, args: argparse.Namespace, port: int, path: str) -> None:
    out: dict = {}
    train(rank, args, port, out)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp", choices=["mlp", "convnet"])
    p.add_argument("--hidden", type=lambda v: [int(h) for h in v.split(",")], default=None, help="mlp only")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "zero"], help="with --world > 1")
    p.add_argument("--num-train", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--loader", default="dataloader", choices=["dataloader", "index", "bare"])
    args = p.parse_args()
    if args.world == 1:
        out: dict = {}
        train(0, args, 0, out)
    else:
        import socket
        import tempfile

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            mp.start_processes(_worker, args=(args, port, tmp.name), nprocs=args.world, start_method="spawn")
            out = json.loads(Path(tmp.name).read_text())
    print(json.dumps(out))


if __name__ == "__main__":
    main()

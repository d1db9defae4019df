"""The transformer's hand-written twin: ddpexp's GPT trained the way PyTorch's own examples train one.

The model is ddpexp's (`ddpexp.models.gpt`, with the settings of conf/model/<--model>.yaml and the
byte vocabulary, 256), built after torch.manual_seed(0) as a ddpexp run builds it; everything else is
written here by hand, as the DDP tutorial and the FSDP2 example (pytorch/examples,
distributed/FSDP2) write it:

    --strategy single   one process, the cores' threads
    --strategy ddp      DistributedDataParallel(model)
    --strategy fsdp     FSDP2: fully_shard on each transformer block, then on the whole model (the
                        root: embeddings, final norm, head), fully_shard's defaults; the optimizer on
                        the sharded parameters

The data are ddpexp's `data=synthetic_tokens` (the same seed, so the same tokens): windows of
block_size + 1 tokens, the inputs and the targets shifted by one. Each rank visits its share of the
windows in DistributedSampler's order (set_epoch every epoch), nanoGPT-style batches cut from the
token tensor by index and widened to int64. AdamW with torch's defaults at lr 1e-3 (ddpexp's
`optim=adamw`), next-token cross-entropy, zero_grad / backward / step; the running loss is summed on
the device and read at the epoch's end.

    python scripts/plain_gpt.py --model gpt_small --strategy ddp --world 2 --batch-size 16 --epochs 3

Prints one JSON line: tokens/s (rank 0's wall clock, every rank together; the median over the epochs
after the first, which warms up), the peak resident memory of the largest rank in MB, and each
epoch's mean training loss over every rank (the twin of ddpexp's train/epoch_loss: the two agree
when both trained the same model on the same batches).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

CONF = Path(__file__).resolve().parent.parent / "conf" / "model"
VOCAB = 256  # data=synthetic_tokens' default vocabulary


def model_settings(name: str) -> dict:
    """conf/model/gpt.yaml overlaid with conf/model/<name>.yaml: the builder's keyword arguments."""
    settings = yaml.safe_load((CONF / "gpt.yaml").read_text())
    if name != "gpt":
        settings |= yaml.safe_load((CONF / f"{name}.yaml").read_text())
    return {k: v for k, v in settings.items() if k not in ("_target_", "defaults", "vocab_size")}


def make_model(name: str) -> torch.nn.Module:
    from ddpexp.models.gpt import gpt

    settings = model_settings(name)
    return gpt(vocab_size=VOCAB, input_shape=[settings["block_size"]], **settings)


def make_tokens(train_tokens: int, eval_tokens: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training windows (inputs, targets) of data=synthetic_tokens with its default seed, 0."""
    g = torch.Generator().manual_seed(0)
    both = torch.randint(VOCAB, (train_tokens + eval_tokens,), generator=g, dtype=torch.uint8)
    tokens = both[:train_tokens]
    n = (len(tokens) - 1) // block
    return tokens[: n * block].view(n, block), tokens[1 : n * block + 1].view(n, block)


def wrap(model: torch.nn.Module, strategy: str, *, rank: int, cuda: bool) -> torch.nn.Module:
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
        return model
    if strategy == "ddp":
        return DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    return model


def train_epoch(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: tuple[torch.Tensor, torch.Tensor],
    sampler: DistributedSampler,
    *,
    epoch: int,
    batch_size: int,
) -> tuple[float, float]:
    """One epoch of the hand-written loop: (tokens/s of every rank together on this rank's clock, the
    epoch's mean training loss over every rank)."""
    x_all, y_all = data
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = batch_size // world
    sampler.set_epoch(epoch)
    steps = len(sampler) // per_rank
    running = torch.zeros((), device=x_all.device)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    order = torch.tensor(list(sampler), device=x_all.device)  # timed, as a DataLoader's sampler is
    for i in range(steps):
        idx = order[i * per_rank : (i + 1) * per_rank]
        x, y = x_all[idx].long(), y_all[idx].long()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.detach()
    if world > 1:
        dist.all_reduce(running)
    loss_mean = float(running) / (steps * world)  # the epoch's one host sync
    if x_all.is_cuda:
        torch.cuda.synchronize(x_all.device)
    if world > 1:
        dist.barrier()
    return steps * batch_size * x_all.shape[1] / (time.perf_counter() - start), loss_mean


def train(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    world = args.world
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if args.strategy != "single":  # DDP and FSDP2 need a process group, also of one rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    # ddpexp's default rule (trainer.threads=null): the host's cores shared out among the ranks.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.manual_seed(0)
    model = wrap(make_model(args.model).to(device), args.strategy, rank=rank, cuda=cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    block = model_settings(args.model)["block_size"]
    x_all, y_all = make_tokens(args.train_tokens, args.eval_tokens, block)
    data = (x_all.to(device), y_all.to(device))
    sampler = DistributedSampler(range(len(x_all)), num_replicas=world, rank=rank, shuffle=True, seed=0)
    speeds, losses = [], []
    for epoch in range(args.epochs):
        speed, loss = train_epoch(model, opt, data, sampler, epoch=epoch, batch_size=args.batch_size)
        speeds.append(speed)
        losses.append(loss)
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, device=device)  # KiB
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        out |= {"tokens_per_s": statistics.median(speeds[1:] or speeds), "peak_mb": float(peak)}
        out |= {"epoch_losses": losses}
    if dist.is_initialized():
        # DDP's reducer sits in reference cycles that hold the process group: free it, and let every
        # rank get here, before tearing the group down (plain_loop.py says what happens otherwise).
        del model, opt
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _worker(rank: int, args: argparse.Namespace, port: int, path: str) -> None:
    out: dict = {}
    train(rank, args, port, out)
    if rank == 0:
        Path(path).write_text(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt_small", help="a conf/model/gpt*.yaml size")
    p.add_argument("--strategy", default="single", choices=["single", "ddp", "fsdp"])
    p.add_argument(
        "--world", type=int, default=None, help="ranks (default: 1 for single, else 1 per GPU, or 2)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="global, in samples of block_size tokens")
    p.add_argument("--train-tokens", type=int, default=262144, help="data.train_tokens")
    p.add_argument("--eval-tokens", type=int, default=32768, help="data.eval_tokens (drawn, not used)")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    # ddpexp's own default (dist.nprocs): one process per GPU, else 2 on CPUs.
    args.world = args.world or (1 if args.strategy == "single" else torch.cuda.device_count() or 2)
    if args.strategy == "single":
        out: dict = {}
        train(0, args, 0, out)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            mp.start_processes(_worker, args=(args, port, tmp.name), nprocs=args.world, start_method="spawn")
            out = json.loads(Path(tmp.name).read_text())
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Process-group set-up and the few collectives the engine needs (no-ops without a process group)."""

from __future__ import annotations

import gc
import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .context import RunContext

log = logging.getLogger(__name__)


def start(ctx: RunContext, *, url: str, timeout_s: float, store: dist.Store | None = None) -> None:
    """Join the process group. With a store (torchrun's rendezvous), the URL is not used."""
    assert ctx.plan.backend is not None
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group(
            ctx.plan.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout
        )
    else:
        dist.init_process_group(
            ctx.plan.backend, init_method=url, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout
        )
    log.debug("rank %d/%d joined via %s (%s)", ctx.rank, ctx.world_size, url, ctx.plan.backend)


def finish() -> None:
    """After a successful run: free what still holds the process group (DDP's reducer sits in
    reference cycles), then wait for every rank, so that no rank tears down its gloo/NCCL threads while
    a peer is still talking to it. Skipping this makes a rank abort at interpreter exit now and then."""
    gc.collect()
    barrier()


def _in_force() -> bool:
    """A run's process group is in force: not the fake one a memory prediction in this process left
    (predict/memory.py keeps it for the process's later predictions), which an in-process run that
    follows must neither gather over nor destroy."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


def stop() -> None:
    if _in_force():
        dist.destroy_process_group()


def active() -> bool:
    return _in_force() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (and return it); identity without a process group."""
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def wait_for(work: Any) -> None:
    """Wait for a collective started asynchronously (a Work or Future). Every such wait of ddpexp's
    goes through here: Work.wait() is C++, and a hung run's stacks show this frame where a rank waits
    for its peers (launch/blame.py), not the caller's line as if the rank were busy there."""
    work.wait()


def world_size() -> int:
    return dist.get_world_size() if _in_force() else 1


def all_reduce_max(value: float) -> float:
    """The largest `value` over ranks (CPU tensor: works with gloo and, for scalars, nccl via CPU)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def gather_objects(obj: object) -> list[object]:
    """`obj` from every rank, in rank order (just [obj] without a process group)."""
    if not active():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """`obj` from every rank, in rank order, on rank 0; None on the others ([obj] without a process
    group). Collective."""
    if not active():
        return [obj]
    rank0 = dist.get_rank() == 0
    out: list[Any] | None = [None] * dist.get_world_size() if rank0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: object) -> object:
    """Rank 0's `obj` on every rank (`obj` itself without a process group)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if active():
        dist.barrier()


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics...): without sync_bn each rank's
    drift apart, and model.pt holds rank 0's. One broadcast per device and dtype."""
    if not active():
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for buf in module.buffers():
        groups.setdefault((buf.device, buf.dtype), []).append(buf)
    for tensors in groups.values():
        flat = torch._utils._flatten_dense_tensors(tensors)
        dist.broadcast(flat, src=0)
        for buf, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors), strict=True):
            buf.copy_(synced)

"""naive_allreduce: data parallelism as the textbooks write it, without DDP. Rank 0's initial weights
are broadcast once; after every backward each gradient is averaged (sum over ranks / W), one after
the other, with nothing overlapping the backward pass (or, with strategy.bucket_cap_mb, gradients
flattened into buckets of that size: bucketing without overlap). Compare it with `ddp` to see
what bucketing and overlap buy. (Unlike DDP it does not re-broadcast buffers every step: with
sync_bn, or without BatchNorm, there is nothing that could drift.)

strategy.algorithm chooses how a bucket is summed: `collective` calls `dist.all_reduce` (the
backend's own algorithm), `ring` is the textbook ring written out with point-to-point send/recv
(`ring_sum`). Both reduce the same buckets, so they can be compared one for one.

Bytes (`comm/bytes_per_step` under trainer.measure_comm), per rank and step:
  collective  the size S of every buffer handed to all_reduce: the payload each rank contributes,
              as `ddp`'s hooks count it (the backend picks its own algorithm and wire traffic).
  ring        the bytes this rank actually sends: 2(W-1) chunks of about S/W, exactly
              2(W-1)/W x S averaged over ranks (chunks differ by at most one element). At W = 2 the
              two numbers are equal; at W = 3 the ring's is 4/3 of the collective's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import distributed
from ..errors import require_positive
from . import DataParallelConfig, Strategy, Wrapped, maybe_sync_bn, register, syncbn
from .comm import Collective, CommMeter, Workload

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext
    from ..plan import HostFacts, Plan


class Algorithm(StrEnum):
    collective = "collective"  # dist.all_reduce: the backend's own algorithm
    ring = "ring"  # ring_sum: reduce-scatter then all-gather with point-to-point send/recv


@dataclass
class NaiveAllreduceConfig(DataParallelConfig):
    # None: one reduction per parameter; a size in MB: gradients flattened into buckets of that size.
    bucket_cap_mb: float | None = None
    # How each bucket is summed: collective (dist.all_reduce) | ring (hand-written, send/recv).
    algorithm: Algorithm = Algorithm.collective


@register
class NaiveAllreduce(Strategy[NaiveAllreduceConfig]):
    name = "naive_allreduce"
    schema = NaiveAllreduceConfig

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        require_positive({}, {"strategy.bucket_cap_mb": self.settings.bucket_cap_mb})

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = maybe_sync_bn(model, self.settings.sync_bn, ctx.device.type).to(ctx.device)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
        params = [p for p in model.parameters() if p.requires_grad]
        meter = CommMeter() if measure_comm else None
        groups = buckets(params, self.settings.bucket_cap_mb)
        reduce = ring_sum if self.settings.algorithm == Algorithm.ring else collective_sum
        return Wrapped(
            module=model,
            base=model,
            sync_grads=averager(params, groups, reduce, meter, ctx.device),
            comm=meter,
        )

    def communication(self, *, job: Workload) -> list[Collective]:
        """One reduction per group of `buckets` (a parameter each, or flat buckets), one after the
        other after the backward pass: nothing hides. `collective`: an all-reduce of every group,
        counted by its size S. `ring`: `ring_sum`'s 2(W-1) send/recv exchanges per group, each rank
        sending a 1/W chunk to its neighbour while receiving one, all links busy at once: each rank
        sends 2(W-1)/W x S, which is what the meter counts and what crosses each link."""
        world = job.world
        params = [p for p in job.model.parameters() if p.requires_grad]
        groups = buckets(params, self.settings.bucket_cap_mb)
        size = float(sum(p.numel() * p.element_size() for p in params))
        spans = job.spans_nodes(world)
        out = syncbn.communication(job.model, job) if self.settings.sync_bn else []
        if world < 2:
            return out
        if self.settings.algorithm == Algorithm.ring:
            sent = 2 * (world - 1) / world * size
            what = "ring all-reduce after backward (ddpexp's send/recv)"
            calls = 2 * (world - 1) * len(groups)
            return [Collective(what, "sendrecv", sent, 2, calls, counted=sent, inter_node=spans), *out]
        what = "gradient all-reduce after backward, one group at a time"
        return [
            Collective(what, "all_reduce", size, world, len(groups), counted=size, inter_node=spans),
            *out,
        ]


# Sums a flat buffer over the ranks, in place; returns the bytes this rank counts (see the docstring).
Reduce = Callable[[torch.Tensor], int]


def averager(
    params: list[torch.nn.Parameter],
    groups: list[list[torch.nn.Parameter]],
    reduce: Reduce,
    meter: CommMeter | None,
    device: torch.device,
) -> Callable[[], None]:
    """The step's gradient averaging: one reduction per group, one after the other, after backward."""
    world = dist.get_world_size()
    cuda = device.type == "cuda"

    def sync_grads() -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # keep every rank issuing the same collectives
        timed_on_cuda = meter is not None and meter.timing and cuda
        if timed_on_cuda:
            torch.cuda.synchronize()  # time the reductions, not the backward still queued before them
        start = time.perf_counter()
        nbytes = sum(average_group(group, reduce, world) for group in groups)
        if meter is not None:
            if timed_on_cuda:
                torch.cuda.synchronize()
            meter.record(start, time.perf_counter(), nbytes)

    return sync_grads


def average_group(group: list[torch.nn.Parameter], reduce: Reduce, world: int) -> int:
    """Average one group's gradients over the ranks through one flat buffer; the bytes counted."""
    grads = [p.grad for p in group if p.grad is not None]
    in_place = len(grads) == 1 and grads[0].is_contiguous()  # the gradient itself: nothing to copy
    flat = grads[0].view(-1) if in_place else torch.cat([g.flatten() for g in grads])
    nbytes = reduce(flat)
    flat.div_(world)
    if not in_place:
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))
    return nbytes


def collective_sum(flat: torch.Tensor) -> int:
    """`dist.all_reduce`; counts the buffer's size (what each rank contributes)."""
    dist.all_reduce(flat)
    return flat.numel() * flat.element_size()


def ring_sum(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum `flat` (1-D, contiguous) over the ranks of `group` in place, as a ring; returns the bytes
    this rank sent.

    The W ranks form a ring: each sends only to its right neighbour (rank + 1) and receives only
    from its left one (rank - 1). `flat` is cut into W consecutive chunks (`chunk_bounds`: sizes
    differ by at most one element, so any size works, even fewer elements than ranks).
      reduce-scatter, W-1 steps: at step s rank r sends chunk r-s and receives chunk r-s-1, which it
        adds to its own copy. A chunk travels the ring gathering one more rank's values per step, so
        afterwards rank r holds chunk r+1 summed over every rank.
      all-gather, W-1 steps: at step s rank r sends chunk r+1-s (complete) and receives chunk r-s,
        which it stores. Afterwards every rank holds every chunk, summed.
    Indices are mod W. Each step sends and receives at once (`dist.batch_isend_irecv`), so neighbours
    never wait on each other; an empty chunk is skipped by both its sender and its receiver. Per
    rank: 2(W-1) chunks of about S/W sent, so the traffic per rank stays ~2S whatever W is.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return 0
    rank = dist.get_rank(group)
    right, left = (_global(group, (rank + offset) % world) for offset in (1, -1))
    chunks = [flat[start:stop] for start, stop in chunk_bounds(flat.numel(), world)]
    scratch = torch.empty_like(chunks[0])  # the first chunk is the longest
    sent = 0
    for step in range(world - 1):  # reduce-scatter
        into = chunks[(rank - step - 1) % world]
        received = scratch[: into.numel()]
        sent += _exchange(chunks[(rank - step) % world], received, right, left, group)
        into.add_(received)
    for step in range(world - 1):  # all-gather
        into = chunks[(rank - step) % world]
        sent += _exchange(chunks[(rank + 1 - step) % world], into, right, left, group)
    return sent * flat.element_size()


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """`world` consecutive (start, stop) ranges covering `numel` elements; the first numel % world
    ranges are one element longer."""
    size, extra = divmod(numel, world)
    bounds, start = [], 0
    for index in range(world):
        stop = start + size + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _exchange(
    out: torch.Tensor, into: torch.Tensor, right: int, left: int, group: dist.ProcessGroup | None
) -> int:
    """Send `out` to the right neighbour while receiving `into` from the left; the elements sent."""
    ops = []
    if out.numel():
        ops.append(dist.P2POp(dist.isend, out, right, group))
    if into.numel():
        ops.append(dist.P2POp(dist.irecv, into, left, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            distributed.wait_for(work)
    return out.numel()


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    """A rank of `group` as the global rank point-to-point calls take."""
    return rank if group is None else dist.get_global_rank(group, rank)


def buckets(params: list[torch.nn.Parameter], cap_mb: float | None) -> list[list[torch.nn.Parameter]]:
    """One parameter per reduction (cap None), or consecutive parameters packed up to cap_mb each
    (in reverse order, like DDP: the last layers' gradients are ready first)."""
    if cap_mb is None:
        return [[p] for p in params]
    cap = cap_mb * 2**20
    groups: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if groups[-1] and size + nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups

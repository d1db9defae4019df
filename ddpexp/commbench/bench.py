"""The benchmark in every worker, inside the process group ddpexp's launcher set up: each op at each
size is first checked (rank-dependent inputs, the exact output every rank must then hold), then timed;
rank 0 writes the results (commbench.json, commbench.png) and prints the table.

Timing, per op and size: `warmup` untimed calls, a barrier, then `iters` calls back to back on each
rank (the device synchronised before the clock starts and stops); a rank's time is the mean per
call, and the time reported is the largest over the ranks (the slowest rank sets the pace of a
collective). After compute (`after_compute_ms` > 0), each timed call follows a burst of compute on
every rank instead (`time_after_compute`: the mean over calls and ranks, waits included), and the
same calls are then timed back to back as above. Each measurement beats the heartbeat, so the
launcher's hang detection keeps working.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from .. import distributed
from ..context import RunContext
from ..job import Job
from . import SPLIT_OPS, Op, sizes
from .output import Measurement, write_outputs
from .settings import CommbenchConfig

log = logging.getLogger(__name__)

# Newer torch names them *_single and deprecates *_tensor; torch 2.6 (the oldest ddpexp supports)
# has only *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class WrongResult(RuntimeError):
    """A collective returned other data than it should: its timings would mean nothing."""


def run(job: Job, ctx: RunContext) -> dict[str, float]:
    """Measure every op at every size on this rank; rank 0 records them. Returns nothing to report
    (the results are in commbench.json)."""
    section = OmegaConf.to_object(job.cfg.commbench)
    assert isinstance(section, CommbenchConfig)
    settings = section.effective()
    dtype = getattr(torch, settings.dtype.value)
    itemsize = torch.empty((), dtype=dtype).element_size()
    burst = Burst.calibrate(settings.after_compute_ms, ctx) if settings.after_compute_ms > 0 else None
    measurements: list[Measurement] = []
    for op in settings.ops:
        for nbytes in sizes(
            op,
            min_bytes=settings.min_bytes,
            max_bytes=settings.max_bytes,
            world=ctx.world_size,
            itemsize=itemsize,
        ):
            case = Case.build(op, nbytes // itemsize, ctx=ctx, dtype=dtype)
            verify(case, op=op, nbytes=nbytes)
            if burst is None:
                seconds = time_calls(
                    case.call, warmup=settings.warmup, iters=settings.iters, device=ctx.device
                )
                measurement = Measurement(op, nbytes, seconds, settings.iters)
            else:
                seconds, compute = time_after_compute(
                    case.call, burst, warmup=settings.warmup, iters=settings.iters, device=ctx.device
                )
                back_to_back = time_calls(case.call, warmup=0, iters=settings.iters, device=ctx.device)
                measurement = Measurement(op, nbytes, seconds, settings.iters, compute, back_to_back)
            measurements.append(measurement)
            ctx.heartbeat.beat(len(measurements))
    if ctx.is_main:
        write_outputs(job, ctx, measurements, settings, burst.alone_s if burst else None)
    return {}


@dataclass(frozen=True)
class Burst:
    """Compute before each call: `reps` products of two 128 x 128 float32 matrices, as many as take about
    the asked time on rank 0 computing alone; every rank runs the same count (the same work, as a
    training step's ranks do)."""

    reps: int
    alone_s: float  # one burst, the mean over the ranks, each timed while the others wait
    a: torch.Tensor
    b: torch.Tensor

    @classmethod
    def calibrate(cls, ms: float, ctx: RunContext) -> Burst:
        a = torch.randn(128, 128, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
        b = a.clone()
        _burst(a, b, 16)  # the first products allocate and warm up: not timed
        reps = 0
        if ctx.is_main:
            reps, alone = 1, _timed(a, b, 1, ctx.device)
            while alone < ms / 4e3 and reps < 2**20:  # long enough to time, then scaled to the ask
                reps *= 2
                alone = _timed(a, b, reps, ctx.device)
            alone = min(alone, *(_timed(a, b, reps, ctx.device) for _ in range(2)))  # the least disturbed
            reps = max(1, math.ceil(reps * ms / 1e3 / alone))
        reps = int(distributed.broadcast_object(reps))  # type: ignore[call-overload]
        # Each rank alone in turn (a rank waiting in a gloo barrier takes no core): processes of one
        # host compute at speeds that differ by tens of percent, so the stretch compares the same ones.
        mine = 0.0
        for turn in range(ctx.world_size):
            dist.barrier()
            if turn == ctx.rank:
                mine = min(_timed(a, b, reps, ctx.device) for _ in range(3))
        dist.barrier()
        alone = statistics.fmean(float(t) for t in distributed.gather_objects(mine))  # type: ignore[arg-type]
        return cls(reps, alone, a, b)

    def __call__(self) -> None:
        _burst(self.a, self.b, self.reps)


def _burst(a: torch.Tensor, b: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        torch.mm(a, b, out=b)
        b.mul_(1 / 128)  # keeps the values bounded however many products


def _timed(a: torch.Tensor, b: torch.Tensor, reps: int, device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    _burst(a, b, reps)
    _synchronize(device)
    return time.perf_counter() - start


def time_after_compute(
    call: Callable[[], object], burst: Burst, *, warmup: int, iters: int, device: torch.device
) -> tuple[float, float]:
    """Seconds per call when each follows a burst of compute, and seconds per burst, both the mean over
    calls and ranks: a call's time runs from its rank's burst ending to the call returning, so it
    holds the wait for the last rank to arrive as well as the collective; the burst's time is what
    it takes with every rank computing at once."""
    for _ in range(warmup):
        burst()
        call()
    _synchronize(device)
    dist.barrier()
    in_call = in_burst = 0.0
    for _ in range(iters):
        start = time.perf_counter()
        burst()
        _synchronize(device)
        ended = time.perf_counter()
        call()
        _synchronize(device)
        in_call += time.perf_counter() - ended
        in_burst += ended - start
    ranks = distributed.gather_objects((in_call / iters, in_burst / iters))
    return statistics.fmean(r[0] for r in ranks), statistics.fmean(r[1] for r in ranks)  # type: ignore[index]


@dataclass(frozen=True)
class Case:
    """One op at one size on this rank: its input filled with a pattern that differs by rank (and, for
    all_to_all, by destination), the call, the output buffer, and what it must hold afterwards."""

    call: Callable[[], object]
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    expected: torch.Tensor
    rtol: float = 0.0  # 0: exactly equal

    @classmethod
    def build(cls, op: Op, elements: int, *, ctx: RunContext, dtype: torch.dtype) -> Case:
        rank, world, device = ctx.rank, ctx.world_size, ctx.device

        def pattern(tag: int, count: int, start: int = 0) -> torch.Tensor:
            # Small integers, (1..4) x (tag + 1): a rank or part that arrives in the wrong place shows.
            # Moved data must arrive exactly; sums are exact in float32 and float64 (far below 2^24).
            base = torch.arange(start, start + count, device=device) % 4 + 1
            return (base * (tag + 1)).to(dtype)

        part = elements // world if op in SPLIT_OPS else elements
        ranks_sum = world * (world + 1) // 2  # sum of (tag + 1) over the ranks
        # In 16-bit types, partial sums round (at a different place in each algorithm).
        rtol = world * torch.finfo(dtype).eps if torch.finfo(dtype).bits < 32 else 0.0
        if op == Op.all_reduce:
            buffer = pattern(rank, elements)
            expected = pattern(ranks_sum - 1, elements)
            return cls(lambda: dist.all_reduce(buffer), (buffer,), buffer, expected, rtol)
        if op == Op.broadcast:
            buffer = pattern(rank, elements)
            return cls(lambda: dist.broadcast(buffer, src=0), (buffer,), buffer, pattern(0, elements))
        if op == Op.all_gather:
            source, gathered = pattern(rank, part), torch.empty(elements, dtype=dtype, device=device)
            expected = torch.cat([pattern(r, part) for r in range(world)])
            return cls(lambda: _all_gather(gathered, source), (source,), gathered, expected)
        if op == Op.reduce_scatter:
            source, mine = pattern(rank, elements), torch.empty(part, dtype=dtype, device=device)
            expected = pattern(ranks_sum - 1, part, start=rank * part)
            return cls(lambda: _reduce_scatter(mine, source), (source,), mine, expected, rtol)
        if op == Op.all_to_all:
            # Part p of rank r's input goes to rank p: tagged r x W + p, so every (from, to) pair differs.
            source = torch.cat([pattern(rank * world + p, part) for p in range(world)])
            received = torch.empty_like(source)
            expected = torch.cat([pattern(r * world + rank, part) for r in range(world)])
            return cls(lambda: dist.all_to_all_single(received, source), (source,), received, expected)
        # sendrecv: to the next rank of the ring, from the previous one.
        sent, received = pattern(rank, elements), torch.empty(elements, dtype=dtype, device=device)

        def sendrecv() -> None:
            ops = [
                dist.P2POp(dist.isend, sent, (rank + 1) % world),
                dist.P2POp(dist.irecv, received, (rank - 1) % world),
            ]
            for work in dist.batch_isend_irecv(ops):
                distributed.wait_for(work)

        return cls(sendrecv, (sent,), received, pattern((rank - 1) % world, elements))


def verify(case: Case, *, op: Op, nbytes: int) -> None:
    """One call, and its output compared with what it must be on every rank; then the inputs are
    zeroed for timing (repeated in-place all-reduces of the pattern would grow without bound)."""
    case.call()
    if case.rtol:
        wrong = not torch.allclose(case.output, case.expected, rtol=case.rtol, atol=0.0)
    else:
        wrong = not torch.equal(case.output, case.expected)
    failed = [rank for rank, bad in enumerate(distributed.gather_objects(wrong)) if bad]
    if failed:
        raise WrongResult(
            f"{op} of {nbytes} bytes gave wrong results on rank(s) {', '.join(map(str, failed))}: "
            "the backend's collective is broken, so its timings would mean nothing"
        )
    for tensor in case.inputs:
        tensor.zero_()


def time_calls(call: Callable[[], object], *, warmup: int, iters: int, device: torch.device) -> float:
    """Seconds per call: the mean of `iters` calls after a barrier, the slowest rank's."""
    for _ in range(warmup):
        call()
    _synchronize(device)
    dist.barrier()
    _synchronize(device)  # NCCL's barrier may return before its kernel has run
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _synchronize(device)
    return distributed.all_reduce_max((time.perf_counter() - start) / iters)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

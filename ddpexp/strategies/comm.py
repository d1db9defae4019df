"""Measuring gradient communication: how long the reductions keep the wire busy, and how many bytes.

DDP (and ddp_mp, zero) wrap their communication hook (DDP's standard averaging all-reduce, or the
compression hook strategy.comm_hook chose) in `timed_hook`, which records, per bucket, the host time
from the hook's call to the reduction's completion callback, and the bytes of the tensors that hook
all-reduces for the bucket (the payload each rank contributes, not a ring's 2(W-1)/W wire traffic), so
compression shows as fewer bytes. naive_allreduce times its own all-reduce calls. fsdp wraps the
all-gathers and reduce-scatters of its units (`fsdp.metered_collectives`). Overlapping
intervals (buckets in flight together) are merged, so the busy time is wall-clock time during which at
least one reduction was running; with DDP much of it overlaps the backward pass. On CUDA the completion
callback is when the host learns of completion, so the times are host-observed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch


class CommMeter:
    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._bytes = 0

    def record(self, start: float, end: float, nbytes: int) -> None:
        self._intervals.append((start, end))
        self._bytes += nbytes

    def take(self) -> tuple[float, int]:
        """(busy seconds, bytes reduced) since the last call."""
        busy, reach = 0.0, float("-inf")
        for start, end in sorted(self._intervals):
            if end <= reach:
                continue
            busy += end - max(start, reach)
            reach = end
        nbytes = self._bytes
        self._intervals, self._bytes = [], 0
        return busy, nbytes


def record_when_done(meter: CommMeter, work: Any, start: float, nbytes: int) -> None:
    """Record a collective launched at `start` when it completes: now if it ran synchronously (no
    Work), else from its future's completion callback."""
    if work is None:
        meter.record(start, time.perf_counter(), nbytes)
        return

    def done(f: torch.futures.Future[Any]) -> None:
        meter.record(start, time.perf_counter(), nbytes)

    work.get_future().then(done)


# A function of a DDP GradBucket: the bytes of the tensors a hook all-reduces for it.
SentBytes = Callable[[Any], int]


def timed_hook(meter: CommMeter, inner: Any, sent_bytes: SentBytes) -> Any:
    """A DDP communication hook: `inner(state, bucket)` (any DDP hook: the default all-reduce, a
    compression hook, PowerSGD), timed, and recorded with `sent_bytes(bucket)`."""

    # No annotations here: DDP inspects them and accepts only the real types (or none at all).
    def hook(state, bucket):
        start = time.perf_counter()
        nbytes = sent_bytes(bucket)  # before `inner`: PowerSGD advances its iteration inside it
        fut = inner(state, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            meter.record(start, time.perf_counter(), nbytes)
            return f.value()

        return fut.then(done)

    return hook


def buffer_bytes(dtype: torch.dtype | None = None) -> SentBytes:
    """The whole bucket, in its own dtype (the default all-reduce) or cast to `dtype` (fp16/bf16
    compression: 2 bytes per gradient element instead of 4)."""

    def sent(bucket: Any) -> int:
        buffer = bucket.buffer()
        size = buffer.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size()
        return int(buffer.numel() * size)

    return sent


def powersgd_bytes(state: Any) -> SentBytes:
    """What torch's powerSGD_hook sends for a bucket, read from its PowerSGDState. Before
    `start_powerSGD_iter` (counted in optimizer steps: state.iter) it all-reduces the whole bucket.
    After: every gradient is viewed as an n x m matrix (n = its first dimension, m = the rest; a 1-D
    bias is n x 1); with r = min(n, m, matrix_approximation_rank) it is compressed when
    (n + m) * r * min_compression_rate < n * m, and then sends P (n x r) and Q (m x r), i.e.
    (n + m) * r elements; every other gradient (biases, small matrices) is all-reduced in full. Bytes
    = those elements x the gradients' element size. Nothing else is counted (no error-feedback or
    warm-start memory: those stay local)."""

    def sent(bucket: Any) -> int:
        buffer = bucket.buffer()
        if state.iter < state.start_powerSGD_iter:
            return int(buffer.numel() * buffer.element_size())
        shapes = [tuple(g.shape) for g in bucket.gradients()]
        elements = powersgd_elements(shapes, state.matrix_approximation_rank, state.min_compression_rate)
        return elements * buffer.element_size()

    return sent


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float) -> int:
    """Elements PowerSGD sends per step for gradients of these shapes (see powersgd_bytes)."""
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        numel = math.prod(shape)
        m = numel // n if n else 0
        r = min(n, m, rank)
        compressed = (n + m) * r
        total += compressed if compressed * min_compression_rate < numel else numel
    return total

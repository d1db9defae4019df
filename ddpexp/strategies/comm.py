"""Measuring gradient communication: how long the reductions keep the wire busy, and how many bytes.

DDP (and ddp_mp) get a communication hook that performs DDP's standard all-reduce (average) and records,
per bucket, the host time from the hook's call to the reduction's completion callback, with the bucket's
size. naive_allreduce times its own all-reduce calls. Overlapping intervals (buckets in flight together)
are merged, so the busy time is wall-clock time during which at least one reduction was running; with
DDP much of it overlaps the backward pass. On CUDA the completion callback is when the host learns of
completion, so the times are host-observed.
"""

from __future__ import annotations

import time
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


def timed_allreduce_hook(meter: CommMeter) -> Any:
    """A DDP communication hook: DDP's default averaging all-reduce, timed."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # No annotations here: DDP inspects them and accepts only the real types (or none at all).
    def hook(state, bucket):
        start = time.perf_counter()
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        fut = default_hooks.allreduce_hook(state, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            meter.record(start, time.perf_counter(), nbytes)
            return f.value()

        return fut.then(done)

    return hook

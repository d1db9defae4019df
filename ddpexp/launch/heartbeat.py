"""Heartbeats: how a launcher tells a hung rank from a slow one, in seconds rather than after the
process group's timeout.

Each self-launched worker shares a tiny array with its launcher (shared memory, no syscalls):
    [0] beats   micro-batches trained and eval batches scored so far
    [1] step    the optimizer step reached
    [2] slow    1 while in a phase allowed to take long (writing a checkpoint)
The engine beats after every batch. The supervisor (launch/supervise.py) declares a rank hung when
its beats have not moved for dist.hang_timeout_s, or, before the first beat (start-up, data, resume)
and while slow, for dist.timeout_s. A worker with no launcher watching (in-process, torchrun) gets a
heartbeat that does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

BEATS, STEP, SLOW = range(3)
SIZE = 3


def shared_cell(mp_context: Any) -> Any:
    """The array one worker beats into, made before the worker starts (passed as a Process argument)."""
    return mp_context.Array("d", SIZE, lock=False)


class Heartbeat:
    """The worker's side. Without a cell (no launcher watching), every call does nothing."""

    def __init__(self, cell: Any = None) -> None:
        self._cell = cell

    def beat(self, step: int) -> None:
        cell = self._cell
        if cell is not None:
            cell[BEATS] += 1
            cell[STEP] = step

    @contextlib.contextmanager
    def slow(self) -> Iterator[None]:
        """A phase that may take long without beating (a checkpoint of a large model)."""
        cell = self._cell
        if cell is None:
            yield
            return
        cell[SLOW] = 1
        try:
            yield
        finally:
            cell[SLOW] = 0


class Pulse:
    """The supervisor's side for one worker: when its beats last moved."""

    def __init__(self, cell: Any, now: float) -> None:
        self.cell = cell
        self.beats = 0.0
        self.changed_at = now

    def read(self, now: float) -> None:
        beats = self.cell[BEATS]
        if beats != self.beats:
            self.beats, self.changed_at = beats, now

    @property
    def step(self) -> int:
        return int(self.cell[STEP])

    def quiet_for(self, now: float) -> float:
        return now - self.changed_at

    def limit(self, hang_s: float, patience_s: float) -> float:
        """How long this worker may go without a beat: patience before its first beat and in slow
        phases, hang_s otherwise."""
        return patience_s if self.beats == 0 or self.cell[SLOW] else hang_s

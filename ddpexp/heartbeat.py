"""Heartbeats: how a launcher tells a hung rank from a slow one, in seconds rather than after the
process group's timeout.

Each self-launched worker shares a tiny array with its launcher (shared memory, no syscalls):
    [0] beats   micro-batches trained and eval batches scored so far
    [1] step    the optimizer step reached
    [2] slow    1 while in a phase allowed to take long (writing a checkpoint)
    [3] stop    written by the launcher: 0 train on; S > 0 save a checkpoint at step S and stop there
                (trainer.checkpoint_on_signal: one step for every rank, so their saves match); -1
                stop now, without a checkpoint (the launcher is stopping the run)
    [4] signal  the signal that asked for the stop at step S (the exit code is 128 + it)
    [5] forwards  training forwards that returned so far: a rank stuck in its own forward has fewer
                than its peers, which passed theirs and wait for it in the gradients' collective
The engine beats after every batch. The supervisor (launch/supervise.py) declares a rank hung when
its beats have not moved for dist.hang_timeout_s, or, before the first beat (start-up, data, resume)
and while slow, for dist.timeout_s. A worker with no launcher watching (torchrun) gets a heartbeat
that does nothing; an in-process run gets a cell of its own, which its signal handler writes to.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

BEATS, STEP, SLOW, STOP, SIGNAL, FORWARDS = range(6)
SIZE = 6
STOP_NOW = -1


def shared_cell(mp_context: Any) -> Any:
    """The array one worker beats into, made before the worker starts (passed as a Process argument)."""
    return mp_context.Array("d", SIZE, lock=False)


class Preempted(Exception):
    """Raised at the step boundary the launcher (or an in-process run's own signal handler) chose,
    after the checkpoint of that step is written: the run stops as `preempted`, exit 128 + signal."""

    interrupted = True
    status = "preempted"

    def __init__(self, signum: int, step: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} at step {step}: checkpoint saved; to continue, run the same command "
            "with trainer.resume=auto (a requeued submitit job does so by itself)"
        )
        self.code = 128 + signum
        self.step = step


class Heartbeat:
    """The worker's side. Without a cell (no launcher watching), every call does nothing."""

    def __init__(self, cell: Any = None) -> None:
        self._cell = cell

    @classmethod
    def local(cls) -> Heartbeat:
        """A cell in this process (an in-process run stops itself at a step boundary)."""
        return cls([0.0] * SIZE)

    @property
    def step(self) -> int:
        return int(self._cell[STEP]) if self._cell is not None else 0

    def request_stop(self, at_step: int, signum: int) -> None:
        if self._cell is not None:
            _write_stop(self._cell, at_step, signum)

    def stop_signal(self, step: int) -> int | None:
        """At an optimizer step boundary: the signal to stop for, if a checkpoint-and-stop at this step
        (or one the rank has passed) was asked for."""
        cell = self._cell
        if cell is None or not 0 < cell[STOP] <= step:
            return None
        return int(cell[SIGNAL])

    @property
    def stop_requested(self) -> bool:
        return self._cell is not None and self._cell[STOP] != 0

    def stopping_now(self) -> bool:
        return self._cell is not None and self._cell[STOP] == STOP_NOW

    def beat(self, step: int) -> None:
        cell = self._cell
        if cell is not None:
            cell[BEATS] += 1
            cell[STEP] = step

    def reached(self, step: int) -> None:
        """An optimizer step is done: a rank that hangs in the next one is reported in that one."""
        if self._cell is not None:
            self._cell[STEP] = step

    def forward_done(self) -> None:
        cell = self._cell
        if cell is not None:
            cell[FORWARDS] += 1

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

    @property
    def progress(self) -> float:
        """Batches done and forwards returned: of ranks that stopped together, the one with the least
        progress stopped on its own; the others wait in a collective for it."""
        return self.cell[BEATS] + self.cell[FORWARDS]

    def request_stop(self, value: int, signum: int = 0) -> None:
        _write_stop(self.cell, value, signum)

    def quiet_for(self, now: float) -> float:
        return now - self.changed_at

    def limit(self, hang_s: float, patience_s: float) -> float:
        """How long this worker may go without a beat: patience before its first beat and in slow
        phases, hang_s otherwise."""
        return patience_s if self.beats == 0 or self.cell[SLOW] else hang_s


def _write_stop(cell: Any, value: int, signum: int) -> None:
    """The signal first: a worker that sees the stop step reads the signal it is for."""
    cell[SIGNAL] = signum
    cell[STOP] = value

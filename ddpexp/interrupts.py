"""A stop asked for by a signal: an exception where the signal lands, and a flag behind it.

The handler (launch/supervise.py) raises `Interrupted` wherever the main thread is, so a run unwinds
through its `finally` blocks and records itself as interrupted. But CPython drops an exception raised
while a finalizer runs (a `__del__`, a weakref callback: "Exception ignored in ..."), and a signal that
lands there would be lost: a sweep went on to its next jobs so. The handler therefore also leaves the
signal here, and the training loop and the sweep raise it again at their next step
(`raise_if_requested`). Standard library only, so that every layer can check it.
"""

from __future__ import annotations

import signal
from typing import NoReturn

_requested: int | None = None


class Interrupted(BaseException):
    """Raised in the main thread when the process is asked to stop (SIGTERM). A BaseException, as
    KeyboardInterrupt is: code that handles any Exception (a log handler, a loader's "damaged file")
    must not take a stop for its own failure and carry on."""

    interrupted = True

    def __init__(self, code: int) -> None:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = "signal"
        super().__init__(f"stopped by {name} (exit {code})")
        self.code = code


def stop(signum: int) -> NoReturn:
    """What a signal handler that stops the run does: remember the signal, then raise `Interrupted`."""
    request(signum)
    raise Interrupted(128 + signum)


def request(signum: int) -> None:
    """A stop signal arrived: remembered until `clear` (the next command run in this process)."""
    global _requested
    _requested = signum


def clear() -> None:
    global _requested
    _requested = None


def raise_if_requested() -> None:
    """Raise `Interrupted` for a stop signal that arrived, even one whose exception was dropped."""
    if _requested is not None:
        raise Interrupted(128 + _requested)

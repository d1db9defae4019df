"""When a signal reached this process, as the kernel timed it (Linux; elsewhere nothing is known).

Python runs a signal's handler in the main thread between two bytecodes, so a process blocked in a
collective runs it only once the collective returns: the handler's own clock can be late by as long
as that takes. Python's C-level handler, which runs at once, writes the signal's number to the wakeup
fd (`signal.set_wakeup_fd`); here that fd is a datagram socket whose reader asks the kernel to stamp
each datagram with the time it was sent, so the time a signal arrived can be read afterwards without a
thread watching for it. Torchrun's rank 0 uses it to tell the agent's SIGTERM that follows a peer's
end from the one it sends every worker at once (see torchrun.blame_a_peer).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import struct
import sys
import threading
from collections.abc import Iterator

# Linux's SO_TIMESTAMP (and SCM_TIMESTAMP, its message): Python's socket module does not name it.
_SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29)
_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


class Arrivals:
    """The first time each signal handled in Python reached this process, once `first` reads them."""

    def __init__(self, reader: socket.socket | None) -> None:
        self._reader = reader
        self._first: dict[int, float] = {}

    def first(self, signum: int) -> float | None:
        """When `signum` first arrived (time.time()'s clock), or None: it has not, or nothing is known."""
        self._drain()
        return self._first.get(signum)

    def _drain(self) -> None:
        if self._reader is None:
            return
        size = socket.CMSG_SPACE(_TIMEVAL.size)
        while True:
            try:
                data, ancillary, _flags, _addr = self._reader.recvmsg(16, size)
            except (BlockingIOError, OSError):
                return
            stamps = [d for lvl, kind, d in ancillary if lvl == socket.SOL_SOCKET and kind == _SO_TIMESTAMP]
            if not stamps or len(stamps[0]) < _TIMEVAL.size:
                continue
            seconds, micros = _TIMEVAL.unpack_from(stamps[0])
            for signum in data:  # one byte per signal
                self._first.setdefault(signum, seconds + micros / 1e6)


@contextlib.contextmanager
def timed() -> Iterator[Arrivals]:
    """Within the block, the arrival of every signal with a Python handler is kept (main thread only:
    only it may set the wakeup fd; elsewhere, and where the kernel does not stamp, nothing is kept)."""
    if threading.current_thread() is not threading.main_thread() or not sys.platform.startswith("linux"):
        yield Arrivals(None)
        return
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        reader.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMP, 1)
        reader.setblocking(False)
        writer.setblocking(False)
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (OSError, ValueError):
        reader.close()
        writer.close()
        yield Arrivals(None)
        return
    try:
        yield Arrivals(reader)
    finally:
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()

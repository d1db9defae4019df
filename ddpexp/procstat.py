"""What the OS says about a process, from /proc (Linux; elsewhere nothing is known): whether it is
stopped, when it started, and how one that is gone ended. A launcher uses it to tell which process
of a run really failed when its own view (multiprocessing's exit codes, a peer's broken connection)
only shows the echoes; the run record, whether the process that owns a `running` run is gone.
Standard library only, so the lowest layers may use it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

# Fields of /proc/<pid>/stat after the command name: [0] is the state (field 3 of proc(5)).
_STATE, _START_TIME, _EXIT_CODE = 0, 19, 49


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def is_stopped(pid: int) -> bool:
    """Whether the OS shows the process as stopped (SIGSTOP, job control, a tracer)."""
    fields = _stat(pid)
    return fields is not None and fields[_STATE] in "Tt"


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with its pid, it names one process, never
    a later one given the same pid."""
    fields = _stat(pid)
    return int(fields[_START_TIME]) if fields is not None else None


def is_gone(pid: int, started: int | None = None) -> bool:
    """Whether process `pid` (started at `started`, when known) has ended: no such process, a zombie
    not yet reaped, or another process now holding its pid. Where /proc cannot tell, asks the OS
    whether the pid exists at all."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    fields = _stat(pid)
    if fields is None or fields[_STATE] in "ZX":
        return True
    return started is not None and int(fields[_START_TIME]) != started


def how_it_ended(pid: int, started: int | None = None) -> str | None:
    """None while the process runs; once it has ended, how: "killed by SIGKILL", "exited with code
    3", or "ended" where the OS no longer says (it has been reaped; `started` tells a new process
    with its pid from it). A zombie's exit status is readable until its parent reaps it."""
    fields = _stat(pid)
    if fields is None or (started is not None and int(fields[_START_TIME]) != started):
        return "ended"
    if fields[_STATE] not in "ZX":
        return None
    status = int(fields[_EXIT_CODE]) if len(fields) > _EXIT_CODE else 0
    if status & 0x7F:
        return f"killed by {signal.Signals(status & 0x7F).name}"
    return f"exited with code {status >> 8}" if status else "ended"

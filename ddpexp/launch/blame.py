"""Which rank a hang is blamed on, from where each rank is when the run stops moving.

When one rank hangs, its peers soon stop too: they wait for it in the next collective. Counting
batches cannot tell them apart (a rank that hangs in its backward, in a pipeline stage or inside a
tensor-parallel block has done as much as its peers), but their stacks can: the hung rank is in code
of its own (the model, a hook, a data read, ddpexp), the others wait in torch.distributed or in the
autograd engine (where DDP's gradient all-reduce waits). The supervisor asks every rank for its stack
(faulthandler, into its log), reads the main thread's back with `main_thread`, and `choose` decides:

1. a rank the OS shows as stopped (SIGSTOP, a debugger);
2. else the one rank in code of its own, or among several such, the one that made the least progress;
3. else (every rank waits in a collective) the one that made the least progress;
and where that leaves a tie, nobody: the report says the culprit cannot be told and names the ranks.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# Where ddpexp waits for a collective it started asynchronously (Work.wait() is C++, no Python frame).
OWN_WAITS = {("ddpexp/distributed.py", "wait_for")}
_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(?P<path>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_STDLIB = str(Path(sys.base_prefix).resolve())
_TORCH = importlib.util.find_spec("torch")  # found, not imported: the launcher need not load torch
_TORCH_DIRS = tuple(str(Path(d)) + "/" for d in (_TORCH.submodule_search_locations or [])) if _TORCH else ()


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.func} ({_shown(self.path)}:{self.line})"


@dataclass(frozen=True)
class Where:
    """Where a rank's main thread is: waiting for its peers, or in code of its own (at `frame`, the
    innermost frame outside Python's library and torch; None when all of it is torch's)."""

    waiting: bool
    frame: Frame | None

    def __str__(self) -> str:
        if self.waiting:
            return "waits in a collective"
        return f"in {self.frame}" if self.frame is not None else "computing in torch"


def main_thread(text: str) -> list[Frame] | None:
    """The main thread's frames (innermost first) from the last complete faulthandler dump in `text`:
    the thread whose outermost frame is the process's `<module>` (every other thread starts in
    threading's _bootstrap). None when no such dump is there yet."""
    found: list[Frame] | None = None
    frames: list[Frame] | None = None
    for line in text.splitlines():
        if _HEADER.match(line):
            frames = []
            continue
        if frames is None:
            continue
        m = _FRAME.match(line)
        if m is not None:
            frames.append(Frame(m["path"], int(m["line"]), m["func"]))
            if m["func"] == "<module>":
                found, frames = frames, None
        elif line.strip() == "...":  # faulthandler's depth limit: only the main thread goes that deep
            found, frames = frames, None
        else:
            frames = None
    return found


def where(frames: list[Frame]) -> Where:
    """Skipping Python's own library (threading's waits, queues), the innermost frames decide: torch's
    distributed package or the autograd engine among the innermost torch frames, or one of ddpexp's
    own waits, is waiting for peers; anything else is a rank busy in its own code (or in torch's
    computation, which no peer holds up)."""
    inner = [f for f in frames if not _in_stdlib(f.path)]
    own = next((f for f in inner if not _in_torch(f.path)), None)
    for f in inner:
        if not _in_torch(f.path):
            return Where(waiting=any(f.path.endswith(p) and f.func == fn for p, fn in OWN_WAITS), frame=own)
        if "/torch/distributed/" in f.path or f.func == "_engine_run_backward":
            return Where(waiting=True, frame=own)
    return Where(waiting=False, frame=own)


@dataclass(frozen=True)
class Suspect:
    rank: int
    progress: float  # batches done and forwards returned (heartbeat.Pulse.progress)
    stopped: bool  # by the OS (SIGSTOP, a debugger)
    where: Where | None  # None: no stack could be read


@dataclass(frozen=True)
class Verdict:
    """The rank blamed, or none (`rank` None) with the ranks it could be (`among`) and why not."""

    rank: int | None
    reason: str
    among: tuple[int, ...] = ()


def choose(suspects: list[Suspect]) -> Verdict:
    stopped = [s for s in suspects if s.stopped]
    if stopped:
        return Verdict(stopped[0].rank, "stopped (SIGSTOP or a debugger)")
    busy = [s for s in suspects if s.where is not None and not s.where.waiting]
    pool = busy or suspects
    least = min(s.progress for s in pool)
    behind = [s for s in pool if s.progress == least]
    others_wait = all(s.where is not None and s.where.waiting for s in suspects if s not in busy)
    if len(behind) == 1:
        s = behind[0]
        if busy and others_wait:
            reason = f"{s.where}, while every other rank waits in a collective"
        elif busy:
            reason = f"{s.where}; it made the least progress"
        else:
            reason = "every rank waits in a collective; it made the least progress"
        return Verdict(s.rank, reason)
    if busy:
        reason = "each of them is in code of its own, equally far along"
    elif all(s.where is not None for s in suspects):
        reason = "each waits in a collective, equally far along"
    else:
        reason = "no stack could be read, and they are equally far along"
    return Verdict(None, reason, tuple(s.rank for s in behind))


def _in_stdlib(path: str) -> bool:
    return path.startswith(_STDLIB) and "site-packages" not in path


def _in_torch(path: str) -> bool:
    return path.startswith(_TORCH_DIRS) or "/site-packages/torch/" in path


def _shown(path: str) -> str:
    """A path as short as still says which file: relative to the working directory when under it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path

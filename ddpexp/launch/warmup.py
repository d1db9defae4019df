"""The forkserver that self-launched workers are forked from: started as early as possible, so that it
imports torch (about 4 s of CPU on the development VM) on another core while the launcher does its
own imports and pre-flight, and stopped again if no job needs it; and what the command's jobs share,
made ready before the first job's clock starts (`finish`).

The command line (`cli.console`, a process of its own) starts it speculatively before it imports
torch, since only pre-flight knows whether any job spawns workers. Pre-flight then `settle`s it: a
job that forks its workers from it claims it; otherwise, and on every way out of the command line
(`release`), an unclaimed server is killed at once, without waiting for its imports to finish, so no
process outlives the command. In-process callers (`ddpexp.run`, a notebook) start it only when
pre-flight settles on it, as before.

What every job of a command shares (the forkserver's imports; for jobs that run in this process,
the modules training imports on first use, torch._dynamo's ~1.8 s among them) is done by `finish`,
which the runner calls before the first job's clock starts: each job's time to first step is then its
own start-up, whether it runs first or fifth in a sweep.

Imports no torch (the command line loads this before anything heavy).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import sys
import types
from collections.abc import Iterator
from multiprocessing import forkserver, resource_tracker
from typing import Any

from ..config import StartMethod
from .tether import TETHER_ENV

# What the forkserver imports before forking workers: everything a worker needs before it trains.
# torch._dynamo (~1.8 s) is imported by the first optimizer a worker builds (torch wraps
# Optimizer.add_param_group in _disable_dynamo, and Optimizer.step imports it), so it belongs here too.
# ddpexp.launch.tether comes first: the server dies with this process even while it imports the rest.
PRELOAD = [
    "ddpexp.launch.tether",
    "ddpexp.launch.worker",
    "ddpexp.train",
    "torch.utils.tensorboard",
    "torch._dynamo",
]

_unclaimed: int | None = None  # the pid of a forkserver start_early started and no job claimed yet
_to_finish: set[str] = set()  # what settle() found the jobs need warm: "forkserver", "in_process"


def _server() -> Any:
    return forkserver._forkserver  # multiprocessing's one per process


def server_pid() -> int | None:
    """The running forkserver's pid: the parent of every worker forked from it."""
    pid: int | None = _server()._forkserver_pid
    return pid


def forkserver_context() -> Any:
    """multiprocessing's forkserver context, its server set to import PRELOAD when it starts."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_early() -> None:
    """Start the forkserver now, in case a job will fork workers from it (a no-op if one runs).

    It starts with SIGINT blocked (a signal mask survives exec): a Ctrl-C in the terminal reaches the
    whole foreground process group, and one that lands while the server imports would print its
    KeyboardInterrupt traceback under the command's one line. Once its imports are done the server
    ignores SIGINT itself, which drops a pending one; its workers unblock it (worker.forked_main).
    The command's own Ctrl-C meanwhile waits, blocked, and arrives once the server is started."""
    global _unclaimed
    if _server()._forkserver_pid is not None:
        return
    forkserver_context()
    resource_tracker.ensure_running()  # first: starting it unblocks SIGINT in this process again
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        _ensure_running()
        _unclaimed = _server()._forkserver_pid  # before a pending Ctrl-C arrives: release() sees it
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def settle(method: StartMethod | None, *, in_process: bool = False) -> None:
    """Pre-flight's decision: `method` is how the first spawning job starts its workers (None: no job
    spawns); `in_process`: some job trains in this process. A forkserver job claims the server,
    starting it if it is not running yet. `finish` later waits for what they need."""
    global _unclaimed
    _to_finish.clear()
    if in_process:
        _to_finish.add("in_process")
    if method is None or StartMethod(method) != StartMethod.forkserver:
        release()
        return
    _unclaimed = None
    forkserver_context()
    _ensure_running()
    _to_finish.add("forkserver")


def _ensure_running() -> None:
    """Start the server if it is not running, tethered to this process (launch/tether.py): the server
    inherits this environment, and only the server's start reads it."""
    os.environ[TETHER_ENV] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(TETHER_ENV, None)


def finish() -> None:
    """What settle() found the jobs need, made ready now (before the first job's clock starts): the
    forkserver done with its imports (a no-op process forked from it and joined), and PRELOAD imported
    in this process for jobs that train here. Otherwise the first job of a sweep would carry these for
    every job (measured: 5.8 s to its first step against 0.1 s for a repeat of it, which the report
    then compared as if they were the strategy's)."""
    if "forkserver" in _to_finish:
        ctx = forkserver_context()
        with callers_script_hidden():
            probe = ctx.Process(target=int, name="ddpexp-warmup")  # int() returns at once
            probe.start()
        probe.join()
    if "in_process" in _to_finish:
        for module in PRELOAD:
            importlib.import_module(module)
    _to_finish.clear()


@contextlib.contextmanager
def callers_script_hidden() -> Iterator[None]:
    """While a process starts from the forkserver (or by spawn), `__main__` is a blank stand-in.
    multiprocessing hands every such child the parent's main script (or `-m` module) to run again first,
    as `__mp_main__`; a worker is ddpexp's own program (worker.forked_main) and needs none of it. A
    user's script that calls ddpexp.run at top level, without an `if __name__ == "__main__":` guard,
    would otherwise call it again in every worker, which then fails at start-up."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__: nothing to run
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def release() -> None:
    """Stop a forkserver that start_early started and no job claimed: killed, not asked (asking waits
    until its imports are done), then reaped."""
    global _unclaimed
    pid, _unclaimed = _unclaimed, None
    server = _server()
    if pid is None or server._forkserver_pid != pid:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()

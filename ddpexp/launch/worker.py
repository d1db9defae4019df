"""One worker process from start to exit code.

Self-launched workers start in `forked_main` (forked from the launcher's forkserver, or spawned);
torchrun workers and in-process runs enter through `execute`/`run_guarded`. A worker never calls
Hydra, never reads the user's command line, and never reads its job back from the run directory
(another run could have written there): its job comes from the launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..context import PARENT_PID_ENV, RunContext
from ..errors import UserError
from ..fsutil import atomic_write_text
from ..heartbeat import Heartbeat, Preempted
from ..interrupts import Interrupted
from ..job import Job
from . import senders
from .error_records import error_file
from .leave import exit_now
from .supervise import STACK_SIGNAL, forward_to_launcher, sigterm_raises

log = logging.getLogger(__name__)


INIT_URL_ENV = "DDPEXP_INIT_URL"  # the process group's init URL, from a self-launching launcher


@dataclass(frozen=True)
class WorkerSpec:
    """What a forked or spawned worker process receives (pickled): its job from the launcher itself
    (never from whatever config.yaml holds when the worker starts: the file is a record for people),
    everything else from its environment, as a worker started any other way would."""

    rank: int
    env: dict[str, str]
    log_path: str
    console: Any  # rank 0: the write end of a pipe to the launcher's console; None for the others
    job: dict[str, Any]  # Job.to_dict() of this attempt
    heartbeat: Any  # the shared array the worker beats into (ddpexp/heartbeat.py)


def execute(job: Job, ctx: RunContext, *, url: str | None = None, store: Any = None) -> dict[str, float]:
    """Join the process group (if the strategy has one), run the job (`program`), leave the group."""
    from .. import distributed

    if job.plan.backend is not None:
        distributed.start(ctx, url=url or "env://", timeout_s=job.cfg.dist.timeout_s, store=store)
    try:
        result = program(job)(job, ctx)
        distributed.finish()
        return result
    finally:
        distributed.stop()


def program(job: Job) -> Callable[[Job, RunContext], dict[str, float]]:
    """What the workers run: training, or the collective benchmark when the job's config has a
    `commbench` section (python -m ddpexp.commbench)."""
    if job.cfg.get("commbench") is not None:
        from ..commbench import bench

        return bench.run
    from .. import train

    return train.run


def run_guarded(fn: Callable[[], object], ctx: RunContext, *, record_stops: bool = False) -> int:
    """Run `fn` and turn its outcome into an exit code; failures leave an error file for the launcher
    (and, with `record_stops`, so does a stop by a signal: under torchrun, for rank 0 to name a peer
    stopped from outside, see torchrun.blame_a_peer)."""
    try:
        fn()
        return 0
    except Preempted as exc:
        log.warning("ddpexp: %s", exc)
        return exc.code
    except Interrupted as exc:
        if record_stops:
            sent_by = senders.sender(exc.code - 128)
            _write_error(ctx, exc, user_error=False, code=exc.code, sent_by=sent_by)
        return exc.code
    except KeyboardInterrupt:
        if record_stops:  # SIGINT, from torchrun's agent (Ctrl-C, `timeout -s INT`) or from outside
            stop = Interrupted(128 + signal.SIGINT)
            _write_error(ctx, stop, user_error=False, code=stop.code, sent_by=senders.sender(signal.SIGINT))
        return 130
    except UserError as exc:
        _write_error(ctx, exc, user_error=True, code=UserError.exit_code)
        log.error("ddpexp: error: %s", exc)
        return UserError.exit_code
    except BaseException as exc:
        _write_error(ctx, exc, user_error=False, code=1)
        traceback.print_exc()
        return 1


def _write_error(
    ctx: RunContext, exc: BaseException, *, user_error: bool, code: int, sent_by: int | None = None
) -> None:
    """`sent_by`: for a stop by a signal, the pid that sent it (launch/senders.py), and this process's
    parent beside it: whether its launcher stopped it or something else did."""
    record = {
        "rank": ctx.rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": str(exc),
        "user_error": user_error,
        "exit_code": code,
        "traceback": "".join(traceback.format_exception(exc)),
    }
    if sent_by is not None:
        record |= {"sent_by": sent_by, "parent": os.getppid()}
    # A run dir that cannot be written must not hide the original error.
    with contextlib.suppress(OSError):
        atomic_write_text(error_file(ctx.run_dir, ctx.rank), json.dumps(record, indent=2))


def configure_process(ctx: RunContext, *, console: bool) -> None:
    """Logging, CPU threads and the process name (`ps` and `top` show ddpexp-rank<N>) of a worker."""
    set_process_name(f"ddpexp-rank{ctx.rank}")
    handler = logging.StreamHandler(sys.stdout if console else sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(message)s" if console else "%(asctime)s rank%(rank)s %(name)s: %(message)s")
    )
    handler.addFilter(_RankFilter(ctx.rank))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # A launcher that finds this rank hung asks for its stack (every thread) in the rank's log.
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    import torch

    # Ranks on one node share its cores; oversubscribing them slows every rank down.
    torch.set_num_threads(ctx.threads)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def set_process_name(name: str) -> None:
    if sys.platform.startswith("linux"):
        pr_set_name = 15
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


def exit_with_parent(launcher_pid: int) -> None:
    """Never outlive the launcher: if it dies (even by SIGKILL), this worker dies too. The worker's
    parent is the launcher (spawned) or its forkserver, which exits the moment the launcher does."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)

    def orphaned() -> bool:
        return os.getppid() != parent or not _alive(launcher_pid)

    if orphaned():  # the launcher died before we got here
        os._exit(1)

    def watch() -> None:  # portable fallback, and a second line of defence
        while True:
            time.sleep(0.5)
            if orphaned():
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ddpexp-parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether `pid` still runs: a dead launcher its own parent has not reaped yet (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    return True


def _release_forkserver() -> None:
    """A forked worker inherits the write end of the pipe by which the forkserver learns that the
    launcher is gone; holding it would keep the server alive, and the server is the parent this
    worker watches, so neither would ever exit after a SIGKILLed launcher."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def forked_main(spec: WorkerSpec) -> None:
    """A self-launched worker, in the process the launcher's multiprocessing context started: take the
    launcher's environment and the rank's log, then run as any worker does."""
    # Its own process group, stopped with its DataLoader children and out of the terminal's Ctrl-C, but
    # in the command's session: the autogroup scheduler gives a session one share of a busy CPU, and a
    # session per rank would give a run of N ranks N shares against a one-process run's one.
    os.setpgid(0, 0)
    # rank 0 writes to the terminal from outside its foreground group (a terminal with `stty tostop`)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # its forkserver's is blocked (warmup.py)
    set_process_name(f"ddpexp-rank{spec.rank}")
    _release_forkserver()
    log_fd = os.open(spec.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(spec.console.fileno() if spec.console is not None else log_fd, 1)
    os.dup2(log_fd, 2)
    for fd in (log_fd, null_fd):
        os.close(fd)
    if spec.console is not None:
        spec.console.close()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(spec.env)
    main(spec.job, Heartbeat(spec.heartbeat))


def main(job_dict: dict[str, Any], heartbeat: Heartbeat) -> None:
    """A self-launched worker: its job as the launcher handed it over, its heartbeat the launcher's."""
    launcher = int(os.environ[PARENT_PID_ENV])
    exit_with_parent(launcher)
    job = Job.from_dict(job_dict)
    signals = forward_to_launcher(heartbeat, launcher) if job.checkpoint_on_signal else sigterm_raises()
    with signals:
        ctx = RunContext.for_process(job, heartbeat=heartbeat)
        configure_process(ctx, console=ctx.is_main)
        url = os.environ.get(INIT_URL_ENV, "env://")
        code = run_guarded(lambda: execute(job, ctx, url=url), ctx)
    exit_now(code)

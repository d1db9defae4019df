"""One worker process from start to exit code.

Self-launched workers start here (`python -m ddpexp.worker`, the run directory in DDPEXP_RUN_DIR);
torchrun workers and in-process runs enter through `execute`/`run_guarded`. A worker never calls
Hydra and never reads the user's command line: its job comes from the run directory or from rank 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from .context import RunContext
from .errors import UserError
from .fsutil import atomic_write_text
from .job import Job

log = logging.getLogger("ddpexp")


class Interrupted(Exception):
    """Raised in the main thread when the worker is asked to stop (SIGTERM)."""

    interrupted = True

    def __init__(self, code: int) -> None:
        super().__init__(f"stopped by signal (exit {code})")
        self.code = code


def execute(job: Job, ctx: RunContext, *, url: str | None = None, store: Any = None) -> dict[str, float]:
    """Join the process group (if the strategy has one), train, leave the group."""
    from . import distributed, train

    if job.plan.backend is not None:
        distributed.start(ctx, url=url or "env://", timeout_s=job.cfg.dist.timeout_s, store=store)
    try:
        result = train.run(job, ctx)
        distributed.finish()
        return result
    finally:
        distributed.stop()


def run_guarded(fn: Callable[[], object], ctx: RunContext) -> int:
    """Run `fn` and turn its outcome into an exit code; failures leave an error file for the launcher."""
    try:
        fn()
        return 0
    except Interrupted as exc:
        return exc.code
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        _write_error(ctx, exc, user_error=True)
        log.error("ddpexp: error: %s", exc)
        return UserError.exit_code
    except BaseException as exc:
        _write_error(ctx, exc, user_error=False)
        traceback.print_exc()
        return 1


def error_file(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"rank{rank}.error.json"


def _write_error(ctx: RunContext, exc: BaseException, *, user_error: bool) -> None:
    record = {
        "rank": ctx.rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": str(exc),
        "user_error": user_error,
        "traceback": "".join(traceback.format_exception(exc)),
    }
    # A run dir that cannot be written must not hide the original error.
    with contextlib.suppress(OSError):
        atomic_write_text(error_file(ctx.run_dir, ctx.rank), json.dumps(record, indent=2))


def configure_process(ctx: RunContext, *, console: bool) -> None:
    """Logging and CPU threads for a worker process."""
    level = logging.INFO
    handler = logging.StreamHandler(sys.stdout if console else sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(message)s" if console else "%(asctime)s rank%(rank)s %(name)s: %(message)s")
    )
    handler.addFilter(_RankFilter(ctx.rank))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # Ranks on one node share its cores; oversubscribing them slows every rank down.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def raise_on_sigterm() -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def exit_with_parent(parent_pid: int) -> None:
    """Never outlive the launcher: if it dies (even by SIGKILL), this worker dies too."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the launcher died before we got here
        os._exit(1)

    def watch() -> None:  # portable fallback, and a second line of defence
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ddpexp-parent-watch", daemon=True).start()


def main() -> None:
    run_dir = Path(os.environ["DDPEXP_RUN_DIR"])
    exit_with_parent(int(os.environ["DDPEXP_PARENT_PID"]))
    raise_on_sigterm()
    job = Job.load(run_dir)
    ctx = RunContext.for_process(job.plan, run_dir)
    configure_process(ctx, console=ctx.is_main)
    url = os.environ.get("DDPEXP_INIT_URL", "env://")
    sys.exit(run_guarded(lambda: execute(job, ctx, url=url), ctx))


if __name__ == "__main__":
    main()

"""Run a job: in this process, or as N supervised worker processes on this node.

Supervision is what keeps a distributed run from hanging or leaking processes:
- a worker that fails (exception or signal) gets the others stopped at once, and the user sees the
  failing rank's own error first, not the echoes it caused in the other ranks;
- Ctrl-C / SIGTERM to the launcher stops every worker (SIGTERM, then SIGKILL after a grace period)
  and exits 130 / 143;
- workers die with the launcher even if it is SIGKILLed (see worker.exit_with_parent).
Each worker runs in its own session so it can be stopped together with its DataLoader children.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from .errors import UserError
from .fsutil import atomic_write_text
from .job import Job
from .recorder import METRICS_FILE

log = logging.getLogger("ddpexp")

POLL_S = 0.05
GRACE_S = 5.0


def run(job: Job) -> int:
    if job.plan.launcher == "inprocess":
        return run_inprocess(job)
    return spawn(job)


def run_inprocess(job: Job) -> int:
    from .context import RunContext
    from .worker import Interrupted, execute, run_guarded

    ctx = RunContext.for_process(job.plan, job.run_dir, env={})
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code = run_guarded(lambda: execute(job, ctx), ctx)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code not in (0, 130, 143):
        _report_inprocess_failure(job.run_dir)
    return code


def _report_inprocess_failure(run_dir: Path) -> None:
    from .worker import error_file

    path = error_file(run_dir, 0)
    if path.exists():
        record = json.loads(path.read_text())
        if not record["user_error"]:
            print(f"ddpexp: the run failed: {record['type']}: {record['message']}", file=sys.stderr)


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def port_is_free(addr: str, port: int) -> bool:
    """Whether a rendezvous server could listen on the port now. SO_REUSEADDR, as torch's TCPStore sets
    it: connections of a finished run linger in TIME_WAIT for a minute and must not count as "in use"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    exit_time: float | None = None


def spawn(job: Job) -> int:
    """Start the workers and supervise them; after a failure, restart them up to dist.max_restarts
    times (each attempt resumes from the run's newest valid checkpoint, see train.find_checkpoint)."""
    restarts = job.cfg.dist.max_restarts
    attempt = 0
    while True:
        code = _spawn_attempt(job, attempt)
        if code in (0, UserError.exit_code, 130, 143) or attempt == restarts:
            return code
        attempt += 1
        print(
            f"ddpexp: restarting the workers ({attempt} of {restarts} restarts) from the newest checkpoint",
            file=sys.stderr,
            flush=True,
        )
        _archive_errors(job.run_dir, attempt - 1)


def _spawn_attempt(job: Job, attempt: int) -> int:
    cfg = job.cfg
    addr = cfg.dist.master_addr
    port = cfg.dist.master_port or free_port(addr)
    if cfg.dist.master_port and not port_is_free(addr, port):
        raise UserError(
            f"port {port} is already in use",
            setting="dist.master_port",
            fix="pick another port or leave it unset",
        )
    logs = job.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    url = _init_url(job, addr, port)
    try:
        workers = [
            _start_worker(job, rank, addr=addr, port=port, url=url, logs=logs, attempt=attempt)
            for rank in range(job.plan.world_size)
        ]
        return Supervisor(job, workers).wait()
    finally:
        if job.plan.init == "file":
            init_file(job).unlink(missing_ok=True)


def _archive_errors(run_dir: Path, attempt: int) -> None:
    """A failed attempt's error records move aside, so the next attempt's root cause is its own."""
    for path in (run_dir / "logs").glob("rank*.error.json"):
        path.rename(path.with_name(path.name.replace(".error.json", f".attempt{attempt}.error.json")))


def init_file(job: Job) -> Path:
    """init=file: the rendezvous file every rank opens (dist.init_file, or a fresh one in the run dir)."""
    configured = job.cfg.dist.init_file
    return Path(configured).resolve() if configured else job.run_dir / "rendezvous"


def _init_url(job: Job, addr: str, port: int) -> str:
    """How the workers find each other: env:// (MASTER_ADDR/PORT), tcp://addr:port, or file:///path."""
    if job.plan.init == "tcp":
        return f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"
    if job.plan.init == "file":
        path = init_file(job)
        if path.exists():  # pre-flight checked; another run may have created it since
            raise UserError(
                f"rendezvous file {path} already exists (a stale file would join the wrong run)",
                setting="dist.init_file",
                fix="delete it if no run uses it, or choose another dist.init_file",
            )
        return f"file://{path}"
    return "env://"


def _start_worker(job: Job, rank: int, *, addr: str, port: int, url: str, logs: Path, attempt: int) -> Worker:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(job.plan.world_size),
        LOCAL_WORLD_SIZE=str(job.plan.nprocs_per_node),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        DDPEXP_RUN_DIR=str(job.run_dir),
        DDPEXP_PARENT_PID=str(os.getpid()),
        DDPEXP_INIT_URL=url,
        DDPEXP_ATTEMPT=str(attempt),
        DDPEXP_TTY="1" if sys.stdout.isatty() else "0",
        PYTHONUNBUFFERED="1",
    )
    log_path = logs / f"rank{rank}.log"
    log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    stdout: Any = subprocess.PIPE if rank == 0 else log_file
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpexp.worker"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=log_file,
        start_new_session=True,
    )
    log_file.close()
    worker = Worker(rank=rank, proc=proc, log_path=log_path)
    if proc.stdout is not None:
        threading.Thread(
            target=_tee, args=(proc.stdout, log_path), name=f"tee-rank{rank}", daemon=True
        ).start()
    return worker


def _tee(pipe: IO[bytes], log_path: Path) -> None:
    """Rank 0's console output: to the user's terminal and to its log file, as it comes."""
    out = getattr(sys.stdout, "buffer", None)
    with open(log_path, "ab") as log_file:
        while chunk := os.read(pipe.fileno(), 65536):
            log_file.write(chunk)
            log_file.flush()
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stdout.write(chunk.decode(errors="replace"))
    pipe.close()


class Supervisor:
    def __init__(self, job: Job, workers: list[Worker]) -> None:
        self.job = job
        self.workers = workers
        self.signal_received: int | None = None
        self.stopping_since: float | None = None

    def wait(self) -> int:
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop()
        finally:
            self._kill_all(signal.SIGKILL)
            for s, h in handlers.items():
                signal.signal(s, h)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_received is not None:  # second Ctrl-C: no more grace
            self._kill_all(signal.SIGKILL)
        self.signal_received = signum

    def _loop(self) -> int:
        failed: Worker | None = None
        while True:
            now = time.time()
            for w in self.workers:
                if w.exit_time is None and w.proc.poll() is not None:
                    w.exit_time = now
                    if w.proc.returncode != 0 and failed is None and self.signal_received is None:
                        failed = w
            running = [w for w in self.workers if w.exit_time is None]
            if not running:
                break
            if (failed is not None or self.signal_received is not None) and self.stopping_since is None:
                self.stopping_since = now
                self._kill_all(signal.SIGTERM)
            if self.stopping_since is not None and now - self.stopping_since > GRACE_S:
                self._kill_all(signal.SIGKILL)
            time.sleep(POLL_S)
        if self.signal_received is not None:
            self._finish_metrics(
                "interrupted", f"stopped by signal {signal.Signals(self.signal_received).name}"
            )
            return 128 + self.signal_received
        if failed is None:
            return 0
        return self._report_failure()

    def _kill_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.proc.pid, sig)

    def _report_failure(self) -> int:
        rank, summary, detail, user_error = self._root_cause()
        world = len(self.workers)
        if user_error:
            print(f"ddpexp: error: {summary}", file=sys.stderr)
        else:
            print(f"ddpexp: rank {rank} of {world} failed: {summary}", file=sys.stderr)
            if detail:
                print(detail.rstrip(), file=sys.stderr)
            logs = self.job.run_dir / "logs"
            print(f"ddpexp: the other ranks were stopped; every rank's log is in {logs}", file=sys.stderr)
        self._finish_metrics("failed", f"rank {rank}: {summary}")
        return UserError.exit_code if user_error else 1

    def _root_cause(self) -> tuple[int, str, str, bool]:
        """Which rank failed first. A rank killed by a signal nobody here sent is the cause (its peers
        only see it as a broken connection); otherwise the earliest error record wins. Ranks that died
        after the supervisor began stopping them were killed by it (a rank already on its way out when
        the SIGTERM came dies of it), so they are never the cause."""
        from .worker import error_file

        stop = self.stopping_since if self.stopping_since is not None else float("inf")
        by_signal = [
            w
            for w in self.workers
            if w.proc.returncode is not None and w.proc.returncode < 0 and (w.exit_time or 0.0) <= stop
        ]
        if by_signal:
            w = min(by_signal, key=lambda w: w.exit_time or 0.0)
            name = signal.Signals(-w.proc.returncode).name
            return w.rank, f"killed by {name}", _tail(w.log_path), False
        records = []
        for w in self.workers:
            path = error_file(self.job.run_dir, w.rank)
            if path.exists():
                records.append(json.loads(path.read_text()))
        if records:
            r = min(records, key=lambda r: r["time"])
            return (
                r["rank"],
                f"{r['type']}: {r['message']}" if not r["user_error"] else r["message"],
                r["traceback"],
                r["user_error"],
            )
        w = min((w for w in self.workers if w.proc.returncode), key=lambda w: w.exit_time or 0.0)
        return w.rank, f"exited with code {w.proc.returncode}", _tail(w.log_path), False

    def _finish_metrics(self, status: str, error: str) -> None:
        """Make metrics.json say how the run ended, even if rank 0 could not write it itself."""
        path = self.job.run_dir / METRICS_FILE
        metrics: dict[str, Any] = {}
        if path.exists():
            try:
                metrics = json.loads(path.read_text())
            except ValueError:
                metrics = {}
        if not metrics:
            metrics = {
                "facts": {**self.job.plan.to_dict(), **self.job.choices},
                "final": {},
                "best": {},
                "history": [],
            }
        metrics["status"] = status
        metrics["error"] = error
        atomic_write_text(path, json.dumps(metrics, indent=2, sort_keys=True))


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""

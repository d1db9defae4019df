"""Self-launch: start one worker process per rank on this node and supervise them; after a failure,
restart the group up to dist.max_restarts times.

Workers are forked from a multiprocessing forkserver that has imported torch and ddpexp once
(dist.start_method=forkserver, the default): each worker then starts in a fraction of a second instead
of importing torch again (~2.6 s per process, and once per sweep instead of once per job). The server
only imports modules, it never runs torch ops or threads, so forking it is safe; `spawn` starts a
fresh interpreter per worker instead. Either way each worker:
- runs in its own session, so it can be stopped together with its DataLoader children;
- gets the launcher's current environment, working directory and sys.path, plus its rank's variables;
- writes stdout and stderr to logs/rank<N>.log (rank 0's stdout also reaches the console);
- dies with the launcher even if the launcher is SIGKILLed (see worker.exit_with_parent).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..config import StartMethod
from ..context import ATTEMPT_ENV, PARENT_PID_ENV, TTY_ENV
from ..errors import UserError
from ..heartbeat import Pulse, shared_cell
from ..job import Job
from . import rendezvous
from .error_records import set_aside_errors
from .supervise import Supervisor, Watch, Worker
from .warmup import callers_script_hidden, forkserver_context, server_pid
from .worker import INIT_URL_ENV, WorkerSpec, forked_main


def context(method: StartMethod) -> Any:
    """The multiprocessing context workers start from (one forkserver per launcher process, see
    warmup.py)."""
    if StartMethod(method) == StartMethod.forkserver:
        return forkserver_context()
    return multiprocessing.get_context(StartMethod(method).value)


def spawn(job: Job, *, node_rank: int = 0) -> int:
    """Start this node's workers and supervise them; after a failure, restart them up to
    dist.max_restarts times (each attempt resumes from the run's newest valid checkpoint, see
    resume.find_checkpoint). Node `node_rank` > 0 of a multi-node run (launch/nodes.py) joins node 0's
    run: node 0 owns the port, the rendezvous file and metrics.json."""
    restarts = job.cfg.dist.max_restarts
    attempt = 0
    while True:
        code = _spawn_attempt(job, attempt, node_rank)
        if code in (0, UserError.exit_code, 130, 143) or attempt == restarts:
            return code
        attempt += 1
        print(
            f"ddpexp: restarting the workers ({attempt} of {restarts} restarts) from the newest checkpoint",
            file=sys.stderr,
            flush=True,
        )
        set_aside_errors(job.run_dir)


def _spawn_attempt(job: Job, attempt: int, node_rank: int) -> int:
    cfg = job.cfg
    addr = cfg.dist.master_addr
    port = cfg.dist.master_port or rendezvous.free_port(addr)
    leads = node_rank == 0
    if leads and cfg.dist.master_port and not rendezvous.port_is_free(addr, port):
        raise UserError(
            f"port {port} is already in use",
            setting="dist.master_port",
            fix="pick another port or leave it unset",
        )
    logs = job.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rendezvous_file = rendezvous.init_file(cfg.dist, job.run_dir)
    if leads and job.plan.init == "file" and cfg.dist.init_file is None:
        # The run dir's own file: this launcher holds the dir's claim, so one left there is a crashed
        # attempt's (a resume, a restart), never another live run's.
        rendezvous_file.unlink(missing_ok=True)
    url = rendezvous.init_url(
        job.plan.init, addr=addr, port=port, rendezvous_file=rendezvous_file, joining=not leads
    )
    env = {
        **os.environ,
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(job.plan.world_size),
        "LOCAL_WORLD_SIZE": str(job.plan.nprocs_per_node),
        PARENT_PID_ENV: str(os.getpid()),
        INIT_URL_ENV: url,
        ATTEMPT_ENV: str(attempt),
        TTY_ENV: "1" if sys.stdout.isatty() else "0",
        "PYTHONUNBUFFERED": "1",
    }
    ctx = context(cfg.dist.start_method)
    first = node_rank * job.plan.nprocs_per_node
    try:
        spec = job.to_dict()
        workers = [
            _start_worker(ctx, first + local, local, env, logs, spec)
            for local in range(job.plan.nprocs_per_node)
        ]
        hang = cfg.dist.hang_timeout_s
        watch = Watch(hang_s=hang, patience_s=max(cfg.dist.timeout_s, hang)) if hang is not None else None
        return Supervisor(
            job.run_dir,
            workers,
            facts=job.summary(),
            records=leads,
            watch=watch,
            checkpoint_on_signal=job.checkpoint_on_signal,
            forkserver=server_pid() if StartMethod(cfg.dist.start_method) == StartMethod.forkserver else None,
        ).wait()
    finally:
        if job.plan.init == "file" and leads:
            rendezvous_file.unlink(missing_ok=True)


def _start_worker(
    ctx: Any, rank: int, local_rank: int, common: dict[str, str], logs: Path, job: dict[str, Any]
) -> Worker:
    env = {**common, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    log_path = logs / f"rank{rank}.log"
    log_from = log_path.stat().st_size if log_path.exists() else 0
    reader, writer = ctx.Pipe(duplex=False) if rank == 0 else (None, None)
    cell = shared_cell(ctx)
    spec = WorkerSpec(rank=rank, env=env, log_path=str(log_path), console=writer, job=job, heartbeat=cell)
    proc = ctx.Process(
        target=forked_main,
        args=(spec,),
        name=f"ddpexp-rank{rank}",
        daemon=False,
    )
    with callers_script_hidden() if not _names_main(job["config"]) else contextlib.nullcontext():
        proc.start()
    tee = None
    if reader is not None and writer is not None:
        writer.close()  # the worker holds its own copy; the pipe ends when the worker does
        tee = threading.Thread(target=_tee, args=(reader, log_path), name=f"tee-rank{rank}", daemon=True)
        tee.start()
    pulse = Pulse(cell, time.time())
    return Worker(rank=rank, proc=_Proc(proc), log_path=log_path, tee=tee, pulse=pulse, log_from=log_from)


def _names_main(config: Any) -> bool:
    """Whether the resolved config names something defined in the caller's script (`model._target_=
    __main__.Net`): then the workers need the script, run as multiprocessing runs it (which takes the
    `if __name__ == "__main__":` guard every multiprocessing program needs)."""
    if isinstance(config, dict):
        return any(_names_main(value) for value in config.values())
    if isinstance(config, list):
        return any(_names_main(value) for value in config)
    return isinstance(config, str) and config.startswith("__main__.")


class _Proc:
    """A multiprocessing.Process seen through the few members of subprocess.Popen the supervisor uses."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.pid: int = proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode  # None while running; -N if killed by signal N, like Popen

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode


def _tee(reader: Any, log_path: Path) -> None:
    """Rank 0's console output: to the user's terminal and to its log file, as it comes."""
    out = getattr(sys.stdout, "buffer", None)
    with open(log_path, "ab") as log_file:
        while chunk := os.read(reader.fileno(), 65536):
            log_file.write(chunk)
            log_file.flush()
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stdout.write(chunk.decode(errors="replace"))
    reader.close()

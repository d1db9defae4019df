"""Running as a worker of torchrun (or another torch launcher that sets RANK, WORLD_SIZE, ...).

Only global rank 0 composes the config and creates the run directory ("leader"); it hands the resolved
job to every other rank ("followers") through torchrun's rendezvous store, so there is one composition
and one run directory however many ranks and nodes there are. torchrun keeps its store across
--max-restarts, so a restarted rank 0 takes the job it already published and the run continues.

torchrun's agent, not ddpexp, watches the workers; when rank 0 fails because a peer ended (killed, or
stopped by a signal from outside), rank 0 only sees a broken connection. Every rank says in the store
where it runs, so that rank 0 can then name the peer that ended first in metrics.json and on the
console (`blame_a_peer`; peers on other machines cannot be seen from rank 0's).

torch.distributed.launch (deprecated upstream, still in many tutorials) starts workers the same way
and also passes `--local-rank=N` on their command line: `take_local_rank` takes it out before Hydra
reads the arguments. The command line imports this module before `--help`, so it stays light: torch
and the rest of ddpexp are imported where they are used.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import UserError

if TYPE_CHECKING:
    from pathlib import Path

    from ..job import Job

JOB_KEY = "ddpexp/job"
PEER_KEY = "ddpexp/peer"  # /<restart>/<rank>: where that rank runs (host, pid, start time)
# At most, how long rank 0 waits, once it has failed itself, for each peer to say how it ended (its
# error record) or to end: a peer stopped from outside records why only after unwinding, which on a
# busy machine took longer than the 2 s this once was.
PEER_WAIT_S = 30.0
STORE_TIMEOUT_S = 900.0
_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_LOCAL_RANK_FLAGS = ("--local-rank", "--local_rank")  # torch >= 2.0 passes the first, older ones the second


def take_local_rank(argv: list[str], env: MutableMapping[str, str] | None = None) -> list[str]:
    """`argv` without torch.distributed.launch's `--local-rank=N` (`--local-rank N`, `--local_rank...`).
    The rank it gives must agree with LOCAL_RANK, or becomes LOCAL_RANK where the launcher set none:
    the rest of ddpexp reads LOCAL_RANK only, as under torchrun."""
    env = os.environ if env is None else env
    rest: list[str] = []
    given: str | None = None
    args = iter(argv)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if flag in _LOCAL_RANK_FLAGS:
            given = value if eq else next(args, "")
        else:
            rest.append(arg)
    if given is None:
        return rest
    if not given.isdigit():
        raise UserError(f"{given!r} is not a rank", setting="--local-rank", fix="pass --local-rank=N, N >= 0")
    if "LOCAL_RANK" in env and int(env["LOCAL_RANK"]) != int(given):
        raise UserError(
            f"--local-rank={given} disagrees with LOCAL_RANK={env['LOCAL_RANK']} set by the launcher",
            setting="--local-rank",
            fix="drop --local-rank (ddpexp reads LOCAL_RANK)",
        )
    missing = [k for k in _REQUIRED if k not in env and k != "LOCAL_RANK"]
    if missing:
        raise UserError(
            f"comes from torch.distributed.launch, which also sets {', '.join(missing)}; they are not set",
            setting="--local-rank",
            fix="run ddpexp under torchrun or torch.distributed.launch, or drop --local-rank to self-launch",
        )
    env["LOCAL_RANK"] = str(int(given))
    return rest


def rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank when torchrun (or another torch launcher) started it, else None."""
    env = os.environ if env is None else env
    if all(k in env for k in _REQUIRED):
        return int(env["RANK"])
    return None


def world(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(world size, processes on this node) as the external launcher decided, or None."""
    env = os.environ if env is None else env
    if rank(env) is None:
        return None
    return int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))


def is_follower() -> bool:
    """Ranks other than 0, and a rank 0 restarted by torchrun after it published its job: they take
    the job from the store instead of composing one."""
    r = rank()
    if r is None:
        return False
    if r != 0:
        return True
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and bool(_store().check([JOB_KEY]))


@functools.cache
def _store() -> Any:
    import torch.distributed as dist

    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(
        dist.rendezvous("env://", rank=r, world_size=w, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    )
    return store


def _pg_store(store: Any) -> Any:
    """The process group's keys, fresh for every torchrun restart (torchrun keeps its store across them)."""
    import torch.distributed as dist

    return dist.PrefixStore(f"pg/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def publish_error(exc: UserError) -> None:
    """Rank 0 refused the job: tell the followers, so they exit instead of waiting for a job."""
    _store().set(JOB_KEY, json.dumps({"error": str(exc)}))


def lead(job: Job) -> int:
    """Rank 0 under torchrun: hand the job to the other ranks, then train as rank 0."""
    from .supervise import sigterm_raises
    from .worker import exit_with_parent

    exit_with_parent(os.getppid())  # the agent: never train on as its orphan
    with sigterm_raises():
        since = time.time()
        store = _store()
        _announce(store)
        store.set(JOB_KEY, json.dumps(job.to_dict()))
        return _train(job, store, since=since)


def follow() -> int:
    """Ranks other than 0 under torchrun: wait for rank 0's resolved job (never call Hydra)."""
    from ..job import Job
    from .supervise import sigterm_raises
    from .worker import exit_with_parent

    exit_with_parent(os.getppid())  # the agent: never train on as its orphan
    with sigterm_raises():
        since = time.time()
        store = _store()
        _announce(store)
        store.wait([JOB_KEY], timedelta(seconds=STORE_TIMEOUT_S))
        payload = json.loads(store.get(JOB_KEY))
        if "error" in payload:
            return UserError.exit_code  # rank 0 printed the reason
        return _train(Job.from_dict(payload), store, since=since)


def _train(job: Job, store: Any, *, since: float) -> int:
    from ..context import RunContext
    from ..interrupts import Interrupted
    from .supervise import signals_ignored
    from .worker import configure_process, execute, run_guarded

    ctx = RunContext.for_process(job)
    configure_process(ctx, console=ctx.is_main)
    try:
        code = run_guarded(lambda: execute(job, ctx, store=_pg_store(store)), ctx, record_stops=True)
    except Interrupted as exc:  # the agent's SIGTERM (a peer has ended) came while rank 0 recorded its error
        code = exc.code
    if ctx.is_main and code not in (0, UserError.exit_code):
        with signals_ignored():  # the agent's SIGTERM, sent once a peer has ended, must not cut it short
            blame_a_peer(job, store, since=since)
    return code


def _announce(store: Any) -> None:
    """Where this rank runs, for rank 0 to tell a peer that ended from one that still runs."""
    from ..procstat import start_time

    pid = os.getpid()
    where = {"host": socket.gethostname(), "pid": pid, "started": start_time(pid)}
    store.set(f"{PEER_KEY}/{_restart()}/{os.environ['RANK']}", json.dumps(where))


def _restart() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def blame_a_peer(job: Job, store: Any, *, since: float) -> None:
    """Rank 0 failed (or the agent stopped it): if a peer on this machine ended before it (killed,
    stopped by a signal from outside, exited, or failed with an error of its own earlier), that peer
    is the run's cause, not rank 0's broken connection to it. metrics.json's error and the console
    name it; torchrun's own summary says the same only in the agent's output. A broken connection to
    peers the agent had already stopped, with no other cause, is the agent's stop: interrupted."""
    from ..recorder import finish_metrics
    from ..runrecord import read_run_record_or_none
    from .error_records import read_error

    record = read_run_record_or_none(job.run_dir)
    if record is None or record.status not in ("failed", "interrupted") or record.started_at is None:
        return
    # Stopped from outside rank 0 was, as every rank (Slurm's scancel, kill of the process group): only
    # a peer that ended without a word came first. Stopped by the agent, rank 0 was stopping because
    # some rank ended: one stopped from outside, killed, or failed on its own.
    own = read_error(job.run_dir, 0)
    by_agent = own is not None and own.get("time", 0.0) >= since and _by_agent(own)
    silent_only = record.status == "interrupted" and not by_agent
    failed_at = record.started_at + (record.wall_s or 0.0)  # when rank 0's run recorded how it ended
    host, world = socket.gethostname(), int(os.environ["WORLD_SIZE"])
    peers = {}
    for rank in range(1, world):
        key = f"{PEER_KEY}/{_restart()}/{rank}"
        if store.check([key]):
            where = json.loads(store.get(key))
            if where["host"] == host:
                peers[rank] = where
    deadline = time.monotonic() + PEER_WAIT_S
    causes: list[_PeerCause] = []
    while peers:  # until a peer is the cause, or every peer has said how it ended or has ended
        settled = True
        for rank, where in peers.items():
            error, how = _peer_state(job.run_dir, rank, where, since=since)
            cause = _peer_cause(rank, error, how, before=failed_at)
            if cause is not None and (cause.silent or not silent_only):
                causes.append(cause)
            settled = settled and (error is not None or how is not None)
        if causes or settled or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if causes and all(c.stopped_by_agent for c in causes):
        if record.status == "failed":
            why = f"{min(causes).summary}, as every rank was (rank 0 lost its peers before its own came)"
            finish_metrics(job.run_dir, "interrupted", why, facts={})
        return
    causes = [c for c in causes if not c.stopped_by_agent]
    if not causes:
        return
    first = min(causes)
    finish_metrics(job.run_dir, "failed", f"rank {first.rank}: {first.summary}", facts={})
    print(f"ddpexp: rank {first.rank} of {world} {first.summary}; rank 0 failed after it", file=sys.stderr)


def _by_agent(error: dict[str, Any]) -> bool:
    """Whether a rank's recorded stop was sent by its parent, torchrun's agent (launch/senders.py)."""
    return error.get("sent_by") is not None and error["sent_by"] == error.get("parent")


def stopped_by_agent(signum: int) -> str:
    return f"stopped by {signal.Signals(signum).name} from torchrun's agent"


class _PeerCause(NamedTuple):
    order: int  # 0: ended by a signal or without a word; 1: an error of its own (its record's time)
    time: float
    rank: int
    summary: str
    silent: bool = False  # it left no record: killed, or os._exit
    stopped_by_agent: bool = False  # torchrun's agent stopped it, as it stops every rank


def _peer_state(
    run_dir: Path, rank: int, where: dict[str, Any], *, since: float
) -> tuple[dict[str, Any] | None, str | None]:
    """What `rank` has said of how it ended (this attempt's error record), and, without one, how the
    OS says it ended (None while it runs)."""
    from ..procstat import how_it_ended
    from .error_records import read_error

    error = read_error(run_dir, rank)
    if error is not None and error.get("time", 0.0) < since:
        error = None  # an earlier attempt's
    if error is not None:
        return error, None
    return None, how_it_ended(where["pid"], where["started"])


def _peer_cause(
    rank: int, error: dict[str, Any] | None, how: str | None, *, before: float
) -> _PeerCause | None:
    """What rank 0 blames on `rank` from its state (_peer_state): that it was stopped by a signal,
    failed on its own before `before`, or ended without a word (killed, os._exit); None while it
    runs, or when its failure echoes rank 0's."""
    from .error_records import error_summary
    from .supervise import stopped_from_outside

    if error is not None and error["type"] == "Interrupted":
        signum = error["exit_code"] - 128
        if _by_agent(error):  # stopped with every rank: it explains only a broken connection after it
            if error["time"] >= before:
                return None
            return _PeerCause(0, error["time"], rank, stopped_by_agent(signum), stopped_by_agent=True)
        return _PeerCause(0, error["time"], rank, stopped_from_outside(signum))
    if error is not None:
        return _PeerCause(1, error["time"], rank, error_summary(error)) if error["time"] < before else None
    if how is None:
        return None
    said = how if how != "ended" else "ended without an error of its own (torchrun's summary says how)"
    return _PeerCause(0, 0.0, rank, f"failed: {said}", silent=True)

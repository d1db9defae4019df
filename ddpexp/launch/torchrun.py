"""Running as a worker of torchrun (or another torch launcher that sets RANK, WORLD_SIZE, ...).

Only global rank 0 composes the config and creates the run directory ("leader"); it hands the resolved
job to every other rank ("followers") through torchrun's rendezvous store, so there is one composition
and one run directory however many ranks and nodes there are. torchrun keeps its store across
--max-restarts, so a restarted rank 0 takes the job it already published and the run continues.

torch.distributed.launch (deprecated upstream, still in many tutorials) starts workers the same way
and also passes `--local-rank=N` on their command line: `take_local_rank` takes it out before Hydra
reads the arguments. The command line imports this module before `--help`, so it stays light: torch
and the rest of ddpexp are imported where they are used.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import UserError

if TYPE_CHECKING:
    from ..job import Job

JOB_KEY = "ddpexp/job"
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
    from ..context import RunContext
    from .supervise import sigterm_raises
    from .worker import configure_process, execute, exit_with_parent, run_guarded

    exit_with_parent(os.getppid())  # the agent: never train on as its orphan
    with sigterm_raises():
        store = _store()
        store.set(JOB_KEY, json.dumps(job.to_dict()))
        ctx = RunContext.for_process(job)
        configure_process(ctx, console=True)
        return run_guarded(lambda: execute(job, ctx, store=_pg_store(store)), ctx)


def follow() -> int:
    """Ranks other than 0 under torchrun: wait for rank 0's resolved job (never call Hydra)."""
    from ..context import RunContext
    from ..job import Job
    from .supervise import sigterm_raises
    from .worker import configure_process, execute, exit_with_parent, run_guarded

    exit_with_parent(os.getppid())  # the agent: never train on as its orphan
    with sigterm_raises():
        store = _store()
        store.wait([JOB_KEY], timedelta(seconds=STORE_TIMEOUT_S))
        payload = json.loads(store.get(JOB_KEY))
        if "error" in payload:
            return UserError.exit_code  # rank 0 printed the reason
        job = Job.from_dict(payload)
        ctx = RunContext.for_process(job)
        configure_process(ctx, console=ctx.is_main)
        return run_guarded(lambda: execute(job, ctx, store=_pg_store(store)), ctx)

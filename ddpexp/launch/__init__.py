"""Launching a job: in this process, as N supervised worker processes, or as a torchrun worker.

rendezvous   free ports, the port check, init URLs (all pre-flight needs of the launcher)
spawn        start one worker per rank on this node, restart the group after a failure
nodes        self-launch on several machines: node 0 serves its job, the other nodes join its run dir
supervise    watch the workers, stop them all on a failure or a signal, blame the right rank
torchrun     rank 0 composes and publishes the job in torchrun's store; the other ranks read it
             (also torch.distributed.launch, whose --local-rank argument it takes out of argv)
worker       one worker process from start to exit code
warmup       the forkserver workers fork from: started before pre-flight, killed if no job needs it
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kept light: the command line imports launch.torchrun before --help
    from ..job import Job


def run(job: Job) -> int:
    """Run one job to its exit code, the way its plan says."""
    from .error_records import set_aside_errors

    set_aside_errors(job.run_dir)  # an earlier command's records (a resumed run) explain nothing now
    if job.plan.launcher == "torchrun":
        from .torchrun import lead

        return lead(job)
    if job.plan.launcher == "spawn" and job.cfg.dist.nnodes > 1:
        from .nodes import lead as lead_nodes

        return lead_nodes(job)  # node 0; the other nodes join through nodes.follow, without Hydra
    if job.plan.launcher == "spawn":
        from .spawn import spawn

        return spawn(job)
    return run_inprocess(job)


def run_inprocess(job: Job) -> int:
    import torch

    from ..context import RunContext
    from .error_records import error_file
    from .supervise import CHECKPOINT_SIGNALS, STOP_SIGNALS, checkpoint_then_stop, sigterm_raises
    from .worker import execute, run_guarded

    ctx = RunContext.in_this_process(job)
    threads = torch.get_num_threads()
    torch.set_num_threads(ctx.threads)  # given back after the run: this process may be a notebook's
    try:
        # Every signal that stops a launcher stops this run by its name (Ctrl-C: KeyboardInterrupt).
        stops = [s for s in STOP_SIGNALS[1:] if not (job.checkpoint_on_signal and s in CHECKPOINT_SIGNALS)]
        with (
            checkpoint_then_stop(ctx.heartbeat) if job.checkpoint_on_signal else contextlib.nullcontext(),
            sigterm_raises(tuple(stops)),
        ):
            code = run_guarded(lambda: execute(job, ctx), ctx)
    finally:
        torch.set_num_threads(threads)
    path = error_file(job.run_dir, 0)
    if code not in (0, 130, 143) and path.exists():
        record = json.loads(path.read_text())
        if not record["user_error"]:
            print(f"ddpexp: the run failed: {record['type']}: {record['message']}", file=sys.stderr)
    return code

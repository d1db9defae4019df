"""Self-launch on several machines (dist.nnodes > 1), as the tutorials do with mp.spawn on each one.

Every machine runs the same command with its own dist.node_rank and starts dist.nprocs workers, global
ranks node_rank x nprocs + local rank. Only node 0 composes the job and makes the run directory (Hydra,
as on one machine). Its launcher then serves the resolved job (config, plan, run directory) from a
TCPStore at dist.master_addr, port dist.master_port + 1, while its workers run; dist.master_port itself
is the workers' rendezvous. The launcher of every other node checks its own command line in pre-flight,
takes node 0's job from that store and spawns its workers into node 0's run directory, which must
therefore be on a filesystem every node mounts at the same path. Only global rank 0 writes results
(metrics.json, checkpoints, TensorBoard); every worker writes its own logs/rank<N>.log there.

A failure stops the failing node's workers (its supervisor); the workers on the other nodes see their
next collective fail (within dist.timeout_s at worst), so every launcher exits non-zero.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import UserError

if TYPE_CHECKING:
    from ..job import Job, Outcome
    from ..plan import Plan

JOB_KEY = "ddpexp/job"
POLL_S = 0.2


def store_port(dist_cfg: Any) -> int:
    """Where node 0's launcher hands the job over: the port after the workers' rendezvous port."""
    return int(dist_cfg.master_port) + 1


def lead(job: Job) -> int:
    """Node 0: serve the job to the other nodes' launchers, and run this node's workers."""
    import torch.distributed as dist

    from .spawn import spawn

    d = job.cfg.dist
    try:
        store = dist.TCPStore(
            d.master_addr,
            store_port(d),
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=d.timeout_s),
        )
    except RuntimeError as exc:
        raise UserError(
            f"node 0 cannot listen on {d.master_addr}:{store_port(d)} to hand the job to the other nodes",
            setting="dist.master_port",
            fix="pick a dist.master_port whose next port is free too, on every node's command line",
        ) from exc
    store.set(JOB_KEY, json.dumps(job.to_dict()))
    return spawn(job)  # the store lives as long as this node's workers do


def follow(cfg: Any, plan: Plan) -> Outcome:
    """Node 1, 2...: take node 0's job and run this node's workers in node 0's run directory. `cfg` and
    `plan` are this node's own (pre-flight checked them): they must agree with node 0's layout."""
    from ..job import CONFIG_FILE, Outcome
    from .spawn import spawn

    d = cfg.dist
    job = _fetch(d)
    theirs = job.plan
    if (theirs.world_size, theirs.nprocs_per_node) != (plan.world_size, plan.nprocs_per_node):
        raise UserError(
            f"this node plans {plan.world_size // plan.nprocs_per_node} nodes x {plan.nprocs_per_node} "
            f"processes, node 0 {theirs.world_size // theirs.nprocs_per_node} x {theirs.nprocs_per_node}",
            setting="dist.nnodes/dist.nprocs",
            fix="give every node the same dist.nnodes and dist.nprocs",
        )
    if not (job.run_dir / CONFIG_FILE).exists():
        raise UserError(
            f"node 0's run directory {job.run_dir} is not visible on this machine",
            setting="hydra.run.dir",
            fix="put runs on a filesystem every node mounts at the same path (hydra.run.dir=/shared/...)",
        )
    print(f"ddpexp: node {d.node_rank} of {d.nnodes} joins the run in {job.run_dir}", flush=True)
    return Outcome(run_dir=job.run_dir, exit_code=spawn(job, node_rank=d.node_rank))


def _fetch(d: Any) -> Job:
    """Node 0's job, once its launcher serves it (it may start later than this one); each node_rank
    joins once."""
    import torch.distributed as dist

    from ..job import Job

    addr, port = d.master_addr, store_port(d)
    refused = UserError(
        f"node 0's launcher at {addr}:{port} did not hand over the job within dist.timeout_s={d.timeout_s:g}",
        setting="dist.master_addr",
        fix=f"start node 0 (dist.node_rank=0) with dist.master_addr={addr} dist.master_port={d.master_port}, "
        "reachable from this machine",
    )
    deadline = time.monotonic() + d.timeout_s
    while not _accepts(addr, port):  # quietly: torch's client logs every failed try with a stack
        if time.monotonic() > deadline:
            raise refused
        time.sleep(POLL_S)
    try:
        store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=d.timeout_s))
        payload = json.loads(store.get(JOB_KEY))
        first = store.add(f"ddpexp/node{d.node_rank}", 1) == 1
    except RuntimeError as exc:
        raise refused from exc
    if not first:
        raise UserError(
            f"another machine already joined this run as node {d.node_rank}",
            setting="dist.node_rank",
            fix=f"give each machine its own dist.node_rank from 1 to {d.nnodes - 1}",
        )
    return Job.from_dict(payload)


def _accepts(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False

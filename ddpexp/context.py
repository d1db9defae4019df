"""Runtime facts of one worker: who am I, on which devices, writing where, since when. Never config.

This is the one place (with the launcher) that reads the process environment: the rest of the code
gets these facts from the context it is handed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import host
from .heartbeat import Heartbeat
from .plan import Plan

if TYPE_CHECKING:
    from .job import Job

# Set by the launcher for the workers it starts.
TTY_ENV = "DDPEXP_TTY"
ATTEMPT_ENV = "DDPEXP_ATTEMPT"
FAULT_ENV = "DDPEXP_FAULT"
THREADS_ENV = "OMP_NUM_THREADS"
PARENT_PID_ENV = "DDPEXP_PARENT_PID"  # the launcher of a self-launched worker


def intra_op_threads(setting: int | None, processes_on_host: int, env: Mapping[str, str]) -> int:
    """trainer.threads if set; else OMP_NUM_THREADS if the user set it; else a fair share of the
    cores: each of the processes on this host gets cores / processes (at least 1)."""
    if setting is not None:
        return setting
    if env.get(THREADS_ENV, "").isdigit() and int(env[THREADS_ENV]) > 0:
        return int(env[THREADS_ENV])
    return max(1, host.cpus() // max(1, processes_on_host))


@dataclass(frozen=True)
class RunContext:
    rank: int
    local_rank: int
    world_size: int
    devices: tuple[torch.device, ...]  # the devices this process drives (several for model parallel)
    run_dir: Path
    plan: Plan
    attempt: int = 0  # 0 for the first start; n after n automatic restarts (ddpexp's or torchrun's)
    job_started_at: float = 0.0  # when this job started (epoch seconds): time to first step counts from it
    console_is_tty: bool = False  # whether the user's console is a terminal (progress bars)
    fault: str | None = None  # DDPEXP_FAULT: a failure to inject, for tests (ddpexp/faults.py)
    heartbeat: Heartbeat = field(default_factory=Heartbeat)  # progress the launcher watches (hangs)
    threads: int = 1  # intra-op CPU threads of this process (`intra_op_threads`)
    job_pid: int | None = None  # the process that runs the job: the launcher, or this one in-process

    @property
    def device(self) -> torch.device:
        """The device batches are placed on (the first stage's device)."""
        return self.devices[0]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def in_this_process(cls, job: Job) -> RunContext:
        """Rank 0 of 1 in the launching process itself, whatever RANK/WORLD_SIZE it inherited."""
        keep = (FAULT_ENV, TTY_ENV, THREADS_ENV)
        env = {k: v for k, v in os.environ.items() if k in keep} | {PARENT_PID_ENV: str(os.getpid())}
        return cls.for_process(job, env=env, heartbeat=Heartbeat.local())

    @classmethod
    def for_process(
        cls, job: Job, env: Mapping[str, str] | None = None, heartbeat: Heartbeat | None = None
    ) -> RunContext:
        """Build the context from the torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE).

        Self-launched workers get the same variables from ddpexp's launcher, so both paths agree.
        In-process runs have none of them set and are rank 0 of 1.
        """
        env = os.environ if env is None else env
        local_rank = int(env.get("LOCAL_RANK", 0))
        tty = env[TTY_ENV] == "1" if TTY_ENV in env else sys.stdout.isatty()
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=local_rank,
            world_size=int(env.get("WORLD_SIZE", 1)),
            devices=job.plan.process_devices(local_rank),
            run_dir=job.run_dir,
            plan=job.plan,
            attempt=int(env.get(ATTEMPT_ENV) or env.get("TORCHELASTIC_RESTART_COUNT") or 0),
            job_started_at=job.started_at,
            console_is_tty=tty,
            fault=env.get(FAULT_ENV),
            heartbeat=heartbeat or Heartbeat(),
            threads=intra_op_threads(job.cfg.trainer.threads, job.plan.nprocs_per_node, env),
            job_pid=int(env[PARENT_PID_ENV]) if PARENT_PID_ENV in env else None,
        )

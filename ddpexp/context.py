"""Runtime facts of one worker: who am I, on which device, writing where. Never part of the config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .validate import Plan


@dataclass(frozen=True)
class RunContext:
    rank: int
    local_rank: int
    world_size: int
    devices: tuple[torch.device, ...]  # the devices this process drives (several for model parallel)
    run_dir: Path
    plan: Plan
    attempt: int = 0  # 0 for the first start; n after n automatic restarts (ddpexp's or torchrun's)

    @property
    def device(self) -> torch.device:
        """The device batches are placed on (the first stage's device)."""
        return self.devices[0]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def for_process(cls, plan: Plan, run_dir: Path, env: Mapping[str, str] | None = None) -> RunContext:
        """Build the context from the torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE).

        Self-launched workers get the same variables from ddpexp's launcher, so both paths agree.
        In-process runs have none of them set and are rank 0 of 1.
        """
        env = os.environ if env is None else env
        rank = int(env.get("RANK", 0))
        local_rank = int(env.get("LOCAL_RANK", 0))
        world = int(env.get("WORLD_SIZE", 1))
        k = plan.devices_per_process
        if plan.device_ids is not None:
            devices = tuple(torch.device("cuda", i) for i in plan.device_ids)
        elif plan.device_type == "cuda":
            devices = tuple(torch.device("cuda", local_rank * k + i) for i in range(k))
        else:
            devices = tuple(torch.device("cpu") for _ in range(k))
        attempt = int(env.get("DDPEXP_ATTEMPT") or env.get("TORCHELASTIC_RESTART_COUNT") or 0)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            devices=devices,
            run_dir=run_dir,
            plan=plan,
            attempt=attempt,
        )

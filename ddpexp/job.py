"""One job as the workers receive it: the resolved config, the launch plan, and where to write.

The parent writes it into the run directory as a record for people (config.yaml is the fully resolved
config; plan.json the layout decided at launch). Self-launched workers receive it from their launcher
(launch/worker.WorkerSpec), torchrun workers the same dictionary from rank 0 through the rendezvous
store, the other nodes of a self-launch node 0's through its store. Nobody but the parent calls Hydra.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config import Config
from .fsutil import atomic_write_all
from .plan import Plan

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"


def typed(container: dict[str, Any]) -> DictConfig:
    """A plain config dictionary back under the schema (attribute access, enums, validation)."""
    cfg = OmegaConf.merge(OmegaConf.structured(Config), container)
    assert isinstance(cfg, DictConfig)
    return cfg


def resolved(cfg: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    return container  # type: ignore[return-value]


@dataclass(frozen=True)
class Job:
    cfg: DictConfig
    plan: Plan
    run_dir: Path
    choices: dict[str, str] = field(default_factory=dict)  # config-group options picked, e.g. model=convnet
    started_at: float = 0.0  # when this job started (epoch seconds): its clock for time-to-first-step
    command_started_at: float | None = None  # when the command (or ddpexp.run call) that ran it began
    load_at_start: float | None = None  # the host's 1-minute load average then, before our processes
    checkpoint_on_signal: bool = False  # trainer.checkpoint_on_signal, resolved where the job starts
    varies: tuple[str, ...] = ()  # in a sweep, the override keys that differ between its jobs

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": resolved(self.cfg),
            "plan": self.plan.to_dict(),
            "run_dir": str(self.run_dir),
            "choices": self.choices,
            "started_at": self.started_at,
            "command_started_at": self.command_started_at,
            "load_at_start": self.load_at_start,
            "checkpoint_on_signal": self.checkpoint_on_signal,
            "varies": list(self.varies),
        }

    def summary(self) -> dict[str, Any]:
        """What metrics.json says about the run before (or without) rank 0 writing its facts."""
        return {**self.plan.to_dict(), **self.choices}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        return cls(
            cfg=typed(d["config"]),
            plan=Plan.from_dict(d["plan"]),
            run_dir=Path(d["run_dir"]),
            choices=d["choices"],
            started_at=d.get("started_at", 0.0),
            command_started_at=d.get("command_started_at"),
            load_at_start=d.get("load_at_start"),
            checkpoint_on_signal=d.get("checkpoint_on_signal", False),
            varies=tuple(d.get("varies", ())),
        )

    def save(self, *, with_files: dict[Path, str] | None = None) -> None:
        """The job's config and plan in its run dir, with `with_files`: all of them or none (a full
        disk leaves a resumed run's earlier files as they were)."""
        atomic_write_all({**(with_files or {}), **self.files()})

    def files(self) -> dict[Path, str]:
        """What the run dir holds of the job: its resolved config and its plan."""
        d = self.to_dict()
        return {
            self.run_dir / CONFIG_FILE: OmegaConf.to_yaml(OmegaConf.create(d["config"])),
            self.run_dir / PLAN_FILE: json.dumps(
                {k: v for k, v in d.items() if k not in ("config", "run_dir")}, indent=2
            ),
        }


@dataclass(frozen=True)
class Outcome:
    """How one job ended, as the command that ran it reports it."""

    run_dir: Path
    exit_code: int
    error: str | None = None  # a refused job's one-line reason (the launcher reports run failures itself)
    note: str | None = None  # a job with nothing to do: why (trainer.resume=auto of a completed run)

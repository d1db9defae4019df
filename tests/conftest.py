"""Helpers that drive ddpexp the way a user does: through its command line, in a scratch directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

# Small, fast, BatchNorm-free experiment used by the multi-process tests.
QUICK = ["model=mlp", "data=synthetic", "trainer.progress=false"]
# QUICK with checkpoints every 20 steps; 32 steps per epoch at batch 64, so step 45 is mid-epoch 2.
RESUME = [*QUICK, "checkpoint.every_steps=20", "optim.lr=0.05"]


class Result:
    def __init__(self, proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
        self.proc = proc
        self.cwd = cwd
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr

    def __repr__(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"

    def run_dirs(self) -> list[Path]:
        """Every directory holding a config.yaml under the scratch directory: one per job."""
        return sorted(p.parent for p in self.cwd.rglob("config.yaml") if ".hydra" not in p.parts)


def run_ddpexp(
    cwd: Path,
    *args: str,
    launcher: list[str] | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> Result:
    cmd = [*(launcher or [sys.executable, "-m"]), "ddpexp", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return Result(proc, cwd)


def metrics(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "metrics.json").read_text())


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar a run wrote: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture
def hydra_conf():
    """Hydra's compose API on ddpexp's own config tree, with the schema registered."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ddpexp.cli import conf_dir
    from ddpexp.config import register_schema

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    """`uninterrupted(strategy)`: the run dir of an uninterrupted 70-step RESUME run, made once per
    session; runs that were stopped, killed or restarted on the way to step 70 must end identical."""
    made: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in made:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{strategy}")
            result = run_ddpexp(
                tmp, f"strategy={strategy}", *RESUME, "trainer.max_steps=70", "hydra.run.dir=run"
            )
            assert result.returncode == 0, result
            made[strategy] = tmp / "run"
        return made[strategy]

    return get


def same_weights(a: Path, b: Path) -> bool:
    """Whether two runs' final model.pt files are bitwise equal."""
    import torch

    wa, wb = (torch.load(d / "model.pt", weights_only=True) for d in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(v, wb[k]) for k, v in wa.items())

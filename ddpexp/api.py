"""Running ddpexp from Python (a notebook, a script) instead of the command line:

    import ddpexp
    result = ddpexp.run(["strategy=ddp", "trainer.epochs=3"])     # one job, returns when it ends
    result.status, result.final["eval/acc"], result.run_dir
    results = ddpexp.sweep(["strategy=single,ddp"])                # one Result per job
    model = ddpexp.load_model(result.run_dir)                      # the trained plain nn.Module

The same pre-flight, run directories and launch as `python -m ddpexp`; bad input raises `UserError`
before anything starts, and a run that fails returns a Result with status "failed" (no SystemExit).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .recorder import MODEL_FILE
from .runrecord import read_run_record_or_none

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    run_dir: Path
    status: str  # completed | failed | interrupted | unknown (nothing recorded)
    exit_code: int
    final: dict[str, Any] = field(default_factory=dict)
    best: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def best_value(self) -> float | None:
        """The best value of the run's best metric (checkpoint.best_metric)."""
        return self.best.get(self.facts.get("best_metric", "eval/acc"))

    @classmethod
    def read(cls, run_dir: Path, exit_code: int) -> Result:
        record = read_run_record_or_none(run_dir)
        if record is None:
            return cls(run_dir=run_dir, status="unknown", exit_code=exit_code)
        return cls(
            run_dir=run_dir,
            status=record.status,
            exit_code=exit_code,
            final=record.final,
            best=record.best,
            facts=record.facts,
        )


def run(overrides: list[str] | None = None, *, config_dir: str | None = None) -> Result:
    """One job, as `python -m ddpexp OVERRIDES` runs it. Raises UserError for bad input."""
    (result,) = _run(list(overrides or []), multirun=False, config_dir=config_dir)
    return result


def sweep(overrides: list[str], *, config_dir: str | None = None) -> list[Result]:
    """Every job of a sweep, as `python -m ddpexp -m OVERRIDES` runs them."""
    return _run(list(overrides), multirun=True, config_dir=config_dir)


def _run(overrides: list[str], *, multirun: bool, config_dir: str | None) -> list[Result]:
    from .composition import search_path_override
    from .runner import run_command

    started_at = time.time()
    outcomes = run_command(
        overrides + search_path_override(config_dir),
        multirun=multirun,
        started_at=started_at,
        report=_log_outcome,
    )
    return [Result.read(o.run_dir, o.exit_code) for o in outcomes]


def _log_outcome(outcome: Any) -> None:
    if outcome.error:
        log.error("ddpexp: error: %s", outcome.error)
    if outcome.note:
        log.info("ddpexp: %s", outcome.note)
    log.info(
        "run dir: %s%s",
        outcome.run_dir,
        "" if outcome.exit_code == 0 else f" (exit code {outcome.exit_code})",
    )


def load_model(path: str | Path) -> nn.Module:
    """The trained model of a run directory (its model.pt, else its newest checkpoint), or of a
    checkpoint file, as a plain nn.Module on the CPU, in eval mode."""
    from omegaconf import OmegaConf

    from . import checkpoint, models
    from .errors import UserError
    from .job import CONFIG_FILE, typed
    from .preflight import instantiate_data
    from .weights import fit

    path = Path(path)
    if path.is_dir():
        found = path / MODEL_FILE if (path / MODEL_FILE).exists() else None
        newest = checkpoint.newest_valid(path) if found is None else None
        if found is None and newest is None:
            raise UserError(f"{path} holds neither {MODEL_FILE} nor a loadable checkpoint", setting="path")
        weights = checkpoint.load(found)["model"] if found is not None else newest[1]["model"]  # type: ignore[index]
        config: Any = OmegaConf.to_container(OmegaConf.load(path / CONFIG_FILE))
    else:
        state = checkpoint.load(path)
        if "config" not in state:
            raise UserError(f"{path} holds bare weights; give its run directory instead", setting="path")
        weights, config = state["model"], state["config"]
    cfg = typed(config)
    model = models.build(cfg.model, instantiate_data(cfg.data).info())
    model.load_state_dict(fit(weights, model, source=path, setting="path").state)
    return model.eval()

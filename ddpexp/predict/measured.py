"""The measured run a prediction starts from: its record (metrics.json, read through ddpexp.runrecord)
and, where the run directory is at hand, its resolved config.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..runrecord import METRICS_FILE, RunRecord, RunRecordError, read_run_record, steady


@dataclass
class MeasuredRun:
    """What a prediction reads from one run: metrics.json's facts, final values and history, and the
    resolved config.yaml where the run directory is at hand."""

    facts: dict[str, Any]
    final: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    path: Path | None = None
    config: Any = None  # the resolved config (OmegaConf), or None

    @classmethod
    def read(cls, path: Path | str) -> MeasuredRun:
        path = Path(path)
        record = _record(path) if path.is_dir() else None
        if record is None:
            raise UserError(
                f"{path} holds no {METRICS_FILE}" if path.is_dir() else f"{path} is not a directory",
                setting="RUN_DIR",
                fix="give the run directory a ddpexp run printed ('run dir: ...'), one that trained",
            )
        return cls.of_record(record)

    @classmethod
    def of_record(cls, record: RunRecord) -> MeasuredRun:
        """A run's record, with the config.yaml beside it where there is one."""
        path = record.run_dir
        config = None
        if (path / "config.yaml").is_file():
            from omegaconf import OmegaConf

            config = OmegaConf.load(path / "config.yaml")
        run = cls(record.facts, record.final, record.history, path, config)
        run.check()
        return run

    @classmethod
    def of(cls, run: Any) -> MeasuredRun:
        """A run directory, a MeasuredRun, or anything with `facts` and `final` (a report's Run,
        ddpexp.api.Result; their `run_dir`/`path` is read for the record and the config where they exist)."""
        if isinstance(run, MeasuredRun):
            return run
        if isinstance(run, (str, Path)):
            return cls.read(run)
        where = getattr(run, "run_dir", None) or getattr(run, "path", None)
        if where is not None and Path(where).is_dir() and (record := _record(Path(where))) is not None:
            return cls.of_record(record)
        facts = run["facts"] if isinstance(run, dict) else run.facts
        final = run["final"] if isinstance(run, dict) else run.final
        history = (run.get("history") if isinstance(run, dict) else getattr(run, "history", None)) or []
        measured = cls(dict(facts or {}), dict(final or {}), list(history))
        measured.check()
        return measured

    def check(self) -> None:
        where = self.path or "the run"
        if not self.facts or "world_size" not in self.facts:
            raise UserError(
                f"{where}'s metrics.json has no facts (the run stopped before training, or predates them)",
                setting="RUN_DIR",
                fix="run the job again with this ddpexp (a run of one epoch will do)",
            )
        if not self.epochs("perf/step_time_s"):
            raise UserError(
                f"{where} recorded no step time (perf/step_time_s): it trained no epoch",
                setting="RUN_DIR",
                fix="give a run that finished at least one epoch",
            )

    def epochs(self, key: str) -> list[float]:
        """`key` per epoch, the first left out when there are more (start-up: compilation, caches,
        rendezvous skew); the final value where there is no history."""
        values = [float(h[key]) for h in self.history if key in h]
        if not values and key in self.final:
            values = [float(self.final[key])]
        return steady(values)

    def mean(self, key: str) -> float:
        values = self.epochs(key)
        return sum(values) / len(values) if values else 0.0


def _record(run_dir: Path) -> RunRecord | None:
    """The run's record; None where it has none; a damaged one is the user's error to fix."""
    try:
        return read_run_record(run_dir)
    except RunRecordError as exc:
        raise UserError(str(exc), setting="RUN_DIR", fix="give a finished run") from exc

"""The record of the step-time model's held-out validation (scripts/predict_vs_measured.py --record
FILE writes it): each (strategy, W, round) predicted and measured, on which machine and when. Its
spread is the interval the planner puts around its predictions: the ratios measured / predicted seen
there, from the smallest to the largest. The record shipped with ddpexp (validation.json, beside this
module) is the last one from the development VM; a user who validates on their own hardware passes
theirs with `ddpexp plan --validation FILE`."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

SHIPPED = Path(__file__).with_name("validation.json")


@dataclass(frozen=True)
class Case:
    strategy: str
    world: int
    round: int
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        """Measured over predicted: above 1, the model was too optimistic."""
        return self.measured_s / self.predicted_s


@dataclass(frozen=True)
class Validation:
    machine: str
    date: str
    command: str
    cases: tuple[Case, ...]

    @property
    def low(self) -> float:
        return min(c.ratio for c in self.cases)

    @property
    def high(self) -> float:
        return max(c.ratio for c in self.cases)

    @property
    def median_error(self) -> float:
        return statistics.median(abs(1 / c.ratio - 1) for c in self.cases)

    @property
    def worst_error(self) -> float:
        return max(abs(1 / c.ratio - 1) for c in self.cases)

    def around(self, value: float) -> tuple[float, float]:
        """The interval the held-out runs put around a predicted time (or what scales with it)."""
        return value * self.low, value * self.high

    def describe(self) -> str:
        return (
            f"measured / predicted step time {self.low:.2f}-{self.high:.2f} over {len(self.cases)} held-out "
            f"runs ({self.machine}, {self.date})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "date": self.date,
            "command": self.command,
            "cases": [c.__dict__ for c in self.cases],
        }


def load(path: Path | None = None) -> Validation:
    """The record at `path` (the shipped one by default); a missing or damaged file is one line."""
    where = path or SHIPPED
    fix = "give a file scripts/predict_vs_measured.py --record wrote"
    try:
        data = json.loads(where.read_text())
        cases = tuple(
            Case(
                str(c["strategy"]),
                int(c["world"]),
                int(c["round"]),
                float(c["predicted_s"]),
                float(c["measured_s"]),
            )
            for c in data["cases"]
        )
        record = Validation(str(data["machine"]), str(data["date"]), str(data["command"]), cases)
    except FileNotFoundError:
        raise UserError(f"{where} does not exist", setting="--validation", fix=fix) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"{where} is not a validation record ({type(exc).__name__}: {exc})",
            setting="--validation",
            fix=fix,
        ) from None
    if not cases or any(not (c.predicted_s > 0 and c.measured_s > 0) for c in cases):
        raise UserError(
            f"{where} holds no case with positive predicted and measured times",
            setting="--validation",
            fix=fix,
        )
    return record


def save(record: Validation, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.to_json(), indent=1) + "\n")
    return path

"""The report's data: a row (runs of one configuration), a group (the rows that are compared) and the
warnings attached to them; the baseline a set of rows is measured against."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..runrecord import strategy_label
from .runs import Run

EFFICIENCY_LIMIT = 1.05  # above this, per-device speed grew with the device count: not real


@dataclass
class Flag:
    """One warning, numbered across the whole report: [number] in the table, the text below it."""

    number: int
    text: str


@dataclass
class Row:
    """Runs of one configuration that differ only in seed or repeat (or one run that did not complete)."""

    name: str
    runs: list[Run]
    label: str = ""  # the row in the table and every plot (labels.distinct_labels), set by group_runs
    efficiency: float | None = None
    speedup: float | None = None  # median samples/s over the baseline's
    versus: str = "-"
    warnings: list[Flag] = field(default_factory=list)

    @property
    def facts(self) -> dict[str, Any]:
        return self.runs[0].facts

    @property
    def status(self) -> str:
        return self.runs[0].status

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def strategy(self) -> str:
        """The strategy with its settings (`ddp +syncbn`): the row's colour in every plot."""
        return strategy_label(self.facts)

    @property
    def devices(self) -> int:
        return self.runs[0].devices

    @property
    def metric(self) -> str:
        return self.runs[0].metric

    def throughputs(self) -> list[float]:
        return [t for r in self.runs if (t := r.throughput()) is not None]

    def per_run(self, value: Callable[[Run], float | None]) -> list[float]:
        return [v for r in self.runs if (v := value(r)) is not None and not math.isnan(v)]

    def median(self, value: Callable[[Run], float | None]) -> float | None:
        values = self.per_run(value)
        return statistics.median(values) if values else None

    def spread(self, value: Callable[[Run], float | None]) -> tuple[float, float] | None:
        values = self.per_run(value)
        return (min(values), max(values)) if values else None

    def per_device(self) -> float | None:
        tput = self.median(Run.throughput)
        return tput / self.devices if tput is not None else None


@dataclass
class Group:
    """Runs of one (model, data, global batch): the only runs whose numbers are compared."""

    model: str | None
    data: str | None
    global_batch_size: int | None
    rows: list[Row]
    baseline: Row | None = None
    context: str = ""
    notes: list[str] = field(default_factory=list)
    warnings: list[Flag] = field(default_factory=list)
    weak: str = ""  # the weak-scaling series that compares a group without a baseline of its own

    @property
    def title(self) -> str:
        batch = self.global_batch_size or "?"
        return f"{self.model or 'model ?'} on {self.data or 'data ?'}, global batch {batch}"

    def flags(self) -> list[Flag]:
        return [*self.warnings, *(flag for row in self.rows for flag in row.warnings)]


def pick_baseline(rows: list[Row], named: str | None) -> Row | None:
    """The row of --baseline NAME; else the completed `single` row (the plain one, then the one with
    most runs); else the one-process row (a ddp run on one process, as experiment=scaling has), the
    plainest label first. Never chosen by speed."""
    usable = [r for r in rows if r.status == "completed" and r.throughputs()]
    if named is not None:
        return next(
            (
                r
                for r in usable
                if named in (r.label, r.strategy, r.name) or any(run.name == named for run in r.runs)
            ),
            None,
        )
    singles = [r for r in usable if r.facts.get("strategy") == "single"]
    if singles:
        return min(singles, key=lambda r: (r.strategy != "single", -r.n))
    alone = [r for r in usable if r.devices == 1 and int(r.facts.get("world_size") or 1) == 1]
    return min(alone, key=lambda r: (len(r.label), -r.n), default=None)

"""Weak scaling: the same per-rank batch on more devices (so a larger global batch, a group of its own),
compared per device against the one-process run at that per-rank batch. experiment=scaling sweeps it
(trainer.batch_per_rank=32 on 1, 2, 4 processes: global batch 32, 64, 128)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .rows import Group, Row, pick_baseline


@dataclass
class WeakSeries:
    """Rows of one (model, data, per-rank batch) over several device counts and global batches."""

    model: str | None
    data: str | None
    per_rank_batch: int
    baseline: Row  # the one-process row at this per-rank batch
    rows: list[Row]  # by device count, the baseline first
    efficiency: dict[int, float]  # id(row) -> per-device samples/s over the baseline's

    @property
    def title(self) -> str:
        return (
            f"{self.model or 'model ?'} on {self.data or 'data ?'}, {self.per_rank_batch} samples per rank "
            "(weak scaling)"
        )


def weak_scaling(groups: list[Group]) -> list[WeakSeries]:
    """Every per-rank batch at which completed rows span several global batches and device counts, and
    one of them ran on one process: its series, efficiency = per-device samples/s / the baseline's."""
    by_batch: dict[tuple[Any, ...], list[Row]] = {}
    for group in groups:
        for row in group.rows:
            per_rank = row.facts.get("per_rank_batch_size")
            if row.status == "completed" and row.throughputs() and isinstance(per_rank, int):
                by_batch.setdefault((group.model, group.data, per_rank), []).append(row)
    out = []
    for (model, data, per_rank), rows in sorted(by_batch.items(), key=lambda item: str(item[0])):
        batches = {row.facts.get("global_batch_size") for row in rows}
        base = pick_baseline([row for row in rows if row.devices == 1], None)
        if len(batches) < 2 or len({row.devices for row in rows}) < 2 or base is None:
            continue
        base_per_device = base.per_device()
        if not base_per_device:
            continue
        ordered = sorted(rows, key=lambda row: (row is not base, row.devices))
        efficiency = {id(row): (row.per_device() or 0.0) / base_per_device for row in ordered}
        out.append(WeakSeries(model, data, per_rank, base, ordered, efficiency))
    return out


def covered(group: Group, series: list[WeakSeries]) -> WeakSeries | None:
    """The weak-scaling series that compares every row of a group without a baseline of its own."""
    ids = {id(row) for row in group.rows if row.throughputs()}
    return next((s for s in series if ids and ids <= {id(row) for row in s.rows}), None)

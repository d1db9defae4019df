"""The report as records (--format csv|json): one per row, numbers as numbers (accuracy as a fraction,
times in seconds), with the row's group and warnings."""

from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path
from typing import Any

from .. import fsutil
from ..runrecord import finite_number
from .groups import Group, Row
from .runs import Run


def records(groups: list[Group], target: float) -> list[dict[str, Any]]:
    """One record per row, numbers as numbers (None where a row has none)."""
    return [_record(group, row, target) for group in groups for row in group.rows]


def _record(group: Group, row: Row, target: float) -> dict[str, Any]:
    f = row.facts
    tput = row.spread(Run.throughput)
    tokens = row.spread(Run.token_throughput)
    reach = row.spread(lambda r: r.time_to(target))
    finals = row.per_run(lambda r: finite_number(r.final.get(row.metric)))

    def final(key: str) -> float | None:
        return row.median(lambda r: finite_number(r.final.get(key)))

    return {
        "model": group.model,
        "data": group.data,
        "global_batch_size": group.global_batch_size,
        "context": group.context,
        "baseline": group.baseline.name if group.baseline else None,
        "run": row.name,
        "runs": [r.name for r in row.runs],
        "status": row.status,
        "strategy": row.label,
        "n": row.n,
        "device_type": f.get("device_type"),
        "gpu_name": f.get("gpu_name"),
        "backend": f.get("backend"),
        "host": f.get("host"),
        "host_cpus": f.get("host_cpus"),
        "nprocs_per_node": f.get("nprocs_per_node"),
        "threads": f.get("threads"),
        "replicas": f.get("replicas"),
        "world_size": f.get("world_size"),
        "devices": row.devices,
        "per_rank_batch_size": f.get("per_rank_batch_size"),
        "metric": row.metric,
        "final_mean": statistics.fmean(finals) if finals else None,
        "final_std": statistics.stdev(finals) if len(finals) > 1 else None,
        "best_mean": _mean(row.per_run(lambda r: finite_number(r.best.get(row.metric)))),
        "time_to_target_s_median": row.median(lambda r: r.time_to(target)),
        "time_to_target_s_min": reach[0] if reach else None,
        "time_to_target_s_max": reach[1] if reach else None,
        "reached_target": len(row.per_run(lambda r: r.time_to(target))),
        "train_time_s_median": row.median(lambda r: r.wall_s),
        "job_time_s_median": row.median(Run.job_time),
        "samples_per_s_median": row.median(Run.throughput),
        "samples_per_s_min": tput[0] if tput else None,
        "samples_per_s_max": tput[1] if tput else None,
        "samples_per_s_per_device": row.per_device(),
        "tokens_per_s_median": row.median(Run.token_throughput),
        "tokens_per_s_min": tokens[0] if tokens else None,
        "tokens_per_s_max": tokens[1] if tokens else None,
        "mfu": row.median(Run.mfu),
        "scaling_efficiency": row.efficiency,
        "speedup_vs_baseline": row.speedup,
        "vs_baseline": row.versus,
        "comm_share": row.median(lambda r: r.mean("comm/share")),
        "comm_bytes_per_step": final("comm/bytes_per_step"),
        "bytes_moved": row.median(Run.bytes_moved),
        # a mixture of experts' routing (models/moe.py)
        "expert_load_max_over_mean": final("moe/load_max_over_mean"),
        "expert_dropped_frac": final("moe/dropped_frac"),
        "moe_aux_loss": final("moe/aux_loss"),
        # the strategy's own scalars (its report_columns), by name: bubble_frac, staleness_max...
        **{
            tag.rpartition("/")[2]: final(tag)
            for column in row.facts.get("strategy_columns") or []
            for tag in column["tags"]
        },
        "peak_mem_mb": row.median(lambda r: r.peak("mem/peak_mb")),
        "params_mb": final("mem/params_mb"),
        "grads_mb": final("mem/grads_mb"),
        "optim_state_mb": final("mem/optim_state_mb"),
        "activations_mb": final("mem/activations_mb"),
        "host_mb": final("mem/host_mb"),
        "notes": [note for note in group.notes if note.startswith(f"{row.name}:")],
        "warnings": [flag.text for flag in [*group.warnings, *row.warnings]],
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buffer = io.StringIO()
    fields = list(dict.fromkeys(key for record in rows for key in record))  # rows may add a strategy's own
    writer = csv.DictWriter(buffer, fieldnames=fields, restval="")
    writer.writeheader()
    for record in rows:
        writer.writerow(
            {
                k: "; ".join(map(str, v)) if isinstance(v, list) else ("" if v is None else v)
                for k, v in record.items()
            }
        )
    fsutil.atomic_write_text(path, buffer.getvalue())

"""TensorBoard's HParams view, written by rank 0's recorder into the run's own event file.

At the start of a run: the experiment (which settings and metrics there are, and which to show: the
ones its sweep varies, plus strategy, world size and sync_bn, marked `differs`, which TensorBoard
puts first and ticks) and the session's settings, so running and failed runs appear at once. At the
end: the session's status and its metrics, with the report's definitions (ddpexp/report/):

  hparams/final_<metric>, hparams/best_<metric>   the best metric (eval/acc unless the task says)
  hparams/time_to_target_s   seconds from the job's start until eval/acc first reached TARGET
  hparams/samples_per_s      mean over epochs of perf/samples_per_s, the first left out when there
                             are several (it includes warm-up)
  hparams/comm_share         mean comm/share (strategies that communicate)
  hparams/peak_mem_mb        peak of mem/peak_mb
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

from .runrecord import steady, strategy_label

TARGET = 0.95  # the report's default --target
ALWAYS_SHOWN = ("strategy", "world_size", "sync_bn")
CONTEXT = (  # recorded for every run, shown when ticked by hand
    "backend",
    "devices",
    "global_batch_size",
    "per_rank_batch_size",
    "model",
    "data",
    "precision",
    "accumulate",
    "threads",
    "seed",
)
STATUS = {
    "completed": api_pb2.STATUS_SUCCESS,
    "failed": api_pb2.STATUS_FAILURE,
    "crashed": api_pb2.STATUS_FAILURE,  # runrecord.CRASHED
    "running": api_pb2.STATUS_RUNNING,
}


def settings(facts: dict[str, Any]) -> tuple[dict[str, str | bool | float], set[str]]:
    """The run's hparams and the names to show: what its sweep varies, plus ALWAYS_SHOWN."""
    values: dict[str, Any] = {"strategy": strategy_label(facts)}
    values |= {key: facts.get(key) for key in (*ALWAYS_SHOWN[1:], *CONTEXT)}
    varies = dict(facts.get("sweep_varies") or {})
    values |= {key: value for key, value in varies.items() if key not in ("strategy",)}
    shown = set(ALWAYS_SHOWN) | set(varies)
    return {key: _value(value) for key, value in values.items()}, shown


def metric_names(best_metric: str) -> list[str]:
    name = best_metric.replace("/", "_")
    return [
        f"hparams/final_{name}",
        f"hparams/best_{name}",
        "hparams/time_to_target_s",
        "hparams/samples_per_s",
        "hparams/comm_share",
        "hparams/peak_mem_mb",
    ]


def start(facts: dict[str, Any], best_metric: str, started_at: float) -> list[Summary]:
    values, shown = settings(facts)
    experiment = api_pb2.Experiment(
        hparam_infos=[api_pb2.HParamInfo(name=key, differs=key in shown) for key in _ordered(values, shown)],
        metric_infos=[
            api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in metric_names(best_metric)
        ],
    )
    session = plugin_data_pb2.SessionStartInfo(start_time_secs=started_at)
    for key, value in values.items():
        if isinstance(value, bool):
            session.hparams[key].bool_value = value
        elif isinstance(value, float):
            session.hparams[key].number_value = value
        else:
            session.hparams[key].string_value = value
    return [
        _summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)),
        _summary(
            metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=session)
        ),
    ]


def end(status: str, ended_at: float) -> Summary:
    info = plugin_data_pb2.SessionEndInfo(
        status=STATUS.get(status, api_pb2.STATUS_UNKNOWN), end_time_secs=ended_at
    )
    return _summary(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=info))


def write_end(run_dir: Path, status: str, *, step: int) -> None:
    """The session's end for a run whose own recorder never wrote it (killed outright), in an event
    file of its own beside the run's: TensorBoard reads every event file of the directory."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    now = time.time()
    writer = EventFileWriter(str(run_dir), filename_suffix=".settled")
    writer.add_event(Event(wall_time=now, step=step, summary=end(status, now)))
    writer.close()


def results(metrics: dict[str, Any], best_metric: str) -> dict[str, float]:
    """The run's metrics for the HParams view, from metrics.json's history (report definitions)."""
    history = metrics.get("history", [])
    name = best_metric.replace("/", "_")
    per_epoch = [h["perf/samples_per_s"] for h in history if h.get("perf/samples_per_s") is not None]
    kept = steady(per_epoch)
    shares = [h["comm/share"] for h in history if h.get("comm/share") is not None]
    peaks = [h["mem/peak_mb"] for h in history if h.get("mem/peak_mb") is not None]
    reached = [
        h["job_time_s"]
        for h in history
        if best_metric == "eval/acc" and (h.get(best_metric) or 0.0) >= TARGET and "job_time_s" in h
    ]
    out = {
        f"hparams/final_{name}": metrics.get("final", {}).get(best_metric),
        f"hparams/best_{name}": metrics.get("best", {}).get(best_metric),
        "hparams/time_to_target_s": reached[0] if reached else None,
        "hparams/samples_per_s": sum(kept) / len(kept) if kept else None,
        "hparams/comm_share": sum(shares) / len(shares) if shares else None,
        "hparams/peak_mem_mb": max(peaks) if peaks else None,
    }
    return {key: float(value) for key, value in out.items() if value is not None}


def _ordered(values: dict[str, Any], shown: set[str]) -> list[str]:
    return [key for key in values if key in shown] + [key for key in values if key not in shown]


def _value(value: Any) -> str | bool | float:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return "null" if value is None else str(value)


def _summary(tag: str, data: plugin_data_pb2.HParamsPluginData) -> Summary:
    data.version = metadata.PLUGIN_DATA_VERSION
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))])

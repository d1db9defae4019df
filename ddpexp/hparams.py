"""TensorBoard's HParams view, written by rank 0's recorder into the run's own event file.

At the start of a run: the experiment (which settings and metrics there are, and which to show: the
ones its sweep varies, plus strategy, world size, sync_bn and threads (what explains a speed
difference), marked `differs`, which TensorBoard puts first and ticks) and the session's settings, so
running and failed runs appear at once. At the end: the session's status. Its metrics are the last
points of the charts a person reads anyway (in the console's and the report's units: accuracies in %),
and two values written once, at the end, in summary/:

  eval/<metric>              the best metric's final value (eval/acc, in %, unless the task says)
  summary/best_<metric>      its best value
  summary/time_to_target_s   seconds from the job's start until eval/acc first reached TARGET
  perf/samples_per_s         the last epoch's samples/s (the report's: the mean over epochs after the
                             first)
  perf/tokens_per_s, perf/mfu  data with tokens: the last epoch's tokens/s and MFU (a fraction)
  perf/comm_share            the last epoch's share of time in communication (strategies with any)
  mem/peak_mb                peak memory
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

from .runrecord import is_accuracy, strategy_label

TARGET = 0.95  # the report's default --target
ALWAYS_SHOWN = ("strategy", "world_size", "sync_bn", "threads")
CONTEXT = (  # recorded for every run, shown when ticked by hand
    "backend",
    "devices",
    "global_batch_size",
    "per_rank_batch_size",
    "model",
    "data",
    "precision",
    "activation_checkpointing",
    "accumulate",
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


def metric_names(best_metric: str, *, tokens: bool = False) -> list[str]:
    """The view's metrics; `tokens`: the data has tokens (tokens/s and MFU as well)."""
    name = best_metric.replace("/", "_")
    return [
        best_metric,
        f"summary/best_{name}",
        "summary/time_to_target_s",
        "perf/samples_per_s",
        *(("perf/tokens_per_s", "perf/mfu") if tokens else ()),
        "perf/comm_share",
        "mem/peak_mb",
    ]


def start(facts: dict[str, Any], best_metric: str, started_at: float) -> list[Summary]:
    values, shown = settings(facts)
    experiment = api_pb2.Experiment(
        hparam_infos=[api_pb2.HParamInfo(name=key, differs=key in shown) for key in _ordered(values, shown)],
        metric_infos=[
            api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag))
            for tag in metric_names(best_metric, tokens=bool(facts.get("tokens_per_sample")))
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
    """The metrics written once, at the end (summary/: the others are the last points of live
    charts), from metrics.json (report definitions; accuracies in %)."""
    history = metrics.get("history", [])
    name = best_metric.replace("/", "_")
    reached = [
        h["job_time_s"]
        for h in history
        if best_metric == "eval/acc" and (h.get(best_metric) or 0.0) >= TARGET and "job_time_s" in h
    ]
    best = metrics.get("best", {}).get(best_metric)
    scale = 100.0 if is_accuracy(best_metric) else 1.0
    out = {
        f"summary/best_{name}": None if best is None else scale * best,
        "summary/time_to_target_s": reached[0] if reached else None,
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

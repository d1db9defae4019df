"""ddpexp.runrecord: the one reader of a run's record (metrics.json). A record the recorder wrote reads
back typed with nothing lost; a missing one is None; a damaged one (truncated by a crash, not JSON, not
an object) is one clear error naming the file. And it stays the lowest layer: no torch, no ddpexp
module above fsutil."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpexp import hparams
from ddpexp.recorder import settle_lost, write_metrics
from ddpexp.runrecord import (
    CRASHED,
    METRICS_FILE,
    RunRecord,
    RunRecordError,
    owner_record,
    read_run_record,
    steady,
    strategy_label,
)

RECORD = {
    "status": "completed",
    "facts": {"strategy": "ddp", "world_size": 2, "strategy_settings": {"comm_hook": "bf16"}},
    "final": {"epoch": 2, "step": 10, "eval/acc": 0.9},
    "best": {"epoch": 2, "step": 10, "eval/acc": 0.9},
    "history": [{"epoch": 1, "step": 5, "eval/acc": 0.8}, {"epoch": 2, "step": 10, "eval/acc": 0.9}],
    "started_at": 1_800_000_000.0,
    "wall_s": 12.5,
    "time_to_first_step_s": 1.5,
    "attempts": 2,
    "memory_per_rank": [{"rank": 0, "params_mb": 1.0}],  # a key RunRecord has no field for
}


def test_a_record_the_recorder_wrote_reads_back_typed_with_nothing_lost(tmp_path: Path):
    write_metrics(tmp_path, {**RECORD, "error": None, "final": {**RECORD["final"], "eval/loss": math.nan}})
    record = read_run_record(tmp_path)
    assert isinstance(record, RunRecord)
    assert record.path == tmp_path / METRICS_FILE and record.run_dir == tmp_path
    assert record.status == "completed" and record.facts == RECORD["facts"] and record.best == RECORD["best"]
    assert record.final == {**RECORD["final"], "eval/loss": None}  # JSON has no NaN: written as null
    assert record.nonfinite == ["eval/loss"]
    assert record.history == RECORD["history"] and record.attempts == 2 and record.error is None
    assert (record.started_at, record.wall_s, record.time_to_first_step_s) == (1_800_000_000.0, 12.5, 1.5)
    assert record.raw["memory_per_rank"] == RECORD["memory_per_rank"]  # every key is still there
    assert read_run_record(tmp_path / METRICS_FILE) == record  # the directory or the file itself


def test_a_record_of_a_run_that_stopped_early_reads_with_defaults(tmp_path: Path):
    (tmp_path / METRICS_FILE).write_text(
        json.dumps({"status": "failed", "facts": None, "history": [1, {"epoch": 1}], "error": "boom"})
    )
    record = read_run_record(tmp_path)
    assert record is not None
    assert record.status == "failed" and record.error == "boom" and record.facts == {} and record.final == {}
    assert record.history == [{"epoch": 1}]  # what is not an epoch's record is left out
    assert record.started_at is None and record.wall_s is None and record.attempts == 1


def test_no_record_is_none(tmp_path: Path):
    assert read_run_record(tmp_path) is None  # a run that has not written one yet
    assert read_run_record(tmp_path / "nowhere") is None
    assert read_run_record(tmp_path / "nowhere" / METRICS_FILE) is None


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('{"status": "running", "facts": {"strategy": "dd', "JSONDecodeError"),  # truncated by a crash
        ("", "JSONDecodeError"),
        ("[1, 2]", "not an object"),
        ("null", "not an object"),
    ],
)
def test_a_damaged_record_is_one_error_that_names_the_file(tmp_path: Path, text: str, kind: str):
    (tmp_path / METRICS_FILE).write_text(text)
    with pytest.raises(RunRecordError) as caught:
        read_run_record(tmp_path)
    assert caught.value.kind == kind and caught.value.path == tmp_path / METRICS_FILE
    assert str(tmp_path / METRICS_FILE) in str(caught.value) and kind in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_a_record_that_is_a_directory_is_an_error_not_a_missing_record(tmp_path: Path):
    (tmp_path / "run" / METRICS_FILE).mkdir(parents=True)
    with pytest.raises(RunRecordError, match="IsADirectoryError"):
        read_run_record(tmp_path / "run")


def test_steady_leaves_the_warm_up_epoch_out_when_there_are_more():
    assert steady([]) == [] and steady([3.0]) == [3.0] and steady([9.0, 2.0, 4.0]) == [2.0, 4.0]


def test_strategy_label_names_the_settings_that_differ_from_the_defaults():
    assert strategy_label({}) == "?"
    assert (
        strategy_label({"strategy": "ddp", "strategy_settings": {"comm_hook": "bf16"}})
        == "ddp comm_hook=bf16"
    )
    facts = {"strategy": "fsdp", "strategy_settings": {"sync_bn": True, "reshard_after_forward": False}}
    assert strategy_label(facts) == "fsdp +syncbn reshard_after_forward=false"
    assert strategy_label({"strategy": "ddp", "sync_bn": True, "strategy_settings": {"x": None}}) == (
        "ddp +syncbn x=null"
    )


def test_it_is_the_lowest_layer():
    """Importing it imports neither torch nor any ddpexp module above fsutil and host."""
    code = (
        "import sys, ddpexp.runrecord\n"
        "mods = [m for m in sys.modules if m == 'torch' or m.startswith('ddpexp.')]\n"
        "print(sorted(set(mods) - {'ddpexp.runrecord', 'ddpexp.fsutil', 'ddpexp.host', 'ddpexp.procstat'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _ended_process() -> int:
    """The pid of a process that has ended and been reaped."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(done.stdout)


def test_a_running_record_whose_owner_is_gone_reads_as_crashed(tmp_path: Path):
    """A run killed outright cannot record how it ended; its owner (pid, host, boot id, start time)
    tells every reader. Alive: running. Ended, or its pid since given to another process, or this
    machine restarted since: crashed, with why. On another machine: as written (nothing here can tell)."""
    running = {**RECORD, "status": "running"}

    def status(owner: dict) -> str:
        write_metrics(tmp_path, {**running, "owner": owner})
        record = read_run_record(tmp_path)
        assert record is not None
        return record.status

    me = owner_record(os.getpid())
    assert status(me) == "running"
    ended = owner_record(_ended_process())
    assert ended["start"] is None and status(ended) == CRASHED
    record = read_run_record(tmp_path)
    assert record is not None and record.lost and f"pid {ended['pid']} on " in (record.error or "")
    assert status({**me, "start": me["start"] + 1}) == CRASHED  # the pid now belongs to another process
    assert status({**me, "boot_id": "another boot"}) == CRASHED
    assert status({**me, "host": "elsewhere", "pid": ended["pid"]}) == "running"
    assert status({**ended, "pid": None}) == "running"  # nothing to check it by
    write_metrics(tmp_path, {**RECORD, "owner": ended})  # only `running` is ever in question
    assert read_run_record(tmp_path).status == "completed"  # type: ignore[union-attr]


def test_a_command_that_claims_the_directory_writes_the_true_status(tmp_path: Path):
    """settle_lost (what a command does on claiming a directory): the file and TensorBoard's HParams
    view say crashed, and a record whose owner lives is left as it was."""
    write_metrics(tmp_path, {**RECORD, "status": "running", "owner": owner_record(os.getpid())})
    before = (tmp_path / METRICS_FILE).read_bytes()
    assert not settle_lost(tmp_path) and (tmp_path / METRICS_FILE).read_bytes() == before
    write_metrics(tmp_path, {**RECORD, "status": "running", "owner": owner_record(_ended_process())})
    assert settle_lost(tmp_path)
    written = json.loads((tmp_path / METRICS_FILE).read_text())
    assert written["status"] == CRASHED and "ended without recording how" in written["error"]
    assert written["history"] == RECORD["history"]  # nothing else changes
    assert not settle_lost(tmp_path)  # once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, metadata

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    (content,) = events.PluginTagToContent(metadata.PLUGIN_NAME).values()
    end = metadata.parse_session_end_info_plugin_data(content)
    assert end.status == api_pb2.STATUS_FAILURE == hparams.STATUS[CRASHED]

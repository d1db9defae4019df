"""Which rank rank 0 names under torchrun, as pure logic over the records the ranks leave (no processes):
a stop is told apart by who sent it, torchrun's agent (it stops every rank) or something else."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpexp.launch import torchrun
from ddpexp.launch.error_records import error_file
from ddpexp.recorder import new_metrics, write_metrics

AGENT, OUTSIDE = 4242, 777
T0 = 1_000_000.0  # rank 0's run started; it recorded how it ended 10 s later


class _Store:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def _record(run_dir: Path, rank: int, *, at: float, stopped_by: int | None = None, error: str = "") -> None:
    if stopped_by is not None:
        record = {"type": "Interrupted", "time": at, "exit_code": 143, "sent_by": stopped_by, "parent": AGENT}
    else:
        record = {"type": "RuntimeError", "time": at, "exit_code": 1, "message": error, "traceback": ""}
    path = error_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "user_error": False, **record}))


def _blame(run_dir: Path, status: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    write_metrics(
        run_dir, dict(new_metrics({}), status=status, error="rank 0's own", started_at=T0, wall_s=10.0)
    )
    where = {"host": socket.gethostname(), "pid": os.getpid(), "started": None}
    store = _Store({f"{torchrun.PEER_KEY}/0/1": json.dumps(where)})
    monkeypatch.setattr(torchrun, "PEER_WAIT_S", 0.0)
    torchrun.blame_a_peer(SimpleNamespace(run_dir=run_dir), store, since=T0 - 1)  # type: ignore[arg-type]
    return json.loads((run_dir / "metrics.json").read_text())


def test_rank_0_stopped_by_the_agent_names_the_peer_stopped_from_outside(tmp_path, monkeypatch):
    _record(tmp_path, 1, at=T0 + 5, stopped_by=OUTSIDE)
    _record(tmp_path, 0, at=T0 + 10, stopped_by=AGENT)
    m = _blame(tmp_path, "interrupted", monkeypatch)
    assert m["status"] == "failed" and m["error"] == "rank 1: stopped by SIGTERM (not sent by ddpexp)", m


def test_rank_0_stopped_by_the_agent_names_the_peer_that_failed_on_its_own(tmp_path, monkeypatch):
    _record(tmp_path, 1, at=T0 + 5, error="bad batch")
    _record(tmp_path, 0, at=T0 + 10, stopped_by=AGENT)
    m = _blame(tmp_path, "interrupted", monkeypatch)
    assert m["status"] == "failed" and m["error"].startswith("rank 1: failed: RuntimeError: bad batch"), m


def test_every_rank_stopped_by_the_agent_is_an_interruption(tmp_path, monkeypatch):
    _record(tmp_path, 1, at=T0 + 5, stopped_by=AGENT)
    _record(tmp_path, 0, at=T0 + 10, stopped_by=AGENT)
    m = _blame(tmp_path, "interrupted", monkeypatch)
    assert m["status"] == "interrupted" and m["error"] == "rank 0's own", m


def test_rank_0_losing_peers_the_agent_had_stopped_is_an_interruption_not_a_failure(tmp_path, monkeypatch):
    """torchrun's SIGTERM reached rank 1 first: rank 0 saw the broken connection before its own SIGTERM."""
    _record(tmp_path, 1, at=T0 + 5, stopped_by=AGENT)
    m = _blame(tmp_path, "failed", monkeypatch)
    assert m["status"] == "interrupted", m
    assert m["error"].startswith("stopped by SIGTERM from torchrun's agent, as every rank was"), m


def test_a_rank_0_stopped_from_outside_blames_no_peer_stopped_from_outside_too(tmp_path, monkeypatch):
    """kill -TERM to the process group, or Slurm signalling every process: an interruption."""
    _record(tmp_path, 1, at=T0 + 5, stopped_by=OUTSIDE)
    _record(tmp_path, 0, at=T0 + 10, stopped_by=OUTSIDE)
    m = _blame(tmp_path, "interrupted", monkeypatch)
    assert m["status"] == "interrupted" and m["error"] == "rank 0's own", m


def test_a_peer_stopped_by_the_agent_after_rank_0_failed_is_not_its_cause(tmp_path, monkeypatch):
    _record(tmp_path, 1, at=T0 + 15, stopped_by=AGENT)
    m = _blame(tmp_path, "failed", monkeypatch)
    assert m["status"] == "failed" and m["error"] == "rank 0's own", m


def test_rank_0_waits_for_a_peer_that_records_its_stop_only_after_unwinding(tmp_path, monkeypatch):
    """Rank 1, stopped from outside, closed its connections while it unwound and wrote its record
    after that: on a busy machine past the 2 s rank 0 used to give it (seen in the fault suite under
    load). Rank 0 waits for the record (or the peer's end), not for a time."""
    clock = {"now": 0.0, "sleeps": 0}

    def sleep(seconds: float) -> None:  # each poll takes a second of the fake clock
        clock["now"] += 1.0
        clock["sleeps"] += 1
        if clock["sleeps"] == 5:
            _record(tmp_path, 1, at=T0 + 12, stopped_by=OUTSIDE)

    monkeypatch.setattr(torchrun, "time", SimpleNamespace(monotonic=lambda: clock["now"], sleep=sleep))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    write_metrics(
        tmp_path, dict(new_metrics({}), status="failed", error="closed by peer", started_at=T0, wall_s=10.0)
    )
    where = {"host": socket.gethostname(), "pid": os.getpid(), "started": None}  # alive: this process
    store = _Store({f"{torchrun.PEER_KEY}/0/1": json.dumps(where)})
    torchrun.blame_a_peer(SimpleNamespace(run_dir=tmp_path), store, since=T0 - 1)  # type: ignore[arg-type]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["error"] == "rank 1: stopped by SIGTERM (not sent by ddpexp)", m

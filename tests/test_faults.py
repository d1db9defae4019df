"""The fault-injection suite: crashes, signals and restarts, checked the way a user would notice them.

Every case checks the exit code, how fast the run stopped, the message, that no process of the run
survives (every process ever seen in the launcher's tree, recorded while it ran), that the master port
is free again, and that what was saved still loads. Failures are injected with DDPEXP_FAULT
(ddpexp/faults.py) or signals from outside; every wait has a timeout, so a regression fails, not hangs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from .conftest import metrics, run_ddpexp, scalars
from .fault_harness import (
    LONG,
    Watched,
    _nothing_outlives_its_test,  # noqa: F401  (autouse: kills what a case left running)
    last_checkpoint_step,
    pid_of_rank,
)

pytestmark = pytest.mark.multiproc


# ------------------------------------------------------------------------------- a worker fails


@pytest.mark.parametrize(
    ("action", "summary"),
    [
        ("raise", "rank 1 of 2 failed: InjectedFault: injected fault"),
        ("kill", "rank 1 of 2 failed: killed by SIGKILL"),
    ],
)
def test_a_failing_worker_stops_the_run_within_seconds_naming_the_rank(
    tmp_path: Path, action: str, summary: str
):
    run = Watched(tmp_path, ["strategy=ddp", *LONG], fault=f"rank1:step12:{action}")
    code, _out, err = run.finish()
    assert code == 1, err
    assert err.splitlines()[0].startswith(f"ddpexp: {summary}"), err  # the root cause first
    if action == "raise":
        assert "Traceback" in err and "faults.py" in err  # the failing rank's own traceback
    assert run.ended - run.exit_time_of_rank(1) < 10, "the other ranks were not stopped promptly"
    run.assert_nothing_left()
    m = metrics(tmp_path / "run")
    assert m["status"] == "failed" and "rank 1" in m["error"] and m["history"] == []
    assert last_checkpoint_step(tmp_path / "run") == 10


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_sent_to_one_worker_is_blamed_on_that_worker(tmp_path: Path, sig: signal.Signals):
    """Its peer then fails with a broken connection; the report names the signalled rank, not it."""
    run = Watched(tmp_path, ["strategy=ddp", *LONG])
    run.wait_until_training()
    os.kill(pid_of_rank(run, 1), sig)
    code, _out, err = run.finish(timeout=60)
    assert code == 1, err
    assert err.splitlines()[0] == f"ddpexp: rank 1 of 2 stopped by {sig.name} (not sent by ddpexp)", err
    run.assert_nothing_left()
    m = metrics(tmp_path / "run")
    assert m["status"] == "failed" and m["error"].startswith(f"rank 1: stopped by {sig.name}"), m["error"]


def test_a_hung_rank_is_caught_in_seconds_blamed_and_its_stack_logged(tmp_path: Path):
    """SIGSTOP one rank: with dist.hang_timeout_s=10 the launcher stops the run within ~20 s, blaming
    that rank (not the healthy one waiting for it), with its Python stack in its log."""
    run = Watched(tmp_path, ["strategy=ddp", *LONG, "dist.hang_timeout_s=10"])
    run.wait_until_training()
    stopped = time.time()
    os.kill(pid_of_rank(run, 1), signal.SIGSTOP)
    code, _out, err = run.finish(timeout=90)
    assert code == 1, err
    first = err.splitlines()[0]
    assert first.startswith("ddpexp: rank 1 of 2 hung at step "), err
    assert "(no progress for 1" in first and "its stack is in logs/rank1.log" in first, first
    assert run.ended - stopped < 25
    run.assert_nothing_left()
    log = (tmp_path / "run" / "logs" / "rank1.log").read_text()
    assert "most recent call first" in log and "engine.py" in log  # faulthandler's dump of the stack
    assert metrics(tmp_path / "run")["status"] == "failed"


def test_a_kill_while_saving_leaves_the_previous_checkpoint_and_resume_continues(tmp_path: Path):
    run = Watched(
        tmp_path, ["strategy=ddp", *LONG, "trainer.max_steps=20"], fault="rank0:step10:kill_in_save"
    )
    code, _out, err = run.finish()
    assert code == 1 and "rank 0 of 2 failed: killed by SIGKILL" in err, err
    run.assert_nothing_left()
    folder = tmp_path / "run" / "checkpoints"
    assert any(p.name.endswith(".tmp") for p in folder.iterdir())  # the half-written file, under a temp name
    assert last_checkpoint_step(tmp_path / "run") == 5
    again = Watched(tmp_path, ["strategy=ddp", *LONG, "trainer.max_steps=20", "trainer.resume=auto"])
    code, out, err = again.finish()
    assert code == 0, err
    assert "resumed from" in out + err and "step-00000005.pt" in out + err
    assert not any(p.name.endswith(".tmp") for p in folder.iterdir())
    assert last_checkpoint_step(tmp_path / "run") == 20
    again.assert_nothing_left()


# ------------------------------------------------------------------------------- the launcher


@pytest.mark.parametrize(
    ("strategy", "sig"),
    [
        ("ddp", signal.SIGINT),
        ("ddp", signal.SIGTERM),
        ("ddp", signal.SIGHUP),  # a closed terminal
        ("ddp", signal.SIGUSR1),  # Slurm's --signal, without trainer.checkpoint_on_signal
        ("ddp", signal.SIGUSR2),
        ("single", signal.SIGHUP),  # a run in the launcher's own process
    ],
    ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "single-SIGHUP"],
)
def test_a_signal_to_the_launcher_stops_every_worker(tmp_path: Path, strategy: str, sig: signal.Signals):
    """Each signal that would end the launcher stops the run by its own name: every worker stopped,
    exit 128 + the signal, metrics.json `interrupted` naming it (not `running`, not a peer's error)."""
    run = Watched(tmp_path, [f"strategy={strategy}", *LONG])
    run.wait_until_training()
    sent = time.time()
    run.proc.send_signal(sig)
    returned, out, err = run.finish(timeout=60)
    assert returned == 128 + sig, err
    assert run.ended - sent < 10
    run.assert_nothing_left()
    assert f"(exit code {128 + sig})" in out, out
    m = metrics(tmp_path / "run")
    assert m["status"] == "interrupted" and m["history"]  # what was recorded before the signal stays
    assert sig.name in m["error"], m["error"]
    assert scalars(tmp_path / "run")["eval/acc"][0][0] == m["history"][0]["step"]
    assert last_checkpoint_step(tmp_path / "run") >= 5


def test_a_killed_launcher_takes_its_workers_with_it_and_its_run_reads_crashed(tmp_path: Path):
    """SIGKILL to the launcher: the workers exit, and the run, which could not record how it ended,
    reads as crashed to every reader; the next command on its directory writes that down, then resumes."""
    run = Watched(tmp_path, ["strategy=ddp", *LONG])
    run.wait_until_training()
    run.proc.kill()  # SIGKILL: no handler runs in the launcher
    run.finish(timeout=30)
    assert run.ranks_seen() == {"0", "1"}
    run.assert_nothing_left()
    step = last_checkpoint_step(tmp_path / "run")
    assert step >= 5
    assert_reads_crashed(tmp_path / "run", owner=run.proc.pid)
    left_running = metrics(tmp_path / "run")["status"] == "running"
    again = run_ddpexp(
        tmp_path, "strategy=ddp", *LONG, "trainer.resume=auto", f"trainer.max_steps={step + 2}"
    )
    assert again.returncode == 0, again
    if left_running:  # the next command on the directory wrote the truth down before it went on
        said = f"ddpexp: run: the run's process (pid {run.proc.pid} on "  # then why
        assert said in again.stderr and "metrics.json now says crashed" in again.stderr, again
    m = metrics(tmp_path / "run")
    assert m["status"] == "completed" and m["attempts"] == 2, m


def test_a_killed_torchrun_agent_takes_its_workers_with_it_and_its_run_reads_crashed(tmp_path: Path):
    """SIGKILL to torchrun's agent: its workers (ddpexp's ranks) exit too, instead of training on as
    orphans, and the run reads as crashed."""
    run = Watched(tmp_path, ["strategy=ddp", *LONG], torchrun=True)
    run.wait_until_training()
    run.proc.kill()
    run.finish(timeout=30)
    run.assert_nothing_left()
    assert_reads_crashed(tmp_path / "run", owner=run.proc.pid)


def assert_reads_crashed(run_dir: Path, *, owner: int) -> None:
    """The run was owned by `owner`, a process now gone: metrics.json says `running` (rank 0 was
    killed with it) or `crashed` (rank 0 saw its peer go first, and its launcher gone); ddpexp.run's
    Result, the report and every reader of the record say crashed."""
    from ddpexp import api, report
    from ddpexp.runrecord import read_run_record

    m = metrics(run_dir)
    assert m["status"] in ("running", "crashed") and m["owner"]["pid"] == owner, m
    record = read_run_record(run_dir)
    assert record is not None and record.status == "crashed"
    assert f"pid {owner} on " in (record.error or "")
    assert api.Result.read(run_dir, exit_code=-9).status == "crashed"
    assert report.load_run(run_dir, "run").status == "crashed"


def test_sigterm_to_torchrun_records_the_run_as_interrupted(tmp_path: Path):
    """What Slurm sends on preemption or time-out: the workers stop and metrics.json says so."""
    run = Watched(tmp_path, ["strategy=ddp", *LONG], torchrun=True)
    run.wait_until_training()
    run.proc.send_signal(signal.SIGTERM)
    run.finish(timeout=60)
    run.assert_nothing_left()
    m = metrics(tmp_path / "run")
    assert m["status"] == "interrupted" and m["history"], m["status"]

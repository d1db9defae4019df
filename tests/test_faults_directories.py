"""The fault-injection suite, continued (helpers: tests/fault_harness.py): one directory, one run: Ctrl-C
and SIGTERM around sweeps, run dirs in use, sweeps started together, submitit jobs, stale rendezvous files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ddpexp import fsutil, runner, runrecord
from ddpexp.runrecord import read_run_record

from .conftest import QUICK, metrics, run_ddpexp, run_here, same_weights
from .fault_harness import (
    _nothing_outlives_its_test,  # noqa: F401  (autouse: kills what a case left running)
    run_dirs,
)

pytestmark = pytest.mark.multiproc


# ----------------------------------------------------------------------------- one directory, one run


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_a_run_dir_in_use_by_another_run_is_refused_and_left_as_it_was(tmp_path: Path):
    """Two runs started into one hydra.run.dir: the second is refused (exit 2, the holder's PID) and
    writes nothing there, and so is a sweep into it, naming hydra.sweep.dir; once the holder is gone,
    however it ended, the directory is free again."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(  # another ddpexp run holding the claim, as a running launcher does
        [
            sys.executable,
            "-c",
            f"import pathlib; from ddpexp import fsutil;"
            f"c = fsutil.claim(pathlib.Path({str(run_dir)!r})); print(1); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
        (run_dir / "config.yaml").write_text("the other run's config\n")
        before = _snapshot(run_dir)
        second = run_here(tmp_path, *QUICK, "trainer.max_steps=2", f"hydra.run.dir={run_dir}")
        assert second.returncode == 2, second
        assert f"is in use by another ddpexp run (pid {holder.pid})" in second.stderr, second
        assert len(second.stderr.strip().splitlines()) == 1, second
        sweep = run_here(
            tmp_path, "-m", *QUICK, "trainer.max_steps=2", "seed=0,1", f"hydra.sweep.dir={run_dir}"
        )
        assert sweep.returncode == 2, sweep
        assert "hydra.sweep.dir" in sweep.stderr and "hydra.run.dir" not in sweep.stderr, sweep.stderr
        assert _snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait(timeout=10)
    again = run_here(
        tmp_path, *QUICK, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"
    )  # a SIGKILLed holder
    assert again.returncode == 0, again
    assert metrics(run_dir)["status"] == "completed"


def test_sweeps_started_in_the_same_second_get_their_own_directories(tmp_path: Path, monkeypatch):
    """The default sweep directory has sub-second resolution, and pre-flight pins it: Hydra writes
    into exactly the directory the caller claimed, not one resolved again a moment later."""
    from ddpexp.preflight import preflight

    monkeypatch.chdir(tmp_path)
    first, second = (preflight(["strategy=single,ddp"], multirun=True) for _ in range(2))
    assert first.output_dir is not None and second.output_dir is not None
    assert first.output_dir != second.output_dir
    assert f"hydra.sweep.dir={first.output_dir}" in first.overrides


def test_a_sweep_into_a_directory_holding_a_sweep_is_refused(tmp_path: Path):
    old = tmp_path / "sweep" / "strategy=single"
    old.mkdir(parents=True)
    (old / "metrics.json").write_text('{"status": "completed"}')
    before = _snapshot(tmp_path / "sweep")
    result = run_here(tmp_path, "-m", *QUICK, "strategy=single,ddp", "hydra.sweep.dir=sweep")
    assert result.returncode == 2, result
    assert "already holds a sweep's runs" in result.stderr and "trainer.resume=auto" in result.stderr
    assert _snapshot(tmp_path / "sweep") == before


def test_workers_take_their_job_from_the_launcher_not_from_the_run_dir(tmp_path: Path, monkeypatch):
    """Whatever config.yaml holds when the workers start (here: a decoy saying 1 step), they train the
    job the launcher checked (3 steps)."""
    from ddpexp.job import CONFIG_FILE, Job

    save = Job.save

    def save_then_overwrite(self: Job, **kwargs: Any) -> None:
        save(self, **kwargs)
        decoy = (self.run_dir / CONFIG_FILE).read_text().replace("max_steps: 3", "max_steps: 1")
        (self.run_dir / CONFIG_FILE).write_text(decoy)

    monkeypatch.setattr(Job, "save", save_then_overwrite)
    result = run_here(tmp_path, *QUICK, "strategy=ddp", "trainer.max_steps=3", "hydra.run.dir=run")
    assert result.returncode == 0, result
    assert "max_steps: 1" in (tmp_path / "run" / CONFIG_FILE).read_text()  # the decoy was in place
    assert metrics(tmp_path / "run")["final"]["step"] == 3


def test_submitit_jobs_requeue_after_preemption_and_a_failing_job_fails_the_sweep(tmp_path: Path):
    """Jobs run by submitit (here its local executor: the machinery Slurm uses). Both are preempted at
    step 3 (SIGUSR1, as from Slurm's --signal): each saves, submitit requeues it, and it resumes by
    itself (checkpoint_on_signal is on under submitit). The good job then ends as if never stopped; the
    other fails, and the submitting command says so: non-zero exit, its one-line error, its logs."""
    args = ["-m", "hydra/launcher=submitit_local", "optim.lr=0.05,1e10", *QUICK, "trainer.max_steps=5"]
    # A process of its own: submitit pickles Hydra's config store, which earlier in-process tests
    # filled with strategies from tests/ that a job started elsewhere cannot import.
    fault = {"DDPEXP_FAULT": "rank0:step3:preempt"}
    result = run_ddpexp(tmp_path, *args, "hydra.sweep.dir=sweep", env=fault)
    assert result.returncode == 1, result  # lr=1e10: the loss becomes NaN
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("ddpexp: error:")]
    failed = "sweep/optim.lr=10000000000.0"
    assert "loss became NaN" in error and f"logs in {failed}/logs" in error, error
    assert f"run dir: {failed}  (exit code 1)" in result.stdout, result
    assert "run dir: sweep/optim.lr=0.05\n" in result.stdout, result
    good = tmp_path / "sweep" / "optim.lr=0.05"
    m = metrics(good)
    assert m["status"] == "completed" and m["attempts"] == 2 and m["final"]["step"] == 5, m
    assert metrics(tmp_path / failed)["attempts"] == 2
    logs = "".join(p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*_log.out"))
    requeued = [line for line in logs.splitlines() if line.startswith("submitit") and "Requeued job" in line]
    assert len(requeued) == 2, logs
    reference = run_here(tmp_path, *QUICK, "trainer.max_steps=5", "optim.lr=0.05", "hydra.run.dir=ref")
    assert reference.returncode == 0, reference
    assert same_weights(good, tmp_path / "ref")


def test_a_submitit_job_killed_outright_fails_the_sweep_in_one_line_and_reads_crashed(tmp_path: Path):
    """A job whose process is SIGKILLed (strategy=single trains in the job's own process) leaves
    submitit no result. The submitting command still waits for the other job (whose rank 0 is killed
    in a worker: an ordinary failure), says in one line per job which it was and where its logs are
    (no UncompletedJobError traceback), and the killed job's metrics.json says crashed, not running."""
    args = ["-m", "hydra/launcher=submitit_local", "strategy=single,ddp", *QUICK, "trainer.max_steps=6"]
    fault = {"DDPEXP_FAULT": "rank0:step4:kill"}
    result = run_ddpexp(tmp_path, *args, "hydra.sweep.dir=sweep", env=fault)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr and "UncompletedJobError" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ddpexp: error:")]
    killed, failed = "sweep/strategy=single", "sweep/strategy=ddp"
    (error,) = [line for line in errors if f"logs in {killed}/logs" in line]
    assert "ended without recording how" in error, error
    assert any("rank 0" in line and f"logs in {failed}/logs" in line for line in errors), errors
    assert len(errors) == 2, errors
    for run in (killed, failed):
        assert f"run dir: {run}  (exit code 1)" in result.stdout, result
    assert metrics(tmp_path / killed)["status"] == "crashed"
    assert metrics(tmp_path / failed)["status"] == "failed"


def test_ctrl_c_under_submitit_stops_its_local_jobs_and_says_so_in_one_line(tmp_path: Path):
    """Ctrl-C in a terminal reaches the submitting command and the jobs submitit started on this
    machine (one process group): exit 130, one line that says where jobs go on (Slurm), nothing left."""
    args = ["-m", "hydra/launcher=submitit_local", *QUICK, "trainer.epochs=500", "hydra.sweep.dir=sweep"]
    cmd = [sys.executable, "-m", "ddpexp", *args]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # a terminal's foreground process group
    deadline = time.time() + 120
    while not any(m["history"] for m in map(metrics, run_dirs(tmp_path / "sweep"))):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    tree = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    # One line of ours. submitit's local executor runs a controller process of its own that prints its
    # KeyboardInterrupt traceback to the same console (there is none on Slurm); none of it is ddpexp's.
    lines = err.strip().splitlines()
    assert lines[0] == runner.INTERRUPTED_REMOTE, err
    assert not re.search(r'File ".*/ddpexp/[a-z_/]+\.py"', "\n".join(lines[1:])), err  # no frame of ours
    _, alive = psutil.wait_procs(tree, timeout=10)  # the jobs stop as the command does, not before it
    assert not alive, alive
    (run_dir,) = run_dirs(tmp_path / "sweep")
    # The job records its interruption unless submitit's controller, which SIGKILLs its jobs 1 s after
    # passing the Ctrl-C on, is first (a loaded host): then every reader sees the record as crashed.
    assert read_run_record(run_dir).status in ("interrupted", runrecord.CRASHED), metrics(run_dir)


def test_a_stale_rendezvous_file_in_the_run_dir_does_not_block_resume(tmp_path: Path):
    """init=file after a crash leaves <run dir>/rendezvous behind; resuming that run removes it (the
    run dir is claimed, so the file cannot belong to a live run) instead of refusing to start."""
    args = ["strategy=ddp", *QUICK, "init=file", "checkpoint.every_steps=2", "hydra.run.dir=run"]
    first = run_here(tmp_path, *args, "trainer.max_steps=2")
    assert first.returncode == 0, first
    (tmp_path / "run" / "rendezvous").write_bytes(b"\0" * 64)  # what a SIGKILLed run leaves
    again = run_here(tmp_path, *args, "trainer.max_steps=4", "trainer.resume=auto")
    assert again.returncode == 0, again
    assert metrics(tmp_path / "run")["final"]["step"] == 4
    assert not (tmp_path / "run" / "rendezvous").exists()


def _results(directory: Path) -> dict[str, bytes]:
    """What a run writes (config.yaml, plan.json, metrics.json, model.pt, checkpoints, TensorBoard
    events, logs) and Hydra's record of it (.hydra/), without the claim's lock file (it names whoever
    holds or last held the directory)."""
    return {k: v for k, v in _snapshot(directory).items() if k != fsutil.CLAIM_FILE}


def test_a_sweep_job_whose_directory_another_run_took_is_refused_and_the_sweep_says_so(
    tmp_path: Path, monkeypatch
):
    """While a sweep runs, a plain run takes the directory of its next job and completes there, and
    another ddpexp run holds the directory of the job after that. Each of those two jobs is refused
    (one line naming the directory, exit 2), the other run's results keep every byte (Hydra's record
    of the run in .hydra/ too), the sweep's own job runs, and the sweep ends with exit 2."""
    sweep = tmp_path / "sweep"
    plain_dir, held_dir = sweep / "seed=1", sweep / "seed=2"
    holder = subprocess.Popen(  # another ddpexp run holding the claim, as a running launcher does
        [sys.executable, "-c", f"import pathlib; from ddpexp import fsutil;"
         f"c = fsutil.claim(pathlib.Path({str(held_dir)!r})); print(1); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    run_job = runner.run_job
    taken: dict[str, bytes] = {}

    def run_job_then_take_the_next(*args, **kwargs):
        outcome = run_job(*args, **kwargs)
        if not taken:  # between the sweep's first job and its second
            plain = run_ddpexp(tmp_path, *QUICK, "trainer.max_steps=2", 'hydra.run.dir="sweep/seed=1"')
            assert plain.returncode == 0, plain
            taken.update(_results(plain_dir))
        return outcome

    monkeypatch.setattr(runner, "run_job", run_job_then_take_the_next)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
        result = run_here(
            tmp_path, "-m", *QUICK, "trainer.max_steps=2", "seed=0,1,2", f"hydra.sweep.dir={sweep}"
        )
        # Hydra opens the job's ddpexp.log before any code of the job runs; nothing is written to it.
        assert _results(held_dir) == {"ddpexp.log": b""}
        assert (held_dir / fsutil.CLAIM_FILE).read_text() == f"{holder.pid}\n"
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert result.returncode == 2, result
    errors = [line for line in result.stderr.splitlines() if line.startswith("ddpexp: error:")]
    assert errors == [
        f"ddpexp: error: hydra.sweep.dir: {plain_dir} already holds a run; starting another there would mix "
        "their results (fix: choose a new hydra.sweep.dir, or add trainer.resume=auto to continue that run)",
        f"ddpexp: error: hydra.sweep.dir: {held_dir} is in use by another ddpexp run (pid {holder.pid}); two "
        "runs in one directory mix their results (fix: wait for that run to end, or choose another "
        "hydra.sweep.dir)",
    ], result.stderr
    assert f"run dir: {plain_dir}  (exit code 2)" in result.stdout, result
    assert f"run dir: {held_dir}  (exit code 2)" in result.stdout, result
    assert {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"} <= taken.keys()
    assert _results(plain_dir) == taken
    assert metrics(plain_dir)["status"] == "completed"
    assert metrics(sweep / "seed=0")["status"] == "completed"


def test_a_resumed_sweep_says_its_completed_jobs_are_complete_and_resumes_the_others(
    tmp_path: Path, monkeypatch
):
    """A sweep whose second job failed at step 3 (its newest checkpoint: step 2), run again with
    trainer.resume=auto: the completed job is reported already complete, as a plain run is, and left
    as it was (attempts 1); the failed one resumes and completes (attempts 2); exit 0."""
    args = [
        "-m",
        *QUICK,
        "trainer.max_steps=4",
        "checkpoint.every_steps=2",
        "seed=0,1",
        "hydra.sweep.dir=sweep",
    ]
    run_job = runner.run_job
    jobs = []

    def second_job_fails_at_step_3(*a, **kw):
        jobs.append(1)
        if len(jobs) == 2:
            monkeypatch.setenv("DDPEXP_FAULT", "rank0:step3:raise")
        return run_job(*a, **kw)

    monkeypatch.setattr(runner, "run_job", second_job_fails_at_step_3)
    first = run_here(tmp_path, *args)
    assert first.returncode == 1, first
    monkeypatch.undo()
    done, failed = tmp_path / "sweep" / "seed=0", tmp_path / "sweep" / "seed=1"
    assert metrics(failed)["status"] == "failed"
    before = _results(done)
    again = run_here(tmp_path, *args, "trainer.resume=auto")
    assert again.returncode == 0, again
    assert f"ddpexp: {done} is already complete (step 4" in again.stdout, again
    assert f"run dir: {done}\n" in again.stdout and f"run dir: {failed}\n" in again.stdout, again
    assert _results(done) == before
    m = metrics(failed)
    assert m["status"] == "completed" and m["attempts"] == 2 and m["final"]["step"] == 4, m


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names a written file from /proc")
@pytest.mark.parametrize("fills_at", [".hydra/hydra.yaml", "plan.json"])
def test_a_disk_that_fills_as_a_resumed_run_is_set_up_changes_nothing_it_saved(
    tmp_path: Path, monkeypatch, fills_at: str
):
    """trainer.resume=auto of a finished run, and the disk fills while the resumed run's files are
    written (Hydra's record of it, config.yaml, plan.json): one line, exit 2, and the earlier run's
    files (config.yaml, metrics.json, checkpoints, model.pt, .hydra/) keep every byte, not half of
    them the resumed run's. The disk is found full where a real one says so: writing back (fsync)."""
    import errno

    args = [*QUICK, "checkpoint.every_steps=1", "hydra.run.dir=out/run"]
    first = run_here(tmp_path, *args, "trainer.max_steps=2")
    assert first.returncode == 0, first
    run_dir = tmp_path / "out" / "run"
    before = _results(run_dir)
    assert {"config.yaml", "plan.json", "metrics.json", ".hydra/hydra.yaml"} <= before.keys()
    name, fsync = "." + Path(fills_at).name + ".", os.fsync

    def full_at_that_file(fd: int) -> None:
        written = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if written.name.startswith(name) and (run_dir / fills_at).parent == written.parent:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_at_that_file)
    again = run_here(tmp_path, *args, "trainer.max_steps=4", "trainer.resume=auto")
    monkeypatch.undo()
    assert again.returncode == 2, again
    assert again.stderr.strip().splitlines() == [
        "ddpexp: error: hydra.run.dir: cannot write to out/run: No space left on device (fix: free space "
        "on that disk, or choose a hydra.run.dir on another)"
    ], again.stderr
    after = _results(run_dir)
    assert {k: v for k, v in after.items() if k != "ddpexp.log"} == {
        k: v for k, v in before.items() if k != "ddpexp.log"
    }
    assert after["ddpexp.log"].startswith(before["ddpexp.log"])  # the log may say more, never less
    assert not [p for p in run_dir.rglob("*.tmp")]

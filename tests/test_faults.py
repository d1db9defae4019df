"""The fault-injection suite: crashes, signals and restarts, checked the way a user would notice them.

Every case checks the exit code, how fast the run stopped, the message, that no process of the run
survives (every process ever seen in the launcher's tree, recorded while it ran), that the master port
is free again, and that what was saved still loads. Failures are injected with DDPEXP_FAULT
(ddpexp/faults.py) or signals from outside; every wait has a timeout, so a regression fails, not hangs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from ddpexp import checkpoint, runner
from ddpexp.launch.rendezvous import free_port, port_is_free

from .conftest import QUICK, RESUME, metrics, run_ddpexp, run_here, same_weights, scalars

pytestmark = pytest.mark.multiproc

LONG = [*QUICK, "trainer.epochs=500", "checkpoint.every_steps=5", "hydra.run.dir=run"]
WATCHED: list[Watched] = []


@pytest.fixture(autouse=True)
def _nothing_outlives_its_test():
    """After each test (its assertions done), kill what it started and left running: a failing case
    must not leave a sweep running into the next ones (a timed-out one did, for 20 minutes)."""
    before = set(psutil.Process().children(recursive=True))
    yield
    left = set(psutil.Process().children(recursive=True)) - before
    for run in WATCHED:
        left |= {p for p in run.seen.values() if not _gone(p)}
    WATCHED.clear()
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()


class Watched:
    """A ddpexp command started in the background, with every process of its tree recorded."""

    def __init__(
        self, cwd: Path, args: list[str], *, fault: str | None = None, torchrun: bool = False
    ) -> None:
        self.cwd = cwd
        self.port = free_port("127.0.0.1")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if fault:
            env["DDPEXP_FAULT"] = fault
        if torchrun:
            prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
            cmd = [*prefix, "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}"]
            cmd += ["--max-restarts=1", "-m", "ddpexp", *args]
        else:
            cmd = [sys.executable, "-m", "ddpexp", *args, f"dist.master_port={self.port}"]
        self.started = time.time()
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.seen: dict[int, psutil.Process] = {}
        self.rank_of: dict[int, str] = {}  # worker pid -> its rank, read while it was alive
        self.gone_at: dict[int, float] = {}
        self._watching = True
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        WATCHED.append(self)

    def _watch(self) -> None:
        root = psutil.Process(self.proc.pid)
        while self._watching:
            try:
                for p in root.children(recursive=True):
                    self.seen.setdefault(p.pid, p)
                    if p.pid not in self.rank_of:  # a worker names itself ddpexp-rank<N> as it starts
                        self._note_rank(p)
            except psutil.NoSuchProcess:
                pass
            now = time.time()
            for pid, p in self.seen.items():
                if pid not in self.gone_at and _gone(p):
                    self.gone_at[pid] = now
            time.sleep(0.05)

    def _note_rank(self, p: psutil.Process) -> None:
        """Workers show up as ddpexp-rank<N>. A worker's short-lived child (a shell an import runs, say)
        carries that name between fork and exec, so a process whose parent is a worker is not one."""
        try:
            name = p.name()
            if name.startswith("ddpexp-rank") and not p.parent().name().startswith("ddpexp-rank"):
                self.rank_of[p.pid] = name.removeprefix("ddpexp-rank")
        except psutil.Error:
            pass

    def ranks_seen(self) -> set[str]:
        return set(self.rank_of.values())

    def exit_time_of_rank(self, rank: int) -> float:
        (pid,) = [pid for pid, r in self.rank_of.items() if r == str(rank)]
        return self.gone_at[pid]

    def wait_until_training(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            path = self.cwd / "run" / "metrics.json"
            if (
                path.exists()
                and metrics(self.cwd / "run")["history"]
                and (self.cwd / "run/checkpoints").is_dir()
            ):
                return
            time.sleep(0.2)
        raise AssertionError("training never got under way")

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            self.proc.kill()
            self.ended = time.time()
            time.sleep(0.2)
            self._watching = False
            self._thread.join()
        return self.proc.returncode, out, err

    def assert_nothing_left(self) -> None:
        """No process of the run survives; the rendezvous port can be bound again."""
        procs = list(self.seen.values())
        assert procs, "no process of the run was ever seen"
        _, alive = psutil.wait_procs(procs, timeout=10)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, _cmdline(p)) for p in alive]
        assert port_is_free("127.0.0.1", self.port)


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # it went between the two questions
        return True


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _last_checkpoint_step(run_dir: Path) -> int:
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")["step"]


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
    assert _last_checkpoint_step(tmp_path / "run") == 10


def _pid_of_rank(run: Watched, rank: int, timeout: float = 30) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [pid for pid, r in run.rank_of.items() if r == str(rank)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never showed up")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_sent_to_one_worker_is_blamed_on_that_worker(tmp_path: Path, sig: signal.Signals):
    """Its peer then fails with a broken connection; the report names the signalled rank, not it."""
    run = Watched(tmp_path, ["strategy=ddp", *LONG])
    run.wait_until_training()
    os.kill(_pid_of_rank(run, 1), sig)
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
    os.kill(_pid_of_rank(run, 1), signal.SIGSTOP)
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
    assert _last_checkpoint_step(tmp_path / "run") == 5
    again = Watched(tmp_path, ["strategy=ddp", *LONG, "trainer.max_steps=20", "trainer.resume=auto"])
    code, out, err = again.finish()
    assert code == 0, err
    assert "resumed from" in out + err and "step-00000005.pt" in out + err
    assert not any(p.name.endswith(".tmp") for p in folder.iterdir())
    assert _last_checkpoint_step(tmp_path / "run") == 20
    again.assert_nothing_left()


# ------------------------------------------------------------------------------- the launcher


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_every_worker(tmp_path: Path, sig: int, code: int):
    run = Watched(tmp_path, ["strategy=ddp", *LONG])
    run.wait_until_training()
    sent = time.time()
    run.proc.send_signal(sig)
    returned, _out, err = run.finish(timeout=60)
    assert returned == code, err
    assert run.ended - sent < 10
    run.assert_nothing_left()
    m = metrics(tmp_path / "run")
    assert m["status"] == "interrupted" and m["history"]  # what was recorded before the signal stays
    assert scalars(tmp_path / "run")["eval/acc"][0][0] == m["history"][0]["step"]
    assert _last_checkpoint_step(tmp_path / "run") >= 5


def test_a_killed_launcher_takes_its_workers_with_it(tmp_path: Path):
    run = Watched(tmp_path, ["strategy=ddp", *LONG])
    run.wait_until_training()
    run.proc.kill()  # SIGKILL: no handler runs in the launcher
    run.finish(timeout=30)
    assert run.ranks_seen() == {"0", "1"}
    run.assert_nothing_left()
    assert _last_checkpoint_step(tmp_path / "run") >= 5


def test_a_killed_torchrun_agent_takes_its_workers_with_it(tmp_path: Path):
    """SIGKILL to torchrun's agent: its workers (ddpexp's ranks) exit too, instead of training on as
    orphans."""
    run = Watched(tmp_path, ["strategy=ddp", *LONG], torchrun=True)
    run.wait_until_training()
    run.proc.kill()
    run.finish(timeout=30)
    run.assert_nothing_left()


def test_sigterm_to_torchrun_records_the_run_as_interrupted(tmp_path: Path):
    """What Slurm sends on preemption or time-out: the workers stop and metrics.json says so."""
    run = Watched(tmp_path, ["strategy=ddp", *LONG], torchrun=True)
    run.wait_until_training()
    run.proc.send_signal(signal.SIGTERM)
    run.finish(timeout=60)
    run.assert_nothing_left()
    m = metrics(tmp_path / "run")
    assert m["status"] == "interrupted" and m["history"], m["status"]


# ------------------------------------------------------------------------------- restarts


@pytest.mark.parametrize(
    ("strategy", "fault", "torchrun"),
    [
        ("ddp", "rank1:step45:kill", False),
        ("single", "rank0:step45:raise", False),
        ("ddp", "rank1:step45:kill", True),
    ],
    ids=["ddp-kill", "single-raise", "torchrun-ddp-kill"],
)
def test_a_restart_resumes_and_ends_identical_to_the_uninterrupted_run(
    tmp_path: Path, uninterrupted, strategy: str, fault: str, torchrun: bool
):
    args = [f"strategy={strategy}", *RESUME, "trainer.max_steps=70", "hydra.run.dir=run"]
    if not torchrun:
        args.append("dist.max_restarts=1")
    run = Watched(tmp_path, args, fault=fault, torchrun=torchrun)
    code, out, err = run.finish(timeout=240)
    assert code == 0, err
    run.assert_nothing_left()
    assert "step-00000040.pt" in out + err  # resumed from the newest checkpoint before the fault
    if not torchrun:
        assert "restarting the workers (1 of 1 restarts)" in err
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # one run dir, however many attempts
    m = metrics(tmp_path / "run")
    assert m["status"] == "completed" and m["attempts"] == 2
    assert m["final"]["eval/acc"] == metrics(uninterrupted(strategy))["final"]["eval/acc"]
    assert same_weights(tmp_path / "run", uninterrupted(strategy))


def test_sigterm_to_every_process_with_checkpoint_on_signal_saves_then_resumes_identical(
    tmp_path: Path, uninterrupted
):
    """What Slurm does before preempting a job: SIGTERM to every process of it. With
    trainer.checkpoint_on_signal every rank saves at one step boundary, the run ends `preempted` with
    exit 143, and the same command with trainer.resume=auto ends identical to an uninterrupted run."""
    args = ["strategy=ddp", *RESUME, "trainer.max_steps=70", "hydra.run.dir=run"]
    run = Watched(tmp_path, [*args, "trainer.checkpoint_on_signal=true"])
    run.wait_until_training()
    for pid in [run.proc.pid, *run.rank_of]:  # the launcher and both ranks
        os.kill(pid, signal.SIGTERM)
    code, out, err = run.finish()
    assert code == 143, err
    run.assert_nothing_left()
    m = metrics(tmp_path / "run")
    stopped_at = _last_checkpoint_step(tmp_path / "run")
    assert m["status"] == "preempted" and f"stopped by SIGTERM at step {stopped_at}" in m["error"], m
    assert 32 < stopped_at < 70 and "with trainer.resume=auto" in out + err
    again = run_here(tmp_path, *args, "trainer.resume=auto")
    assert again.returncode == 0, again
    assert metrics(tmp_path / "run")["status"] == "completed"
    assert same_weights(tmp_path / "run", uninterrupted("ddp"))


def test_without_restarts_a_failure_is_final(tmp_path: Path):
    run = Watched(tmp_path, ["strategy=single", *LONG, "trainer.max_steps=20"], fault="rank0:step7:raise")
    code, _out, err = run.finish()
    assert code == 1 and "InjectedFault" in err and "restarting" not in err, err
    assert metrics(tmp_path / "run")["status"] == "failed"
    assert _last_checkpoint_step(tmp_path / "run") == 5


def test_a_full_disk_when_the_launcher_records_a_failure_is_said_once(tmp_path: Path, monkeypatch):
    import errno

    from ddpexp import recorder

    def disk_full(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    # The launcher's own metrics.json write only: the workers are processes of their own.
    monkeypatch.setattr(recorder, "atomic_write_text", disk_full)
    monkeypatch.setenv("DDPEXP_FAULT", "rank1:step3:raise")
    result = run_here(tmp_path, "strategy=ddp", *QUICK, "trainer.max_steps=20", "hydra.run.dir=run")
    assert result.returncode == 1, result
    assert result.stderr.count("disk full") == 1 and "rank 1 of 2 failed: InjectedFault" in result.stderr
    assert f"run dir: {tmp_path / 'run'}  (exit code 1)" in result.stdout, result


# ------------------------------------------------------------------------------- results that lie


def _strict_json(path: Path) -> dict:
    """json.loads that refuses NaN/Infinity, as JSON.parse and most other readers do."""
    import json

    def refuse(name: str) -> None:
        raise ValueError(f"{name} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_diverging_loss_fails_the_run_at_a_log_point(tmp_path: Path):
    args = [*QUICK, "optim.lr=1e10", "trainer.log_every_steps=5", "trainer.max_steps=40"]
    result = run_here(tmp_path, *args, "hydra.run.dir=run")
    assert result.returncode == 1, result
    assert "loss became NaN at step ~" in result.stderr and "optim.lr" in result.stderr
    m = _strict_json(tmp_path / "run" / "metrics.json")
    assert m["status"] == "failed" and "loss became NaN" in m["error"]
    warned = run_here(tmp_path, *args, "trainer.on_nonfinite=warn", "hydra.run.dir=warned")
    assert warned.returncode == 0, warned
    m = _strict_json(tmp_path / "warned" / "metrics.json")  # strict JSON although the loss is NaN
    assert (
        m["status"] == "completed"
        and m["final"]["train/epoch_loss"] is None
        and "train/epoch_loss" in m["nonfinite"]
    )


def test_a_run_that_would_take_no_step_is_refused_not_completed(tmp_path: Path):
    """digits does not say its size before loading: the worker refuses instead of 'completing' with
    the initial weights (sources that know their size are refused in pre-flight, see test_cli)."""
    result = run_here(tmp_path, "trainer.batch_size=4096", "trainer.progress=false", "hydra.run.dir=run")
    assert result.returncode == 2, result
    assert "no optimizer step at global batch 4096" in result.stdout + result.stderr
    recorded = tmp_path / "run" / "metrics.json"
    assert not recorded.exists() or _strict_json(recorded)["status"] != "completed"


def _checksums(run_dir: Path) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def test_resume_auto_never_changes_a_finished_run(tmp_path: Path):
    """A refused resume (another model) leaves every byte as it was; resume=auto on a completed run
    says so and exits 0, again without touching anything."""
    args = [*QUICK, "trainer.max_steps=6", "trainer.log_every_steps=2", "hydra.run.dir=run"]
    first = run_here(tmp_path, *args)
    assert first.returncode == 0, first
    before = _checksums(tmp_path / "run")
    refused = run_here(tmp_path, *args, "model=toy", "trainer.resume=auto")
    assert refused.returncode == 2 and "trainer.resume" in refused.stderr, refused
    assert _checksums(tmp_path / "run") == before
    again = run_here(tmp_path, *args, "trainer.resume=auto")
    assert again.returncode == 0, again
    assert "already complete" in again.stdout and "resumed" not in again.stdout + again.stderr
    assert _checksums(tmp_path / "run") == before
    more = run_here(
        tmp_path, *[a for a in args if "max_steps" not in a], "trainer.max_steps=8", "trainer.resume=auto"
    )
    assert more.returncode == 0, more
    assert metrics(tmp_path / "run")["final"]["step"] == 8  # asking for more steps does continue


def test_ctrl_c_during_pre_flight_is_one_line_and_exit_130(tmp_path: Path):
    """A sweep of 400 jobs keeps pre-flight busy composing and checking for several seconds."""
    cmd = [sys.executable, "-m", "ddpexp", "-m", "seed=range(0,400)", *QUICK]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(4)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["ddpexp: interrupted before anything started"], err
    assert not (tmp_path / "multirun").exists()


def test_sigterm_stops_a_sweep_whose_output_is_gone(tmp_path: Path):
    """A sweep whose stdout was closed (its terminal or pipe gone) cannot print a job's run dir: that
    must not turn SIGTERM into "stop this job, go on with the next" (an orphaned sweep ran on so)."""
    cmd = [sys.executable, "-m", "ddpexp", "-m", "seed=range(0,40)", *QUICK, "hydra.sweep.dir=sweep"]
    with open(tmp_path / "err.txt", "w") as err_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err_file)
    try:
        proc.stdout.close()  # type: ignore[union-attr]  # nobody reads: the sweep's prints fail
        deadline = time.time() + 120
        while len(_run_dirs(tmp_path / "sweep")) < 3:  # two jobs ended, their run dirs unprintable
            assert time.time() < deadline and proc.poll() is None, (tmp_path / "err.txt").read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143, (tmp_path / "err.txt").read_text()
    finally:
        proc.kill()
    statuses = sorted(metrics(d)["status"] for d in _run_dirs(tmp_path / "sweep"))
    assert statuses.count("interrupted") == 1 and statuses.count("running") == 0, statuses
    assert len(statuses) <= 4, f"the sweep went on after SIGTERM: {len(statuses)} jobs"


# ----------------------------------------------------------------------------- one directory, one run


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_a_run_dir_in_use_by_another_run_is_refused_and_left_as_it_was(tmp_path: Path):
    """Two runs started into one hydra.run.dir: the second is refused (exit 2, the holder's PID) and
    writes nothing there; once the holder is gone, however it ended, the directory is free again."""
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

    def save_then_overwrite(self: Job) -> None:
        save(self)
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


def test_ctrl_c_under_submitit_stops_its_local_jobs_and_says_so_in_one_line(tmp_path: Path):
    """Ctrl-C in a terminal reaches the submitting command and the jobs submitit started on this
    machine (one process group): exit 130, one line that says where jobs go on (Slurm), nothing left."""
    args = ["-m", "hydra/launcher=submitit_local", *QUICK, "trainer.epochs=500", "hydra.sweep.dir=sweep"]
    cmd = [sys.executable, "-m", "ddpexp", *args]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # a terminal's foreground process group
    deadline = time.time() + 120
    while not any(m["history"] for m in map(metrics, _run_dirs(tmp_path / "sweep"))):
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
    (run_dir,) = _run_dirs(tmp_path / "sweep")
    assert metrics(run_dir)["status"] == "interrupted"


def _run_dirs(sweep: Path) -> list[Path]:
    return [p.parent for p in sweep.glob("*/metrics.json")]


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

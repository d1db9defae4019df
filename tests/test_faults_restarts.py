"""The fault-injection suite, continued (helpers: tests/fault_harness.py): restarts that resume and end
identical, and results that do not lie (failures recorded, refused runs, finished runs left alone)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from .conftest import QUICK, RESUME, metrics, run_here, same_weights
from .fault_harness import (
    LONG,
    Watched,
    _gone,
    _nothing_outlives_its_test,  # noqa: F401  (autouse: kills what a case left running)
    last_checkpoint_step,
    run_dirs,
)

pytestmark = pytest.mark.multiproc


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
    stopped_at = last_checkpoint_step(tmp_path / "run")
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
    assert last_checkpoint_step(tmp_path / "run") == 5


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


# Loaded by every Python process of a command (PYTHONPATH), so that a test waits for events instead of
# sleeping. Each process records itself as it starts (<DDPEXP_TEST_PROCS>/<pid>: its command line).
# DDPEXP_TEST_PAUSES is a ";"-list of WHO=MODULE: a process whose command line contains WHO, the moment
# it first imports MODULE, writes <DDPEXP_TEST_PROCS>/paused-MODULE and waits there, inside that
# import, until <DDPEXP_TEST_PROCS>/go-MODULE exists (forever if the test never writes it).
_RECORD_AND_PAUSE = """
import os, sys, time
_procs = os.environ.get("DDPEXP_TEST_PROCS")
if _procs:
    with open("/proc/self/cmdline", "rb") as f:
        _cmdline = f.read().replace(b"\\0", b" ").decode()
    with open(os.path.join(_procs, str(os.getpid())), "w") as f:
        f.write(_cmdline)
    class _Pause:
        def __init__(self, module):
            self.module = module
        def find_spec(self, name, path=None, target=None):
            if name == self.module:
                sys.meta_path.remove(self)
                open(os.path.join(_procs, "paused-" + name), "w").close()
                while not os.path.exists(os.path.join(_procs, "go-" + name)):
                    time.sleep(0.01)
            return None
    for _spec in filter(None, os.environ.get("DDPEXP_TEST_PAUSES", "").split(";")):
        _who, _module = _spec.split("=")
        if _who in _cmdline:
            sys.meta_path.insert(0, _Pause(_module))
"""
COMMAND, FORKSERVER = "-m ddpexp", "multiprocessing.forkserver"


@pytest.fixture(autouse=True)
def _recorded_processes_killed(tmp_path: Path) -> Iterator[None]:
    """Processes a command left behind are no longer its children (or this test's): the ones it
    recorded (a forkserver held in its import for good, when a test fails) are killed by their pid."""
    yield
    for pid, cmdline in recorded(tmp_path).items() if (tmp_path / "procs").is_dir() else ():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if " ".join(process.cmdline()) == cmdline.strip():
                process.kill()


def recording(tmp_path: Path, **pauses: str) -> dict[str, str]:
    """The environment for a command whose processes record themselves and pause (see above):
    `pauses` maps a command-line substring to the module its process pauses at."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_RECORD_AND_PAUSE)
    (tmp_path / "procs").mkdir()
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])),
        "DDPEXP_TEST_PROCS": str(tmp_path / "procs"),
        "DDPEXP_TEST_PAUSES": ";".join(f"{who}={module}" for who, module in pauses.items()),
    }


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen[str] | None = None) -> None:
    """Wait until `condition` holds (an event: a file written, a process recorded); fail, with the
    command's output, if its process ends first or nothing happens for two minutes."""
    deadline = time.monotonic() + 120
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the command ended first: {proc.communicate()}")
        assert time.monotonic() < deadline, "the event never came"
        time.sleep(0.01)


def recorded(tmp_path: Path) -> dict[int, str]:
    """pid -> command line of every Python process the command started (and the command itself)."""
    return {int(p.name): p.read_text() for p in (tmp_path / "procs").iterdir() if p.name.isdigit()}


def paused(tmp_path: Path, module: str) -> bool:
    return (tmp_path / "procs" / f"paused-{module}").exists()


def test_ctrl_c_during_pre_flight_is_one_line_and_exit_130(tmp_path: Path):
    """Ctrl-C once pre-flight has begun, while the workers' forkserver the command started early
    (launch/warmup.py) still imports torch: one line, exit 130, nothing made, and the forkserver does
    not outlive the command (it is held in its import for good: only a kill ends it)."""
    # the command pauses as pre-flight begins; its forkserver, in its import of torch, for good
    env = recording(tmp_path, **{COMMAND: "ddpexp.preflight", FORKSERVER: "torch"})
    cmd = [sys.executable, "-m", "ddpexp", "-m", "seed=range(0,4)", *QUICK]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    wait_for(lambda: paused(tmp_path, "ddpexp.preflight") and paused(tmp_path, "torch"), proc)
    proc.send_signal(signal.SIGINT)
    (tmp_path / "procs" / "go-ddpexp.preflight").touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["ddpexp: interrupted before anything started"], err
    assert not (tmp_path / "multirun").exists()
    assert not left_running(recorded(tmp_path))


def test_bad_input_leaves_no_process_behind_not_even_the_early_forkserver(tmp_path: Path):
    """The command line starts the workers' forkserver before pre-flight (launch/warmup.py); when
    pre-flight refuses the input, that server, still importing torch (held there for good), is
    stopped before the command exits: exit 2, one line, and every process the command started is gone."""
    # the command pauses as pre-flight begins; its forkserver, in its import of torch, for good
    env = recording(tmp_path, **{COMMAND: "ddpexp.preflight", FORKSERVER: "torch"})
    cmd = [sys.executable, "-m", "ddpexp", "strategy=ddp", "trainer.batch_size=63", *QUICK]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    wait_for(lambda: paused(tmp_path, "ddpexp.preflight") and paused(tmp_path, "torch"), proc)
    (tmp_path / "procs" / "go-ddpexp.preflight").touch()
    _out, err = proc.communicate(timeout=60)  # (a server left running would hold the pipes open)
    assert proc.returncode == 2 and err.startswith("ddpexp: error: ") and len(err.splitlines()) == 1, err
    assert not left_running(recorded(tmp_path))


def test_a_killed_launcher_leaves_no_forkserver_behind_even_while_it_imports(tmp_path: Path):
    """SIGKILL to the command while the workers' forkserver it started early still imports torch (held
    in that import for good): the server dies with it (launch/tether.py), instead of living on as an
    orphan until its imports are done."""
    env = recording(tmp_path, **{COMMAND: "ddpexp.preflight", FORKSERVER: "torch"})
    cmd = [sys.executable, "-m", "ddpexp", "strategy=ddp", *QUICK, "hydra.run.dir=run"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    wait_for(lambda: paused(tmp_path, "ddpexp.preflight") and paused(tmp_path, "torch"), proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert not left_running(recorded(tmp_path))


def left_running(procs: dict[int, str]) -> list[str]:
    """The command lines of `procs` still running once their command has ended: each gets ten seconds
    to go (the resource tracker leaves when it reads EOF, a moment after its command)."""
    alive = []
    for pid, cmdline in procs.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            with contextlib.suppress(psutil.TimeoutExpired):
                process.wait(timeout=10)
            if not _gone(process):
                alive.append(cmdline)
    return alive


def test_a_ctrl_c_reaching_the_early_forkserver_while_it_imports_is_not_a_traceback(tmp_path: Path):
    """A terminal's Ctrl-C goes to the whole foreground process group, the forkserver the command line
    started early included (launch/warmup.py). One that lands while the server imports torch (paused
    in that import) must not kill it with a KeyboardInterrupt traceback under the command's one line:
    it starts with SIGINT blocked. (Its workers unblock it: the SIGINT case of the blame test in
    test_faults.py.)"""
    env = recording(tmp_path, **{FORKSERVER: "torch"})
    script = (
        "import os, signal, time\n"
        "from ddpexp.config import StartMethod\n"
        "from ddpexp.launch import warmup\n"
        "warmup.start_early()\n"
        "pid = warmup._unclaimed\n"
        f"procs = {str(tmp_path / 'procs')!r}\n"
        "while not os.path.exists(os.path.join(procs, 'paused-torch')):\n"
        "    time.sleep(0.01)\n"
        "os.kill(pid, signal.SIGINT)  # mid-import: the server is paused inside import torch\n"
        "open(os.path.join(procs, 'go-torch'), 'w').close()\n"
        "warmup.settle(StartMethod.forkserver)  # a dead server would be started anew here\n"
        "warmup.finish()  # a process forked from the server once its imports are done\n"
        "print('alive' if warmup._server()._forkserver_pid == pid else 'dead')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "alive\n" and "KeyboardInterrupt" not in done.stderr, done.stderr


# Loaded by every Python process of the command (PYTHONPATH): Ctrl-C, as the command's process feels
# it, the moment it first imports the module named in DDPEXP_TEST_SIGINT_AT.
_SIGINT_AT_IMPORT = """
import os, signal, sys
class _Trip:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["DDPEXP_TEST_SIGINT_AT"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, _Trip())
"""


@pytest.mark.parametrize(
    "module",
    [
        "hydra",  # the command's first imports (its config schema)
        "numpy",  # imported from inside torch._C's initialisation, which swallows exceptions there
    ],
)
def test_a_ctrl_c_while_the_command_imports_is_one_line_and_exit_130(tmp_path: Path, module: str):
    """Ctrl-C in the command's first seconds, while it imports: exit 130 and the one line, at every
    point. Seen before: a traceback (SIGINT while the first import ran outside the command's guard),
    and, worse, a run that went on (torch imports numpy from C and drops the KeyboardInterrupt raised
    there, leaving numpy half-imported)."""
    (tmp_path / "sitecustomize.py").write_text(_SIGINT_AT_IMPORT)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "DDPEXP_TEST_SIGINT_AT": module}
    cmd = [sys.executable, "-m", "ddpexp", "strategy=ddp", *QUICK, "trainer.max_steps=3", "hydra.run.dir=run"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    one_line = "ddpexp: interrupted before anything started\n"
    assert (done.returncode, done.stderr) == (130, one_line), done.stderr
    assert not (tmp_path / "run").exists()


# Loaded as a Hydra callback (PYTHONPATH): SIGTERM to the sweep from inside Hydra, between its jobs.
_SIGTERM_BETWEEN_JOBS = """
import os, signal
from hydra.experimental.callback import Callback
class SigtermAt(Callback):
    def __init__(self, event, job):
        self.event, self.job = event, job
    def _trip(self, event, config):
        if event == self.event and config.hydra.job.num == self.job:
            os.kill(os.getpid(), signal.SIGTERM)
    def on_job_start(self, config, **kwargs):
        self._trip("start", config)
    def on_job_end(self, config, job_return, **kwargs):
        self._trip("end", config)
"""


@pytest.mark.parametrize("event", ["end", "start"])  # job 1 has ended; job 1 is about to start
def test_sigterm_between_a_sweeps_jobs_stops_it_with_143(tmp_path: Path, event: str):
    """A SIGTERM that reaches a sweep while Hydra goes from one job to the next, where no job's handler
    is installed, stops the sweep as one inside a job does: exit 143, no job after it, every job
    started recorded. Seen before: the default action killed the sweep (exit -15)."""
    (tmp_path / "trip.py").write_text(_SIGTERM_BETWEEN_JOBS)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "ddpexp", "-m", "seed=range(0,4)", *QUICK, "trainer.max_steps=2"]
    trip = ["+hydra.callbacks.trip._target_=trip.SigtermAt", f"+hydra.callbacks.trip.event={event}"]
    cmd += [*trip, "+hydra.callbacks.trip.job=1", "hydra.sweep.dir=sweep"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 143, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    statuses = [metrics(d)["status"] for d in sorted(run_dirs(tmp_path / "sweep"))]
    assert statuses == (["completed", "completed"] if event == "end" else ["completed"]), statuses


def test_sigterm_stops_a_sweep_whose_output_is_gone(tmp_path: Path):
    """A sweep whose stdout was closed (its terminal or pipe gone) cannot print a job's run dir: that
    must not turn SIGTERM into "stop this job, go on with the next" (an orphaned sweep ran on so)."""
    cmd = [sys.executable, "-m", "ddpexp", "-m", "seed=range(0,40)", *QUICK, "hydra.sweep.dir=sweep"]
    with open(tmp_path / "err.txt", "w") as err_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err_file)
    try:
        proc.stdout.close()  # type: ignore[union-attr]  # nobody reads: the sweep's prints fail
        deadline = time.time() + 600  # for a hung sweep; two jobs take minutes on a busy host
        while len(run_dirs(tmp_path / "sweep")) < 3:  # two jobs ended, their run dirs unprintable
            assert time.time() < deadline and proc.poll() is None, (tmp_path / "err.txt").read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143, (tmp_path / "err.txt").read_text()
    finally:
        proc.kill()
    statuses = sorted(metrics(d)["status"] for d in run_dirs(tmp_path / "sweep"))
    assert statuses.count("interrupted") == 1 and statuses.count("running") == 0, statuses
    assert len(statuses) <= 4, f"the sweep went on after SIGTERM: {len(statuses)} jobs"


def test_a_run_that_failed_after_its_last_checkpoint_is_finished_by_a_resume(tmp_path: Path, monkeypatch):
    """max_steps 10, checkpoints every 5, a failure after step 10's checkpoint (before the final
    evaluation and model.pt): `failed`, with nothing left to train but its work undone. A resume does
    what is left (the final evaluation, model.pt, completed) instead of saying it is complete."""
    args = [*QUICK, "trainer.max_steps=10", "checkpoint.every_steps=5", "hydra.run.dir=run"]
    monkeypatch.setenv("DDPEXP_FAULT", "rank0:step10:raise")
    first = run_here(tmp_path, *args)
    assert first.returncode != 0 and metrics(tmp_path / "run")["status"] == "failed", first
    assert not (tmp_path / "run" / "model.pt").exists()
    monkeypatch.delenv("DDPEXP_FAULT")
    again = run_here(tmp_path, *args, "trainer.resume=auto")
    assert again.returncode == 0 and "already complete" not in again.stdout, again
    m = metrics(tmp_path / "run")
    assert m["status"] == "completed" and m["final"]["step"] == 10 and "eval/acc" in m["final"]
    assert (tmp_path / "run" / "model.pt").exists()
    done = run_here(tmp_path, *args, "trainer.resume=auto")  # now there is nothing left to do
    assert done.returncode == 0 and "already complete" in done.stdout, done

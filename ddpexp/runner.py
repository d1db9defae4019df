"""Hydra's part of a run: make each job's run directory (one per job of a sweep, named after what
varies) and call the task once per job. The task re-checks its job, writes config.yaml and plan.json,
and launches it. Used by the command line and by the in-process API alike; neither touches sys.argv.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from . import composition, fsutil, host, interrupts, remote
from .errors import NothingToDo, UserError
from .interrupts import Interrupted
from .job import Job, Outcome
from .launch import warmup
from .launch.error_records import error_summary, read_error
from .launch.supervise import STOP_SIGNALS, signals_ignored, stops_raise
from .plan import ExternalWorld
from .recorder import finish_metrics, settle_lost
from .runrecord import METRICS_FILE, read_run_record_or_none

log = logging.getLogger(__name__)


class JobFailed(Exception):
    """A job that ran in another process (a submitit/Slurm launcher) ended non-zero: raised from the task
    so that the launcher and Hydra record the failure; its args are the Outcome's fields."""


def _sweep_subdir(override_dirname: str, num: int) -> str:
    name = override_dirname.replace("/", "_")
    return name or f"job{num}"


OmegaConf.register_new_resolver("ddpexp_subdir", _sweep_subdir, replace=True)


# Exit codes that stop a sweep: Ctrl-C, SIGTERM, a closed terminal (SIGHUP), and a run that stopped
# (checkpointed or not) for SIGUSR1/SIGUSR2.
STOP_CODES = {128 + s for s in STOP_SIGNALS}
SCHEDULER_ENV = ("SLURM_JOB_ID", "SUBMITIT_EXECUTOR")  # under these, checkpoint_on_signal defaults on
SUBMITIT_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"  # submitit's preemption/time-out signal (USR2)
INTERRUPTED_REMOTE = (
    "ddpexp: interrupted while waiting for the sweep's jobs: jobs started on this machine got the same "
    "Ctrl-C and stop; Slurm jobs go on (see squeue, stop them with scancel)"
)


def run_jobs(
    overrides: list[str],
    *,
    multirun: bool,
    started_at: float,
    report: Callable[[Outcome], None],
    config_name: str = composition.CONFIG_NAME,
    sweep_dir: Path | None = None,
    hydra_subdir: str | None = None,
) -> list[Outcome]:
    """Run the job (or every job of the sweep) through Hydra; `started_at` is when the command began
    (facts.command_started_at). Each job's clock starts when that job starts, the first's too, once
    what the jobs share is ready (launch/warmup.finish): a job's time to first step and to target are
    its own, wherever it runs in the sweep. `report` hears of each job as it ends (the command line
    prints its run dir and error). `hydra_subdir`: where each job writes Hydra's record of itself,
    which pre-flight told Hydra not to write (hydra_record)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    outcomes: list[Outcome] = []
    killed: list[str] = []  # submitit jobs that left no result (remote.py)
    here = os.getpid()

    def task(cfg: DictConfig) -> float | None:
        interrupts.raise_if_requested()  # a stop signal whose exception a finalizer dropped
        warmup.finish()  # a no-op after the first job, and in a process that did no pre-flight
        outcome = run_job(
            cfg,
            started_at=time.time(),
            command_started_at=started_at,
            sweep=multirun,
            hydra_subdir=hydra_subdir,
        )
        outcomes.append(outcome)
        with suppress(OSError):  # stdout gone (a closed terminal or pipe): the run dir says it all,
            report(outcome)  # and the sweep must still stop or go on as the outcome says
        if outcome.exit_code in STOP_CODES:  # Ctrl-C, SIGTERM, a preemption: the whole sweep stops
            raise SystemExit(outcome.exit_code)
        interrupts.raise_if_requested()
        if outcome.exit_code != 0 and os.getpid() != here:  # a remote job: only an exception says so
            raise JobFailed(str(outcome.run_dir), outcome.exit_code, outcome.error)
        return best_value(outcome.run_dir)

    composition.register_schema()
    GlobalHydra.instance().clear()
    interrupts.clear()  # a stop asked of an earlier command in this process (the Python API)
    try:
        conf = composition.conf_dir()
        with (
            _logging_restored(),
            initialize_config_dir(config_dir=conf, version_base="1.3", job_name="ddpexp"),
            stops_raise(),
        ):
            hydra = GlobalHydra.instance().hydra
            assert hydra is not None
            if multirun:
                # each job's outcome is read back from its run dir below
                with suppress(JobFailed), remote.killed_jobs_fail(JobFailed) as killed:
                    try:
                        hydra.multirun(config_name=config_name, task_function=task, overrides=overrides)
                    except KeyboardInterrupt:  # jobs another process runs (submitit): one line
                        print(INTERRUPTED_REMOTE, file=sys.stderr)
                        raise SystemExit(130) from None
            else:
                hydra.run(config_name=config_name, task_function=task, overrides=overrides)
    except Interrupted as exc:  # between jobs, or in one before its launcher took the signals over
        raise SystemExit(exc.code) from None
    finally:
        GlobalHydra.instance().clear()
    if multirun and not outcomes and sweep_dir is not None:  # the jobs ran elsewhere (submitit, Slurm)
        outcomes = remote_outcomes(sweep_dir)
        if killed and all(o.exit_code == 0 for o in outcomes):  # killed before it wrote a record
            outcomes += [Outcome(run_dir=sweep_dir, exit_code=1, error=line) for line in killed]
        for outcome in outcomes:
            report(outcome)
    return outcomes


def remote_outcomes(sweep_dir: Path) -> list[Outcome]:
    """What each job of a sweep run by another process said of itself in its metrics.json: its status
    (exit 0 only if completed) and error, with where its logs are."""
    outcomes = []
    for path in sorted(sweep_dir.glob(f"*/{METRICS_FILE}")):
        settle_lost(path.parent)  # a job killed outright: its record says so from now on
        record = read_run_record_or_none(path)
        status = record.status if record is not None else "unreadable metrics.json"
        if status == "completed":
            outcomes.append(Outcome(run_dir=path.parent, exit_code=0))
            continue
        error = (record.error if record is not None else None) or f"status {status}"
        logs = f"logs in {path.parent / 'logs'} and {sweep_dir / '.submitit'}"
        outcomes.append(Outcome(run_dir=path.parent, exit_code=1, error=f"{error} ({logs})"))
    return outcomes


@contextmanager
def _logging_restored() -> Iterator[None]:
    """Hydra points the root logger at each job's ddpexp.log; afterwards the caller's logging (a
    notebook's, a test's) is as it was, and the job's log file is closed."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def run_job(
    cfg: DictConfig,
    *,
    started_at: float,
    command_started_at: float,
    sweep: bool = False,
    hydra_subdir: str | None = None,
) -> Outcome:
    """One job: check it again on the machine it runs on, record it, launch it. A sweep's job first
    claims its own directory (a plain run's was claimed with the command's) and checks what it holds;
    only then is anything written there, Hydra's record of the job (`hydra_subdir`) too."""
    from hydra.core.hydra_config import HydraConfig

    from . import launch
    from .launch import torchrun
    from .plan import HostFacts
    from .preflight import check_job

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    choices = {
        k: str(v) for k, v in hc.runtime.choices.items() if not k.startswith("hydra") and v is not None
    }
    world = torchrun.world()
    external = ExternalWorld(*world) if world else None
    on_signal = cfg.trainer.checkpoint_on_signal
    if on_signal is None:
        on_signal = external is None and any(k in os.environ for k in SCHEDULER_ENV)
    given = copy.deepcopy(cfg)  # as Hydra composed it, for its record
    claim = None
    saved: Job | None = None  # the job, once its directory holds its config
    try:
        if sweep:  # another run may have taken this directory since the sweep began
            claim = claim_output(run_dir, setting="hydra.sweep.dir")
        if on_signal:
            resume_if_preempted(cfg, run_dir)
        checked_dir = run_dir if sweep else None  # a plain run's: checked by pre-flight, then claimed
        here = HostFacts.probe(spinning_threads=host.waits_unlike_its_workers())
        plan = check_job(cfg, here, external=external, multirun=sweep, run_dir=checked_dir)
        job = Job(
            cfg=cfg,
            plan=plan,
            run_dir=run_dir,
            choices=choices,
            started_at=started_at,
            command_started_at=command_started_at,
        )
        # The load before our processes add to it.
        job = dataclasses.replace(
            job,
            load_at_start=host.load_average(),
            checkpoint_on_signal=on_signal,
            varies=_varies(hc) if sweep else (),
        )
        record = hydra_record(given, run_dir, hydra_subdir) if hydra_subdir is not None else {}
        with _disk_full_stops_the_command():  # a resumed run's files stay as they were, all of them
            job.save(with_files=record)
        saved = job
        requeue = _submitit_requeue() if on_signal else None
        code = launch.run(job)
        if code != 0 and external is None:
            record_failure(job, code)
        if requeue is not None and code in STOP_CODES and _status(run_dir) == "preempted":
            requeue()  # submitit requeues this job (the same overrides, so the same run dir) and exits
        return Outcome(run_dir=run_dir, exit_code=code)
    except NothingToDo as done:  # a sweep's job that trainer.resume=auto finds complete
        return Outcome(run_dir=run_dir, exit_code=0, note=str(done))
    except UserError as exc:
        if external is not None:
            torchrun.publish_error(exc)
        return Outcome(run_dir=run_dir, exit_code=UserError.exit_code, error=str(exc))
    except Interrupted as exc:  # a stop signal before the job's launcher took them over (stops_raise)
        if saved is not None:  # perhaps launched too: its record says how it ended
            with signals_ignored():
                record_failure(saved, exc.code, why=str(exc))
        return Outcome(run_dir=run_dir, exit_code=exc.code)
    finally:
        if claim is not None:
            claim.release()


def record_failure(job: Job, code: int, *, why: str | None = None) -> None:
    """A run that ended before rank 0's recorder opened (its data failed to download or load, its model
    to build) left no metrics.json: write one that says how it ended, with the error its rank 0 left,
    so that every launched run's directory holds a record for the report and the API."""
    if (job.run_dir / METRICS_FILE).exists():
        return
    error = read_error(job.run_dir, 0)
    status = "interrupted" if code in STOP_CODES else "failed"
    if why is None:
        why = error_summary(error) if error is not None else f"exit code {code}"
    finish_metrics(job.run_dir, status, why, facts=job.summary())


def hydra_record(cfg: DictConfig, run_dir: Path, subdir: str) -> dict[Path, str]:
    """What Hydra writes of a job before running it (config.yaml, hydra.yaml, overrides.yaml), for the
    job to write once its directory is its own; hydra.yaml says what the user chose, not the override
    that stopped Hydra writing it (preflight.HYDRA_RECORD_OFF)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict, read_write

    from .preflight import HYDRA_RECORD_OFF

    hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)
    assert isinstance(hydra_cfg, DictConfig)
    with read_write(hydra_cfg.hydra), open_dict(hydra_cfg.hydra):  # Hydra made its node read-only
        hydra_cfg.hydra.output_subdir = subdir
        given = hydra_cfg.hydra.overrides.hydra
        hydra_cfg.hydra.overrides.hydra = [o for o in given if o != HYDRA_RECORD_OFF]
    files = {"config.yaml": cfg, "hydra.yaml": hydra_cfg, "overrides.yaml": hydra_cfg.hydra.overrides.task}
    return {run_dir / subdir / name: OmegaConf.to_yaml(content) for name, content in files.items()}


class DiskFull(BaseException):
    """The disk filled while a job's directory was set up: raised past Hydra, which would print a line
    of its own for any Exception, to run_command, which says so in one line (runner.disk_full)."""


@contextmanager
def _disk_full_stops_the_command() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise DiskFull(exc) from exc


def _varies(hc: Any) -> tuple[str, ...]:
    """The override keys that differ between a sweep's jobs: pre-flight leaves only those in the
    job's override_dirname (it excludes the constant ones), which also names its sub-directory."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in hc.overrides.task if "=" in o]
    return tuple(k for k in keys if f"{k}=" in hc.job.override_dirname)


def resume_if_preempted(cfg: DictConfig, run_dir: Path) -> None:
    """A job started again in the run dir of a run that checkpointed and stopped for a signal (a
    requeued Slurm/submitit job) continues it: trainer.resume=auto."""
    if cfg.trainer.resume is None and _status(run_dir) == "preempted":
        log.warning("ddpexp: %s was preempted; resuming it from its last checkpoint", run_dir)
        cfg.trainer.resume = "auto"


def _status(run_dir: Path) -> str | None:
    record = read_run_record_or_none(run_dir)
    return record.status if record is not None else None


def _submitit_requeue() -> Callable[[], None] | None:
    """Under submitit, its handler of the preemption signal, which checkpoints the submission (Hydra's
    launcher resubmits the same job) and requeues it: called once our run has saved and stopped."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    signum = getattr(signal, "SIG" + os.environ.get(SUBMITIT_SIGNAL_ENV, "USR2"), signal.SIGUSR2)
    handler = signal.getsignal(signum)
    if not callable(handler):
        return None
    return lambda: handler(signum, None)


def run_command(
    overrides: list[str],
    *,
    multirun: bool,
    started_at: float,
    report: Callable[[Outcome], None],
    config_name: str = composition.CONFIG_NAME,
    external: ExternalWorld | None = None,
) -> list[Outcome]:
    """What `python -m ddpexp` and `ddpexp.run`/`ddpexp.sweep` do, in this order: pre-flight every job
    (a UserError, or NothingToDo, before anything starts), then either join the run node 0 makes
    (dist.node_rank > 0: no directory of this machine's) or claim the run or sweep directory, run the
    jobs through Hydra and release it. `report` hears of each job as it ends."""
    from .preflight import preflight

    checked = preflight(overrides, multirun=multirun, external=external, config_name=config_name)
    if checked.joining is not None:
        from .launch import nodes

        outcome = nodes.follow(*checked.joining)
        report(outcome)
        return [outcome]
    setting = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    made = fsutil.first_missing(checked.output_dir) if checked.output_dir is not None else None
    claim = claim_output(checked.output_dir, setting=setting)
    try:
        if checked.output_dir is not None:  # a run killed outright there said `running`: now the truth
            for run_dir in [checked.output_dir, *(checked.output_dir.glob("*/") if multirun else ())]:
                settle_lost(run_dir)
        outcomes = run_jobs(
            checked.overrides,
            multirun=multirun,
            started_at=started_at,
            report=report,
            config_name=config_name,
            sweep_dir=checked.output_dir if multirun else None,
            hydra_subdir=checked.hydra_subdir,
        )
        if multirun and checked.output_dir is not None and checked.output_dir.is_dir():
            print(report_command(checked.output_dir), flush=True)  # the sweep's answer is one command away
        return outcomes
    except (OSError, DiskFull) as caught:
        exc = caught.args[0] if isinstance(caught, DiskFull) else caught
        if exc.errno != errno.ENOSPC or checked.output_dir is None:
            raise
        if claim is not None:
            claim.release()
        raise disk_full(checked.output_dir, made, exc, setting=setting) from exc
    finally:
        if claim is not None:
            claim.release()


def report_command(sweep_dir: Path) -> str:
    """The line a sweep ends with: the report command for its own directory (relative to the working
    directory when below it), quoted for a shell, to copy and run as it is."""
    shown = Path(os.path.relpath(sweep_dir)) if sweep_dir.resolve().is_relative_to(Path.cwd()) else sweep_dir
    return f"report: ddpexp-report {shlex.quote(str(shown))}"


def disk_full(directory: Path, made: Path | None, exc: OSError, *, setting: str) -> UserError:
    """The disk filled while the run dir was set up (Hydra's own files, ours): what this command made
    goes again, unless a run has recorded itself in it (a sweep's finished jobs stay)."""
    if made is not None and next(made.rglob(METRICS_FILE), None) is None:
        shutil.rmtree(made, ignore_errors=True)
    return UserError(
        f"cannot write to {directory}: {exc.strerror or exc}",
        setting=setting,
        fix=f"free space on that disk, or choose a {setting} on another",
    )


def claim_output(directory: Path | None, *, setting: str = "hydra.run.dir") -> fsutil.Claim | None:
    """Claim the run's (or, with setting hydra.sweep.dir, the sweep's) directory for this process before
    Hydra writes anything into it; a UserError naming the holder when another ddpexp run has it."""
    if directory is None:
        return None
    try:
        got = fsutil.claim(directory)
    except OSError as exc:  # pre-flight saw a writable parent; the disk may still be full, or a race
        full = exc.errno == errno.ENOSPC
        raise UserError(
            f"cannot make {directory}: {exc.strerror or exc}",
            setting=setting,
            fix=("free space on that disk, or " if full else "") + f"choose a {setting} you can write to",
        ) from exc
    if not isinstance(got, fsutil.Claim):
        from .preflight.outputs import refuse_claimed

        raise refuse_claimed(directory, got, setting=setting)
    return got


def best_value(run_dir: Path) -> float | None:
    """The run's best value of its best metric (what an optimising sweeper maximises or minimises)."""
    record = read_run_record_or_none(run_dir)
    if record is None:
        return None
    value = record.best.get(record.facts.get("best_metric", "eval/acc"))
    return float(value) if value is not None else None

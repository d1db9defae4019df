"""Pre-flight: compose and check every job of the run or sweep in the parent, before anything is
launched. The checks look at the world (dataset files, model construction, ports, the run dir) but
never write: bad input stops here with one line and the fix, and no process or directory exists yet.

This module composes and walks the jobs; the checks of the output directories (outputs), of a resume
(resuming) and of this machine and its network (machine) live beside it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .. import composition, faults, optim
from ..context import FAULT_ENV
from ..errors import UserError
from ..host import waits_unlike_its_workers
from ..launch import warmup
from ..plan import ExternalWorld, HostFacts, Plan
from ..validate import check_split_sizes, plan
from .machine import (
    check_cpu_processes,
    check_download,
    check_host_memory,
    check_init_file,
    check_master_addr,
    check_port,
)
from .outputs import check_output_dir, check_run_dir, check_sweep_dir
from .resuming import check_auto_resume, check_optimizer_state

HYDRA_RECORD_OFF = "hydra.output_subdir=null"


@dataclass(frozen=True)
class Checked:
    """What pre-flight hands on. `overrides`: what Hydra runs the job(s) with. `joining`: on a machine
    other than node 0 of a multi-node self-launch (dist.node_rank > 0), its job and plan: that machine
    joins the run node 0 makes (launch/nodes.follow) instead of running Hydra."""

    overrides: list[str]
    joining: tuple[DictConfig, Plan] | None = None
    # The directory the run (hydra.run.dir) or the sweep (hydra.sweep.dir) writes into, pinned in
    # `overrides` to what pre-flight resolved: the caller claims it before Hydra writes anything.
    output_dir: Path | None = None
    # Where each job's Hydra record goes (hydra.output_subdir): Hydra is told to write none, and the
    # job writes it once its directory is its own (runner.hydra_record).
    hydra_subdir: str | None = None


def preflight(
    overrides: list[str],
    *,
    multirun: bool,
    external: ExternalWorld | None = None,
    config_name: str = composition.CONFIG_NAME,
) -> Checked:
    """Check every job; return the overrides to run Hydra with (settings of swept groups applied to
    every job, sweep sub-directories named after what varies)."""
    if multirun and external is not None:
        raise UserError(
            "sweeps cannot run under torchrun",
            setting="-m",
            fix="run one job per torchrun command, or self-launch the sweep",
        )
    overrides = with_repeats(overrides, multirun=multirun)
    with composition.composer(config_name) as compose:
        overrides, jobs, varying = composition.expand(overrides, multirun=multirun, compose=compose)
        dropped = replaced_settings(jobs, compose)
        overrides, jobs = overrides + dropped, [job + dropped for job in jobs]
        local = HostFacts.probe(spinning_threads=waits_unlike_its_workers())
        spawns = []
        in_process = False
        joining = None
        first = None
        for job_overrides in jobs:
            cfg = compose(job_overrides)
            first = first if first is not None else cfg
            host = composition.remote_host(cfg) or local
            run_dir = Path(str(cfg.hydra.run.dir)) if not multirun and "hydra" in cfg else None
            p = check_job(cfg, host, external=external, multirun=multirun, run_dir=run_dir)
            if p.launcher == "spawn" and host is local:
                spawns.append(cfg.dist.start_method)
            in_process |= p.launcher == "inprocess" and host is local
            if cfg.dist.node_rank > 0:
                joining = (cfg, p)
    # The forkserver imports torch while Hydra sets up the first job; one started early and not needed
    # is stopped (launch/warmup.py), and the runner waits for what the jobs share before their clocks.
    warmup.settle(spawns[0] if spawns else None, in_process=in_process)
    if joining is not None:  # node 0 makes and claims the run dir
        return Checked(overrides, joining)
    if first is not None and "hydra" in first:
        key = "sweep" if multirun else "run"
        check_output_dir(Path(str(first.hydra[key].dir)), setting=f"hydra.{key}.dir")
    pin, output_dir = _pinned_output_dir(first, multirun=multirun) if first is not None else ([], None)
    if output_dir is not None and multirun:
        check_sweep_dir(output_dir, first.trainer.resume)  # type: ignore[union-attr]
    record, hydra_subdir = _hydra_record_by_the_job(first) if first is not None else ([], None)
    overrides = overrides + pin + record
    if not multirun or not varying:
        return Checked(overrides, output_dir=output_dir, hydra_subdir=hydra_subdir)
    # Name sweep sub-directories after what varies between the jobs only (readable TensorBoard runs).
    constant = sorted({composition.override_key(o) for o in jobs[0]} - varying)
    exclude = [f"hydra.job.config.override_dirname.exclude_keys=[{','.join(constant)}]"] if constant else []
    return Checked(overrides + exclude, output_dir=output_dir, hydra_subdir=hydra_subdir)


def with_repeats(overrides: list[str], *, multirun: bool) -> list[str]:
    """trainer.repeats=N: every job N times, as a sweep over `repeat` (0..N-1)."""
    given = [o for o in overrides if o.split("=", 1)[0] == "trainer.repeats"]
    if not given:
        return overrides
    value = given[-1].split("=", 1)[1]
    if not value.isdigit():
        raise UserError(
            f"{value!r} is not a number of runs",
            setting="trainer.repeats",
            fix="give one whole number, e.g. trainer.repeats=3 (sweep other settings, not this one)",
        )
    if int(value) > 1 and not multirun:
        raise UserError(
            f"repeats {value} runs, a sweep",
            setting="trainer.repeats",
            fix=f"add -m: python -m ddpexp -m ... trainer.repeats={value}",
        )
    return [*overrides, f"repeat=range(0,{value})"] if int(value) > 1 else overrides


def _hydra_record_by_the_job(cfg: DictConfig) -> tuple[list[str], str | None]:
    """Hydra writes its record of a job (`.hydra/`: config.yaml, hydra.yaml, overrides.yaml) before any
    code of the job runs, over what is there: in a sweep job's directory that another run has taken,
    that run's record. The override that tells Hydra to write none, and where the job writes it."""
    if "hydra" not in cfg or cfg.hydra.output_subdir is None:
        return [], None
    return [HYDRA_RECORD_OFF], str(cfg.hydra.output_subdir)


def _pinned_output_dir(cfg: DictConfig, *, multirun: bool) -> tuple[list[str], Path | None]:
    """The run's (or sweep's) directory as resolved now, and the override that makes Hydra use exactly
    it: a `${now:...}` in the pattern would otherwise resolve again, a moment later, in Hydra."""
    if "hydra" not in cfg:
        return [], None
    key = "sweep" if multirun else "run"
    section = cfg.hydra[key]
    unresolved = OmegaConf.to_container(section, resolve=False)
    assert isinstance(unresolved, dict)
    raw = str(unresolved["dir"])
    resolved = str(section.dir)
    if "${" not in raw:
        return [], Path(resolved)
    if not re.fullmatch(r"[\w./+-]+", resolved):  # not safe to pass back unquoted: let Hydra resolve it
        return [], None
    return [f"hydra.{key}.dir={resolved}"], Path(resolved)


def replaced_settings(jobs: list[list[str]], compose: Any) -> list[str]:
    """`model._target_=my_models.Net` replaces the chosen option's builder (model=convnet's): that
    option's other settings (channels, batch_norm) were meant for the builder it replaces, so they are
    dropped (`~model.channels`, one override per setting). Settings given on the command line stay,
    and so do ddpexp's own. The same for data."""
    per_job = [_replaced_in(job, compose) for job in jobs]
    if any(drops != per_job[0] for drops in per_job):
        raise UserError(
            "a _target_ override replaces a different option's settings in each job of this sweep",
            setting="model._target_/data._target_",
            fix="sweep _target_ itself, not the group, or give the settings to drop as ~model.KEY",
        )
    return per_job[0] if per_job else []


def _replaced_in(job: list[str], compose: Any) -> list[str]:
    from ..models import SETTINGS

    drops: list[str] = []
    # ddpexp's own settings in a section belong to no builder, so they stay.
    for section, own in {"model": SETTINGS, "data": ()}.items():
        key = f"{section}._target_"
        replacing = [o for o in job if composition.override_key(o) == key]
        if not replacing:
            continue
        target = replacing[-1].split("=", 1)[1].strip("'\"")
        option = compose([o for o in job if o not in replacing])[section]
        if option.get("_target_") == target:
            continue
        given = {composition.override_key(o) for o in job}
        for k in option:
            if k in (*own, "_target_") or f"{section}.{k}" in given:
                continue
            if option[k] is None:  # Hydra cannot delete a null key ("does not exist"): give it a value
                drops.append(f"{section}.{k}=0")
            drops.append(f"~{section}.{k}")
    return drops


def check_job(
    cfg: DictConfig,
    host: HostFacts,
    *,
    external: ExternalWorld | None = None,
    multirun: bool = False,
    run_dir: Path | None = None,
) -> Plan:
    """One job, as pre-flight checks it in the parent and the runner again where the job starts.
    `run_dir`: the job's directory, to check that it holds no other run (with trainer.resume=auto,
    that this job can continue the one it holds); None where it is not this call's to check (a sweep's
    job directory is known only once the job starts, and is checked there, after it is claimed)."""
    p = plan(cfg, host, external)
    if not multirun:
        check_single_job(cfg, p)
    elif cfg.dist.nnodes > 1:
        raise UserError(
            "a sweep cannot span machines", setting="dist.nnodes", fix="run one job per command on each node"
        )
    joining = cfg.dist.node_rank > 0  # node 0's ports, rendezvous file and run dir: not this machine's
    if joining:
        run_dir = None
    setting = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if cfg.get("commbench") is not None:  # the collective benchmark: no data, model or optimizer to check
        return check_benchmark(cfg, p, joining=joining, run_dir=run_dir, setting=setting)
    optim.check(cfg.optim)
    source = instantiate_data(cfg.data)
    source.check()
    download = source.to_download()
    if download is not None and not joining:  # another machine's rank 0 downloads
        check_download(download)
    info = source.info()
    check_task(cfg, info)
    if info.train_samples is not None and info.eval_samples is not None:
        check_split_sizes(info.train_samples, info.eval_samples, p, cfg)
    model = check_model(cfg.model, info, cfg)
    check_launch(cfg, p, joining=joining)
    check_host_memory(cfg, p, model, info)
    faults.check(p.world_size, os.environ.get(FAULT_ENV), schedule=_schedule(cfg, p, info))
    from ..weights import check_initial, check_resume

    explicit = check_resume(cfg.trainer.resume, model)
    if explicit is not None and cfg.trainer.mode.value == "train":
        check_optimizer_state(*explicit, cfg)
    if run_dir is not None and cfg.trainer.resume == "auto" and external is None:
        check_auto_resume(run_dir, model, cfg, p.global_batch)
    check_initial(cfg.model, model)
    if run_dir is not None and not cfg.trainer.resume:
        check_run_dir(run_dir, setting=setting)
    return p


def check_launch(cfg: DictConfig, p: Plan, *, joining: bool) -> None:
    """What self-launching the workers needs from this machine: cores, the address, a free port."""
    if p.launcher == "spawn":
        check_cpu_processes(cfg, p)
        check_master_addr(cfg)
        if not joining:
            check_port(cfg)
            check_init_file(cfg)


def check_benchmark(cfg: DictConfig, p: Plan, *, joining: bool, run_dir: Path | None, setting: str) -> Plan:
    """A collective benchmark's job (python -m ddpexp.commbench): its settings, the launch, and a run
    directory that holds no earlier benchmark (`run_dir`, named by `setting`: None, not checked)."""
    from ..commbench import JSON_FILE, settings

    settings.check(cfg.commbench, p)
    check_launch(cfg, p, joining=joining)
    if run_dir is not None and (run_dir / JSON_FILE).exists():
        raise UserError(
            f"{run_dir} already holds a benchmark's results; running another there would overwrite them",
            setting=setting,
            fix=f"choose a new {setting}",
        )
    return p


def instantiate_data(data_cfg: DictConfig) -> Any:
    """The DataSource (a Dataset of yours, wrapped: data/external.py), or one line saying why not."""
    from ..data import build_source

    try:
        return build_source(data_cfg)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(_cause(exc), setting="data", fix="check data._target_ and its arguments") from exc


def check_single_job(cfg: DictConfig, p: Plan) -> None:
    """What only makes sense in a sweep, or only with several processes, given to one plain run."""
    hydra = cfg.get("hydra")
    if hydra is not None and hydra.sweeper.get("params"):
        name = hydra.runtime.choices.get("experiment")
        raise UserError(
            f"experiment={name} is a sweep ({', '.join(hydra.sweeper.params)} vary)",
            setting="experiment",
            fix=f"add -m: python -m ddpexp -m experiment={name}",
        )
    if p.backend is None and str(cfg.backend).lower() != "auto":
        raise UserError(
            f"backend={cfg.backend} means nothing to strategy={p.strategy}: it runs one process and "
            "no process group",
            setting="backend",
            fix="drop the backend override, or use a multi-process strategy such as strategy=ddp",
        )


def _schedule(cfg: DictConfig, p: Plan, info: Any) -> faults.Schedule | None:
    if info.train_samples is None:
        return None
    from ..engine import LoopSettings

    settings = LoopSettings.from_config(cfg, p)
    steps_per_epoch = p.steps_per_epoch(info.train_samples, settings.accumulate)
    return faults.Schedule(
        steps_per_epoch=steps_per_epoch,
        epochs=settings.epochs,
        total=settings.total_steps(steps_per_epoch),
        every_steps=settings.checkpoint_every_steps,
    )


def check_task(cfg: DictConfig, info: Any) -> None:
    """The task builds (its loss too) and can learn what the dataset gives; best_metric is one it logs."""
    from .. import tasks

    try:
        task = tasks.build(cfg.task)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(_cause(exc), setting="task", fix="check task._target_ and its arguments") from exc
    task.check(info.targets)
    metric, _ = tasks.best_of(cfg)
    known = ["eval/loss", *task.metrics]
    if metric not in known:
        raise UserError(
            f"is {metric}, which task={task.name} does not log",
            setting="checkpoint.best_metric",
            fix=f"use one of {', '.join(known)}",
        )


def check_model(model_cfg: DictConfig, info: Any, cfg: DictConfig) -> Any:
    """Build the model on the meta device: catches unknown arguments, data mismatches and models the
    strategy cannot handle in milliseconds, without allocating a single weight."""
    import torch

    from .. import activation_checkpointing, float8, models, strategies
    from ..config import Precision

    target = OmegaConf.select(model_cfg, "_target_")
    builder = "name a function or class that returns a torch.nn.Module (docs/own-model.md), or a model=OPTION"
    if not target:
        raise UserError("names no builder", setting="model._target_", fix=builder)
    try:
        with torch.device("meta"):
            model = models.build(model_cfg, info)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(_cause(exc), setting="model", fix=f"check the arguments of {target}") from exc
    if not isinstance(model, torch.nn.Module):
        raise UserError(
            f"{target} built a {type(model).__name__}, not a torch.nn.Module",
            setting="model._target_",
            fix=builder,
        )
    if cfg.trainer.mode.value == "train" and not any(p.requires_grad for p in model.parameters()):
        raise UserError(
            f"{target} built a {type(model).__name__} without trainable parameters: nothing to train",
            setting="model._target_",
            fix=builder,
        )
    strategies.resolve(cfg.strategy).check_model(model)
    activation_checkpointing.check(model, cfg.trainer.activation_checkpointing)
    if Precision.of(cfg.trainer.precision) == Precision.fp8:
        float8.check(model)
    return model


def _cause(exc: BaseException) -> str:
    """The innermost message of an instantiate() error chain, on one line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return " ".join(str(exc).split()) or type(exc).__name__

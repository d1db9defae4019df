"""Pre-flight: compose and check every job of the run or sweep in the parent, before anything is
launched. The checks look at the world (dataset files, model construction, ports, the run dir) but
never write: bad input stops here with one line and the fix, and no process or directory exists yet.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from . import composition, faults, host, optim
from .context import FAULT_ENV
from .errors import UserError
from .launch import warmup
from .plan import ExternalWorld, HostFacts, Plan
from .runrecord import METRICS_FILE
from .validate import check_split_sizes, plan

# What a worker forked from the forkserver (torch already imported) holds of its own once its process
# group and loop run, before its model and data: the floor of the memory check's estimate.
WORKER_BASELINE_BYTES = 100 << 20
# A floor, not an estimate: below it even Hydra's few config files may not fit (a full disk then
# fails halfway through making the run dir).
MIN_FREE_BYTES = 1 << 20


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
        local = HostFacts.probe()
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
    overrides = overrides + pin
    if not multirun or not varying:
        return Checked(overrides, output_dir=output_dir)
    # Name sweep sub-directories after what varies between the jobs only (readable TensorBoard runs).
    constant = sorted({composition.override_key(o) for o in jobs[0]} - varying)
    exclude = [f"hydra.job.config.override_dirname.exclude_keys=[{','.join(constant)}]"] if constant else []
    return Checked(overrides + exclude, output_dir=output_dir)


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


def check_output_dir(directory: Path, *, setting: str) -> None:
    """Hydra makes the run's (or sweep's) directory and writes into it: the nearest part of its path that
    exists must be a directory this user may write into (else Hydra fails with a traceback)."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(
            f"{existing} is not a directory, so {directory} cannot be made",
            setting=setting,
            fix=f"choose a {setting} whose parents are directories",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"{existing} is not writable, so {directory} cannot be made or written there",
            setting=setting,
            fix=f"choose a {setting} you can write to (e.g. under the current directory)",
        )
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"the disk of {existing} has {free // 1024} KiB free, too little for a run's config, logs, "
            "metrics and checkpoints",
            setting=setting,
            fix=f"free space on that disk, or choose a {setting} on another",
        )


def check_sweep_dir(sweep_dir: Path, resume: str | None) -> None:
    """A sweep into a directory that already holds a sweep's runs would overwrite them job by job."""
    if resume != "auto" and next(sweep_dir.glob(f"*/{METRICS_FILE}"), None) is not None:
        raise UserError(
            f"{sweep_dir} already holds a sweep's runs; sweeping into it again would overwrite them",
            setting="hydra.sweep.dir",
            fix="choose a new hydra.sweep.dir, or add trainer.resume=auto to continue those runs",
        )


def refuse_claimed(directory: Path, holder: int, *, setting: str = "hydra.run.dir") -> UserError:
    """The one-line refusal when another ddpexp run holds `directory` (`setting` names it)."""
    who = f"pid {holder}" if holder else "another process"
    return UserError(
        f"{directory} is in use by another ddpexp run ({who}); two runs in one directory mix their results",
        setting=setting,
        fix=f"wait for that run to end, or choose another {setting}",
    )


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
    from .models import SETTINGS

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
        drops += [
            f"~{section}.{k}" for k in option if k not in (*own, "_target_") and f"{section}.{k}" not in given
        ]
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
    info = source.info()
    check_task(cfg, info)
    if info.train_samples is not None and info.eval_samples is not None:
        check_split_sizes(info.train_samples, info.eval_samples, p, cfg)
    model = check_model(cfg.model, info, cfg)
    check_launch(cfg, p, joining=joining)
    if p.launcher == "spawn":
        check_worker_memory(p, model)
    faults.check(p.world_size, os.environ.get(FAULT_ENV), schedule=_schedule(cfg, p, info))
    from .weights import check_initial, check_resume

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
    from .commbench import JSON_FILE, settings

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
    from .data import build_source

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
    from .engine import LoopSettings

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
    from . import tasks

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

    from . import models, strategies

    try:
        with torch.device("meta"):
            model = models.build(model_cfg, info)
    except UserError:
        raise
    except Exception as exc:
        target = OmegaConf.select(model_cfg, "_target_")
        raise UserError(_cause(exc), setting="model", fix=f"check the arguments of {target}") from exc
    strategies.resolve(cfg.strategy).check_model(model)
    return model


def check_auto_resume(run_dir: Path, model: Any, cfg: DictConfig, global_batch: int) -> None:
    """resume=auto, before anything in the run directory changes: the newest valid checkpoint must fit
    the configured model and the run's global batch (its position in the epoch counts steps of that
    batch), and a run that has already trained everything it was asked to is not started again. A
    refused resume leaves every byte of the run as it was."""
    from . import checkpoint
    from .errors import NothingToDo
    from .weights import fit

    found = checkpoint.resolve("auto", run_dir)
    if found is None:
        return
    path, state = found
    fit(state["model"], model, source=path, setting="trainer.resume")
    saved_batch = state.get("global_batch")  # absent from checkpoints older than this check
    if saved_batch is not None and int(saved_batch) != global_batch:
        raise UserError(
            f"{path.name} was trained at global batch {saved_batch}, this run's is {global_batch}: its "
            "place in the epoch and its learning-rate schedule count steps of the old batch",
            setting="trainer.batch_size",
            fix=f"resume with trainer.batch_size={saved_batch}, or start a new run from its weights "
            f"with model.weights={path}",
        )
    t = cfg.trainer
    if t.mode.value != "train":
        return
    finished_epochs = int(state.get("epoch", 0)) >= t.epochs
    finished_steps = t.max_steps is not None and int(state.get("step", 0)) >= t.max_steps
    if finished_epochs or finished_steps:
        raise NothingToDo(
            f"{run_dir} is already complete (step {state.get('step')}, epoch {state.get('epoch')} of "
            f"{t.epochs}); nothing to resume. Raise trainer.epochs or trainer.max_steps to train further"
        )
    check_optimizer_state(path, state, cfg)


def check_optimizer_state(path: Path, state: dict[str, Any], cfg: DictConfig) -> None:
    """Training on from a checkpoint loads its optimizer state into the configured optimizer, which
    torch accepts from any optimizer: SGD's momentum buffers and hyperparameters then reach AdamW,
    whose first step fails for want of its step count and moments, after the run was reopened. The
    same optimizer continues with the saved hyperparameters and schedule (they are part of its state),
    so a changed one would be ignored without a word: refused too."""
    if "optimizer" not in state:  # bare weights: training starts a fresh optimizer
        return
    saved = (state.get("config") or {}).get("optim") or {}
    wanted = OmegaConf.to_container(cfg.optim, resolve=True, enum_to_str=True)
    assert isinstance(wanted, dict)
    if saved.get("name") not in (None, wanted["name"]):
        raise UserError(
            f"{path.name} holds the optimizer state of {saved['name']}, which optim={wanted['name']} "
            "cannot continue from",
            setting="optim",
            fix=f"resume with optim={saved['name']}, or start a new run from its weights with "
            f"model.weights={path}",
        )
    changed = [k for k in wanted if k not in UNSAVED_OPTIM and k in saved and saved[k] != wanted[k]]
    if changed:
        was = " ".join(f"optim.{k}={saved[k]}" for k in changed)
        now = ", ".join(f"optim.{k}={wanted[k]}" for k in changed)
        raise UserError(
            f"{path.name} continues with {was}, its optimizer's saved settings, not {now}",
            setting="optim",
            fix=f"resume with {was}, or start a new run from its weights with model.weights={path}",
        )


# Optimizer settings a resume may change: how the update is computed, not what it is.
UNSAVED_OPTIM = frozenset({"name", "fused"})


def check_cpu_processes(cfg: DictConfig, p: Plan) -> None:
    cores = os.cpu_count() or 1
    if p.device_type == "cpu" and p.nprocs_per_node > 4 * cores and not cfg.dist.oversubscribe:
        raise UserError(
            f"{p.nprocs_per_node} worker processes on a host with {cores} cores",
            setting="dist.nprocs",
            fix=f"use dist.nprocs<={4 * cores} (or dist.oversubscribe=true if you mean it)",
        )


def check_worker_memory(p: Plan, model: Any) -> None:
    """The workers this machine starts must fit in its available memory: each takes at least a forked
    worker's own baseline plus the model's bytes (a floor: gradients, optimizer state, data and
    activations come on top, so a refusal is certain, not a guess)."""
    model_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in _tensors(model)}.values())
    each = WORKER_BASELINE_BYTES + model_bytes
    available = host.available_memory()
    if p.nprocs_per_node * each <= available:
        return
    fits = available // each
    mib = 1 << 20
    raise UserError(
        f"{p.nprocs_per_node} worker processes need at least {p.nprocs_per_node * each // mib} MiB of "
        f"memory ({each // mib} MiB each: {WORKER_BASELINE_BYTES // mib} for the process, "
        f"{model_bytes / mib:.1f} for the model), and {available // mib} MiB is available",
        setting="dist.nprocs",
        fix=f"use dist.nprocs<={fits}" if fits else "free memory on this machine, or use a smaller model",
    )


def _tensors(model: Any) -> list[Any]:
    return [*model.parameters(), *model.buffers()]


def check_master_addr(cfg: DictConfig) -> None:
    import socket

    addr = cfg.dist.master_addr
    if cfg.init.value not in ("env", "tcp") and cfg.dist.nnodes == 1:  # several nodes meet node 0 there
        return
    try:
        socket.getaddrinfo(addr, None)
    except OSError as exc:
        raise UserError(
            f"{addr!r} does not resolve ({exc.strerror or exc})",
            setting="dist.master_addr",
            fix="use an address or host name every node can reach (127.0.0.1 on one machine)",
        ) from exc


def check_port(cfg: DictConfig) -> None:
    from .launch.rendezvous import port_is_free

    port = cfg.dist.master_port
    if port is None:
        return
    ports = [port] if cfg.init.value in ("env", "tcp") else []
    if cfg.dist.nnodes > 1:
        ports.append(port + 1)  # node 0's launcher hands the job to the other nodes there
    busy = next((p for p in ports if not port_is_free(cfg.dist.master_addr, p)), None)
    if busy is not None:
        raise UserError(
            f"port {busy} on {cfg.dist.master_addr} is already in use",
            setting="dist.master_port",
            fix="pick another port, one whose next port is free too, on every node's command"
            if cfg.dist.nnodes > 1
            else "pick another port, or leave dist.master_port unset to get a free one",
        )


def check_init_file(cfg: DictConfig) -> None:
    path = cfg.dist.init_file
    if cfg.init.value != "file" or path is None:
        return
    if Path(path).exists():
        raise UserError(
            f"rendezvous file {path} already exists (a stale file would join the wrong run)",
            setting="dist.init_file",
            fix="delete it if no run uses it, or leave dist.init_file unset for a fresh one in the run dir",
        )
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UserError(
            f"the directory of {path} does not exist",
            setting="dist.init_file",
            fix="create it on a filesystem every rank can see, or leave dist.init_file unset",
        )
    try:  # os.access says yes to root even where the filesystem refuses (/sys): ask the filesystem
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".ddpexp-probe-"):
            pass
    except OSError as exc:
        raise UserError(
            f"cannot create {path}: {exc.strerror or exc} in {parent}",
            setting="dist.init_file",
            fix="put it in a directory you can write to, on a filesystem every rank can see, "
            "or leave dist.init_file unset",
        ) from exc


def check_run_dir(run_dir: Path, *, setting: str = "hydra.run.dir") -> None:
    if (run_dir / METRICS_FILE).exists():
        raise UserError(
            f"{run_dir} already holds a run; starting another there would mix their results",
            setting=setting,
            fix=f"choose a new {setting}, or add trainer.resume=auto to continue that run",
        )


def _cause(exc: BaseException) -> str:
    """The innermost message of an instantiate() error chain, on one line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return " ".join(str(exc).split()) or type(exc).__name__

"""Command line: `python -m ddpexp [overrides]` / `ddpexp [overrides]`.

    argv ──► pre-flight: compose + validate every job of the run or sweep (nothing started yet)
         ──► hydra.main: makes the run dir(s), calls `task` once per job
         ──► task: write config.yaml/plan.json, launch (in-process, spawned workers, or torchrun rank)

Bad input stops at pre-flight with one line and exit code 2: no process spawned, no directory made.
Under torchrun, only rank 0 composes; it hands the resolved job to the other ranks through the
rendezvous store, so there is one composition and one run directory however many ranks there are.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config import register_schema
from .errors import UserError

log = logging.getLogger("ddpexp")

CONFIG_NAME = "config"
JOB_KEY = "ddpexp/job"
STORE_TIMEOUT_S = 900.0


def conf_dir() -> str:
    return str(importlib.resources.files("ddpexp.conf"))


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DDPEXP_T0", str(time.time()))
    argv = list(sys.argv[1:] if argv is None else argv)
    register_schema()
    OmegaConf.register_new_resolver("ddpexp_subdir", _sweep_subdir, replace=True)
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help:
        from .help import help_text

        print(help_text(conf_dir()))
        return
    if _torchrun_rank() not in (None, 0) or _torchrun_rejoins():
        sys.exit(_torchrun_follower())
    try:
        if _is_plain_run(args):
            argv = argv + _preflight(args)
    except UserError as exc:
        if _torchrun_rank() == 0:
            _publish({"error": str(exc)})
        print(f"ddpexp: error: {exc}", file=sys.stderr)
        sys.exit(UserError.exit_code)
    sys.exit(_run_hydra(argv))


def _is_plain_run(args: Any) -> bool:
    """Pre-flight applies to runs and sweeps, not to --cfg/--info/--shell-completion and friends."""
    return not (args.cfg or args.info or args.shell_completion or args.hydra_help or args.experimental_rerun)


# ---------------------------------------------------------------------------------------- pre-flight


def _preflight(args: Any) -> list[str]:
    """Compose and check every job before anything starts; return extra Hydra overrides for the run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from .preflight import check_job
    from .validate import HostFacts

    overrides = list(args.overrides)
    if args.config_dir:
        overrides.append(f"hydra.searchpath=[file://{Path(args.config_dir).resolve()}]")
    if args.multirun and _torchrun_rank() is not None:
        raise UserError(
            "sweeps cannot run under torchrun",
            setting="-m",
            fix="run one job per torchrun command, or self-launch the sweep",
        )
    GlobalHydra.instance().clear()
    with initialize_config_dir(
        config_dir=_abs(args.config_path) or conf_dir(), version_base="1.3", job_name="ddpexp"
    ):
        name = args.config_name or CONFIG_NAME
        jobs, varying = _expand(
            overrides, multirun=args.multirun, compose=lambda o: _compose(compose, name, o)
        )
        local = HostFacts.probe()
        external = _external_world()
        for job_overrides in jobs:
            cfg = _compose(compose, name, job_overrides)
            host = _remote_host(cfg) or local
            check_job(cfg, host, external=external, multirun=args.multirun)
    GlobalHydra.instance().clear()
    if not args.multirun or not varying:
        return []
    # Name sweep sub-directories after what varies between the jobs only (readable TensorBoard runs).
    constant = sorted({_key(o) for o in jobs[0]} - varying)
    return [f"hydra.job.config.override_dirname.exclude_keys=[{','.join(constant)}]"] if constant else []


def _remote_host(cfg: DictConfig) -> Any:
    """Jobs that a launcher plugin runs elsewhere (Slurm) are checked against that machine's declared
    GPUs, not this one's: a login node without GPUs must not veto a GPU job. Their own host re-checks
    everything before starting. One Slurm node and one task per job: ddpexp spawns the workers there."""
    from .validate import HostFacts

    launcher = cfg.hydra.launcher
    if "BasicLauncher" in str(launcher.get("_target_", "BasicLauncher")):
        return None
    for key in ("nodes", "tasks_per_node"):
        if launcher.get(key, 1) != 1:
            raise UserError(
                f"is {launcher.get(key)}; ddpexp runs one launcher task per node and starts one worker "
                "per GPU itself",
                setting=f"hydra.launcher.{key}",
                fix=f"set hydra.launcher.{key}=1; for several nodes run torchrun inside sbatch (README)",
            )
    return HostFacts(cuda_devices=launcher.get("gpus_per_node") or 0, nccl=True, gloo=True, mpi=True)


def _compose(compose: Callable[..., DictConfig], name: str, overrides: list[str]) -> DictConfig:
    try:
        return compose(config_name=name, overrides=overrides, return_hydra_config=True)
    except Exception as exc:  # Hydra/OmegaConf composition errors: one line naming the key
        raise UserError(_one_line(exc)) from exc


def _expand(
    overrides: list[str], *, multirun: bool, compose: Callable[[list[str]], DictConfig]
) -> tuple[list[list[str]], set[str]]:
    """The override list of every job, the way Hydra's basic sweeper will expand them, and the keys
    that take more than one value."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except Exception as exc:
        raise UserError(_one_line(exc)) from exc
    if not multirun:
        sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
        if sweeps:
            raise UserError(f"{sweeps[0]} lists several values", fix="add -m to run a sweep")
        return [overrides], set()
    # Hydra composes the sweep's base config from the non-swept overrides alone, before any job; the
    # sweep parameters set there (hydra.sweeper.params, e.g. by an experiment preset) join the command
    # line's.
    fixed = [o.input_line or "" for o in parsed if not o.is_sweep_override()]
    try:
        base = compose(fixed)
    except UserError as exc:
        raise UserError(
            f"{exc.message} (Hydra applies it before choosing the swept options)",
            fix="for a key inside a swept config group, write ++key=value (e.g. ++data.root=...)",
        ) from exc
    params = base.hydra.sweeper.get("params") or {}
    combined = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides)
    varying = {o.get_key_element() for o in combined if o.is_sweep_override()}
    return BasicSweeper.split_arguments(combined, None)[0], varying


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _sweep_subdir(override_dirname: str, num: int) -> str:
    name = override_dirname.replace("/", "_")
    return name or f"job{num}"


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    options = [ln for ln in lines if ln.startswith("Available options")]
    if "Could not find" in head and options:
        idx = lines.index(options[0])
        names = [ln for ln in lines[idx + 1 :] if " " not in ln and ":" not in ln]
        return f"{head.split(': ', 1)[-1]}; options: {', '.join(names)} (python -m ddpexp --help lists them)"
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    return f"{full_key}: {head}" if full_key and full_key not in head else head


def _abs(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


# ---------------------------------------------------------------------------------------- hydra job


def _run_hydra(argv: list[str]) -> int:
    import hydra

    codes: list[int] = []

    def task(cfg: DictConfig) -> int:
        code = _task(cfg)
        codes.append(code)
        if code in (130, 143):  # Ctrl-C / SIGTERM stops the whole sweep, not just this job
            raise SystemExit(code)
        return code

    sys.argv = [sys.argv[0], *argv]
    hydra.main(config_path=conf_dir(), config_name=CONFIG_NAME, version_base="1.3")(task)()
    return next((c for c in codes if c != 0), 0)


def _task(cfg: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig

    from . import launch
    from .job import Job
    from .preflight import check_job
    from .validate import HostFacts

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    choices = {
        k: str(v) for k, v in hc.runtime.choices.items() if not k.startswith("hydra") and v is not None
    }
    external = _external_world()
    try:
        plan = check_job(cfg, HostFacts.probe(), external=external, multirun=False, run_dir_checked=True)
    except UserError as exc:
        print(f"ddpexp: error: {exc}", file=sys.stderr)
        return UserError.exit_code
    job = Job(cfg=cfg, plan=plan, run_dir=run_dir, choices=choices)
    job.save()
    if plan.launcher == "torchrun":
        code = _torchrun_leader(job)
    else:
        try:
            code = launch.run(job)
        except UserError as exc:
            print(f"ddpexp: error: {exc}", file=sys.stderr)
            code = UserError.exit_code
    print(f"run dir: {run_dir}" + ("" if code == 0 else f"  (exit code {code})"))
    return code


# ---------------------------------------------------------------------------------------- torchrun


def _torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another torch launcher) started it, else None."""
    env = os.environ
    if "DDPEXP_RUN_DIR" in env:  # our own spawned workers never come through here, but be explicit
        return None
    if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return int(env["RANK"])
    return None


def _torchrun_rejoins() -> bool:
    """Rank 0 restarted by torchrun (--max-restarts) after its job was published: it takes the job from
    the store like the other ranks, so the restart continues the same run directory."""
    if _torchrun_rank() != 0 or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    return bool(_store().check([JOB_KEY]))


def _pg_store(store: Any) -> Any:
    """The process group's keys, fresh for every torchrun restart (torchrun keeps its store across them)."""
    import torch.distributed as dist

    return dist.PrefixStore(f"pg/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _external_world() -> Any:
    from .validate import ExternalWorld

    if _torchrun_rank() is None:
        return None
    env = os.environ
    return ExternalWorld(
        world_size=int(env["WORLD_SIZE"]),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
    )


@functools.cache
def _store() -> Any:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(
        dist.rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    )
    return store


def _publish(payload: dict[str, Any]) -> None:
    _store().set(JOB_KEY, json.dumps(payload))


def _torchrun_leader(job: Any) -> int:
    """Rank 0 under torchrun: hand the job to the other ranks, then train as rank 0."""
    from .context import RunContext
    from .worker import configure_process, execute, run_guarded

    store = _store()
    store.set(JOB_KEY, json.dumps(job.to_dict()))
    ctx = RunContext.for_process(job.plan, job.run_dir)
    configure_process(ctx, console=True)
    return run_guarded(lambda: execute(job, ctx, store=_pg_store(store)), ctx)


def _torchrun_follower() -> int:
    """Ranks other than 0 under torchrun: wait for rank 0's resolved job (never call Hydra)."""
    from .context import RunContext
    from .job import Job
    from .worker import configure_process, execute, raise_on_sigterm, run_guarded

    raise_on_sigterm()
    store = _store()
    store.wait([JOB_KEY], timedelta(seconds=STORE_TIMEOUT_S))
    payload = json.loads(store.get(JOB_KEY))
    if "error" in payload:
        return UserError.exit_code  # rank 0 printed the reason
    job = Job.from_dict(payload)
    ctx = RunContext.for_process(job.plan, job.run_dir)
    configure_process(ctx, console=ctx.is_main)
    return run_guarded(lambda: execute(job, ctx, store=_pg_store(store)), ctx)

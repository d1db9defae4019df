"""Pre-flight: compose and check every job of the run or sweep in the parent, before anything is
launched. The checks look at the world (dataset files, model construction, ports, the run dir) but
never write: bad input stops here with one line and the fix, and no process or directory exists yet.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from . import composition, faults, optim
from .context import FAULT_ENV
from .errors import UserError
from .validate import ExternalWorld, HostFacts, Plan, plan


def preflight(
    overrides: list[str],
    *,
    multirun: bool,
    external: ExternalWorld | None = None,
    config_name: str = composition.CONFIG_NAME,
) -> list[str]:
    """Check every job; return the overrides to run Hydra with (settings of swept groups applied to
    every job, sweep sub-directories named after what varies)."""
    if multirun and external is not None:
        raise UserError(
            "sweeps cannot run under torchrun",
            setting="-m",
            fix="run one job per torchrun command, or self-launch the sweep",
        )
    with composition.composer(config_name) as compose:
        overrides, jobs, varying = composition.expand(overrides, multirun=multirun, compose=compose)
        local = HostFacts.probe()
        spawns = []
        for job_overrides in jobs:
            cfg = compose(job_overrides)
            host = composition.remote_host(cfg) or local
            if (
                check_job(cfg, host, external=external, multirun=multirun).launcher == "spawn"
                and host is local
            ):
                spawns.append(cfg.dist.start_method)
    if spawns:  # the forkserver imports torch while Hydra sets up the first job
        from .launch.spawn import prewarm

        prewarm(spawns[0])
    if not multirun or not varying:
        return overrides
    # Name sweep sub-directories after what varies between the jobs only (readable TensorBoard runs).
    constant = sorted({composition.override_key(o) for o in jobs[0]} - varying)
    exclude = [f"hydra.job.config.override_dirname.exclude_keys=[{','.join(constant)}]"] if constant else []
    return overrides + exclude


def check_job(
    cfg: DictConfig,
    host: HostFacts,
    *,
    external: ExternalWorld | None = None,
    multirun: bool = False,
    run_dir_checked: bool = False,
) -> Plan:
    p = plan(cfg, host, external)
    optim.check(cfg.optim)
    source = instantiate_data(cfg.data)
    source.check()
    model = check_model(cfg.model, source.info(), cfg)
    if p.launcher == "spawn":
        check_port(cfg)
        check_init_file(cfg)
    faults.check(p.world_size, os.environ.get(FAULT_ENV))
    from .checkpoint import check_resume

    check_resume(cfg.trainer.resume, model)
    if not multirun and not run_dir_checked and "hydra" in cfg and not cfg.trainer.resume:
        check_run_dir(Path(cfg.hydra.run.dir))
    return p


def instantiate_data(data_cfg: DictConfig) -> Any:
    from hydra.utils import instantiate

    try:
        return instantiate(data_cfg)
    except Exception as exc:
        raise UserError(_cause(exc), setting="data", fix="check data._target_ and its arguments") from exc


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
    strategy, settings = strategies.resolve(cfg.strategy)
    strategy.check_model(model, settings)
    return model


def check_port(cfg: DictConfig) -> None:
    from .launch.rendezvous import port_is_free

    port = cfg.dist.master_port
    if port is not None and cfg.init.value in ("env", "tcp") and not port_is_free(cfg.dist.master_addr, port):
        raise UserError(
            f"port {port} on {cfg.dist.master_addr} is already in use",
            setting="dist.master_port",
            fix="pick another port, or leave dist.master_port unset to get a free one",
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
    if not Path(path).resolve().parent.is_dir():
        raise UserError(
            f"the directory of {path} does not exist",
            setting="dist.init_file",
            fix="create it on a filesystem every rank can see, or leave dist.init_file unset",
        )


def check_run_dir(run_dir: Path) -> None:
    if (run_dir / "metrics.json").exists():
        raise UserError(
            f"{run_dir} already holds a run; starting another there would mix their results",
            setting="hydra.run.dir",
            fix="choose a new hydra.run.dir, or add trainer.resume=auto to continue that run",
        )


def _cause(exc: BaseException) -> str:
    """The innermost message of an instantiate() error chain, on one line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return " ".join(str(exc).split()) or type(exc).__name__

"""Checks that need to look at the world (dataset files, model construction, ports, the run dir),
run in the parent before anything is launched. They read but never write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from . import faults, optim
from .errors import UserError
from .validate import ExternalWorld, HostFacts, Plan, plan


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
    faults.check(p.world_size)
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
    check_strategy_model = getattr(strategies.get(cfg.strategy.name), "check_model", None)
    if check_strategy_model is not None:
        check_strategy_model(model, cfg)
    return model


def check_port(cfg: DictConfig) -> None:
    from .launch import port_is_free

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

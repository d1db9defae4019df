"""What a run records about itself in metrics.json's `facts`: what ran, where, with which batch
arithmetic. The report groups and labels runs by these."""

from __future__ import annotations

import platform
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from . import host, strategies, tasks
from .context import RunContext
from .data import Splits
from .job import Job


def run_facts(
    job: Job,
    ctx: RunContext,
    splits: Splits,
    model: torch.nn.Module,
    strategy: strategies.Strategy[Any],
    *,
    loader: str,
    lr: float,
    resumed: Path | None,
    flops_per_token: float | None = None,
    peak: tuple[float | None, str] = (None, ""),
) -> dict[str, Any]:
    p, cfg = job.plan, job.cfg
    best = tasks.best_of(cfg)
    return {
        "strategy": p.strategy,
        "backend": p.backend,
        "init_method": p.init,
        "launcher": p.launcher,
        "start_method": cfg.dist.start_method.value if p.launcher == "spawn" else None,
        "world_size": p.world_size,
        "nprocs_per_node": p.nprocs_per_node,
        "nnodes": max(p.world_size // p.nprocs_per_node, 1),
        "devices_per_process": p.devices_per_process,
        "replicas": p.replicas,
        "devices": p.devices,
        "sync_bn": bool(cfg.strategy.get("sync_bn", False)),
        "strategy_settings": strategy.changed_settings(),  # what the report labels variants by
        "strategy_columns": [c.to_dict() for c in strategy.report_columns],
        "global_batch_size": p.global_batch,
        "per_rank_batch_size": p.per_rank_batch * cfg.trainer.accumulate,
        "micro_batch_size": p.per_rank_batch,
        "device_type": p.device_type,
        "model": _named(job.choices.get("model"), cfg.model.get("_target_")),
        "data": _named(job.choices.get("data"), cfg.data.get("_target_")),
        "optim": cfg.optim.name.value,
        "lr": cfg.optim.lr,
        "lr_used": lr,
        "lr_scale_rule": cfg.optim.scale_rule.value,
        "lr_schedule": cfg.optim.schedule.value,
        "precision": cfg.trainer.precision.name,
        "activation_checkpointing": cfg.trainer.activation_checkpointing.value,
        "accumulate": cfg.trainer.accumulate,
        "mode": cfg.trainer.mode.value,
        "task": job.choices.get("task", cfg.task.get("_target_")),
        "best_metric": best[0],
        "best_mode": best[1].value,
        "resumed_from": str(resumed) if resumed else None,
        "loader": loader,
        "seed": cfg.seed,
        "repeat": cfg.repeat,  # of trainer.repeats
        "repeats": cfg.trainer.repeats,
        "parameters": sum(t.numel() for t in model.parameters()),
        "data_fingerprint": splits.fingerprint,
        "data_facts": splits.facts,  # a corpus's files, bytes, and the Python it came with
        "vocab_size": splits.info.vocab_size,
        "tokens_per_sample": splits.info.tokens_per_sample,
        # MFU's numbers (ddpexp/flops.py): training FLOPs per token, one device's peak and its source
        "flops_per_token": flops_per_token,
        "peak_flops": peak[0],
        "peak_flops_source": peak[1] or None,
        "train_samples": len(splits.train.dataset),  # type: ignore[arg-type]
        "eval_samples": len(splits.eval.dataset),  # type: ignore[arg-type]
        "job_started_at": ctx.job_started_at,  # its clock: time to first step and to target count from it
        "command_started_at": job.command_started_at,  # the command's start, before imports and pre-flight
        "threads": torch.get_num_threads(),  # intra-op threads per process (trainer.threads)
        "wait_policy": host.wait_policy(),  # OpenMP threads that spin starve their siblings on a busy host
        # autogroup gives each session one share of a busy CPU: a run whose ranks each have their own
        # gets several, and a comparison with one whose processes share one is not even
        "sessions": p.nprocs_per_node if host.own_session() else 1,
        "autogroup": host.autogroup(),
        "host_cpus": host.cpus(),
        "load_avg_start": job.load_at_start,  # 1-minute load average as the job started
        "gpu_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None,
        "sweep_varies": {key: _swept_value(job, key) for key in job.varies},  # the HParams view ticks these
        "torch": torch.__version__,
        "host": platform.node(),
        "machine": host.machine_id(),  # shared by containers on one machine (the report's same-host checks)
    }


def _swept_value(job: Job, key: str) -> Any:
    """What a swept override key was in this job: a config group's option (strategy=ddp) or a value."""
    if key in job.choices:
        return job.choices[key]
    value = OmegaConf.select(job.cfg, key)
    return (
        value.value
        if isinstance(value, Enum)
        else value
        if isinstance(value, (str, int, float, bool))
        else str(value)
    )


def _named(choice: str | None, target: str | None) -> str | None:
    """A shipped option by its name (convnet); your own build function by its _target_, even where it
    replaced the default option's (model._target_=my_models.Net on top of model=convnet)."""
    if target and not target.startswith("ddpexp."):
        return target
    return choice or target

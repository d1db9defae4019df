"""The composition root: everything one worker builds, in order, before the engine takes over."""

from __future__ import annotations

import logging
import platform
import random
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate

from . import distributed, models, optim, strategies
from .context import RunContext
from .data import DataSource, Splits, loaders
from .engine import Engine, LoopSettings
from .job import Job
from .recorder import NullRecorder, open_recorder

log = logging.getLogger(__name__)


def run(job: Job, ctx: RunContext) -> dict[str, float]:
    cfg = job.cfg
    seed_everything(cfg.seed)  # the same seed on every rank: identical initial weights everywhere
    splits = load_data(instantiate(cfg.data), ctx)
    model = models.build(cfg.model, splits.info)
    wrapped = strategies.get(cfg.strategy.name).wrap(model, ctx=ctx, cfg=cfg)
    seed_everything(cfg.seed + ctx.rank)  # from here on each rank draws its own random stream
    mode = loaders.choose_mode(cfg.loader.mode.value, splits.train, ctx.device)
    train_loader = make_loader(job, ctx, splits, mode, train=True)
    eval_loader = make_loader(job, ctx, splits, mode, train=False)
    optimizer = optim.build(wrapped.base.parameters(), cfg.optim)
    recorder = open_recorder(
        is_main=ctx.is_main,
        run_dir=ctx.run_dir,
        facts=run_facts(job, ctx, splits, model, loader=mode),
        progress=cfg.trainer.progress,
    )
    engine = Engine(
        model=wrapped,
        optimizer=optimizer,
        train_loader=train_loader,
        eval_loader=eval_loader,
        recorder=recorder,
        settings=LoopSettings(
            epochs=cfg.trainer.epochs,
            max_steps=cfg.trainer.max_steps,
            log_every_steps=cfg.trainer.log_every_steps,
            eval_every_epochs=cfg.trainer.eval_every_epochs,
            global_batch=job.plan.global_batch,
        ),
        device=ctx.device,
    )
    return fit_and_record(engine, recorder)


def fit_and_record(engine: Engine, recorder: NullRecorder) -> dict[str, float]:
    """Run the engine; whatever happens, metrics.json ends with the run's true status."""
    try:
        result = engine.fit()
    except KeyboardInterrupt:
        recorder.close("interrupted")
        raise
    except BaseException as exc:
        recorder.close("interrupted" if getattr(exc, "interrupted", False) else "failed", error=repr(exc))
        raise
    recorder.save_model(engine.model.base.state_dict())
    recorder.close("completed")
    return result


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_data(source: DataSource, ctx: RunContext) -> Splits:
    """Rank 0 prepares (downloads, vocabularies) while the others wait, then every rank loads."""
    if ctx.is_main:
        source.prepare(ctx.run_dir)
    distributed.barrier()
    splits = source.load(ctx.run_dir)
    summary = (splits.fingerprint, len(splits.train.dataset), len(splits.eval.dataset))  # type: ignore[arg-type]
    seen = distributed.gather_objects(summary)
    if any(s != summary for s in seen):
        raise RuntimeError(f"ranks loaded different data (fingerprint, train size, eval size): {seen}")
    return splits


def make_loader(job: Job, ctx: RunContext, splits: Splits, mode: str, *, train: bool) -> loaders.Loader:
    cfg = job.cfg
    pin = cfg.loader.pin_memory if cfg.loader.pin_memory is not None else ctx.device.type == "cuda"
    return loaders.build(
        splits.train if train else splits.eval,
        mode=mode,
        batch_size=job.plan.per_rank_batch if train else job.plan.eval_per_rank_batch,
        rank=ctx.rank,
        world=ctx.world_size,
        seed=cfg.seed,
        device=ctx.device,
        train=train,
        num_workers=cfg.loader.num_workers,
        pin_memory=pin,
    )


def run_facts(
    job: Job, ctx: RunContext, splits: Splits, model: torch.nn.Module, *, loader: str
) -> dict[str, Any]:
    """The run's facts as recorded in metrics.json: what ran, where, with which batch arithmetic."""
    p = job.plan
    return {
        "strategy": p.strategy,
        "backend": p.backend,
        "init_method": p.init,
        "launcher": p.launcher,
        "world_size": p.world_size,
        "nprocs_per_node": p.nprocs_per_node,
        "nnodes": max(p.world_size // p.nprocs_per_node, 1),
        "devices_per_process": p.devices_per_process,
        "replicas": p.replicas,
        "sync_bn": bool(job.cfg.strategy.sync_bn),
        "global_batch_size": p.global_batch,
        "per_rank_batch_size": p.per_rank_batch,
        "device_type": p.device_type,
        "model": job.choices.get("model", job.cfg.model.get("_target_")),
        "data": job.choices.get("data", job.cfg.data.get("_target_")),
        "optim": job.cfg.optim.name,
        "loader": loader,
        "seed": job.cfg.seed,
        "parameters": sum(t.numel() for t in model.parameters()),
        "data_fingerprint": splits.fingerprint,
        "vocab_size": splits.info.vocab_size,
        "train_samples": len(splits.train.dataset),  # type: ignore[arg-type]
        "eval_samples": len(splits.eval.dataset),  # type: ignore[arg-type]
        "torch": torch.__version__,
        "host": platform.node(),
    }

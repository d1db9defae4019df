"""The composition root: everything one worker builds, in order, before the engine takes over."""

from __future__ import annotations

import logging
import os
import platform
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate

from . import checkpoint, distributed, faults, models, optim, strategies
from .context import RunContext
from .data import DataSource, Splits, loaders
from .engine import Engine, LoopSettings, Position
from .job import Job
from .recorder import NullRecorder, Recorder, open_recorder

log = logging.getLogger(__name__)


def run(job: Job, ctx: RunContext) -> dict[str, float]:
    cfg, t = job.cfg, job.cfg.trainer
    configure_determinism(t.deterministic)
    seed_everything(cfg.seed)  # the same seed on every rank: identical initial weights everywhere
    splits = load_data(instantiate(cfg.data), ctx)
    model = models.build(cfg.model, splits.info)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    wrapped = strategies.get(cfg.strategy.name).wrap(model, ctx=ctx, cfg=cfg)
    if t.compile:
        wrapped.module = torch.compile(wrapped.module)
    seed_everything(cfg.seed + ctx.rank)  # from here on each rank draws its own random stream
    mode = loaders.choose_mode(cfg.loader.mode.value, splits.train, ctx.device)
    train_loader = make_loader(job, ctx, splits, mode, train=True)
    eval_loader = make_loader(job, ctx, splits, mode, train=False)
    lr = optim.scaled_lr(cfg.optim, job.plan.global_batch)
    optimizer = optim.build(wrapped.base.parameters(), cfg.optim, lr=lr)
    steps_per_epoch = len(train_loader) // t.accumulate
    total_steps = min(steps_per_epoch * t.epochs, t.max_steps if t.max_steps is not None else 1 << 62)
    scheduler = optim.build_schedule(optimizer, cfg.optim, total_steps)
    scaler = torch.amp.GradScaler("cuda") if str(t.precision) == "fp16" else None
    resumed = find_checkpoint(t.resume, ctx)
    # After a restart without a checkpoint the run starts over: what the failed attempt logged is dropped.
    resume_step = 0 if ctx.attempt > 0 and t.mode == "train" else None
    if resumed and t.mode == "train":
        resume_step = resumed[1].get("step", 0)
    facts = run_facts(job, ctx, splits, model, loader=mode, lr=lr, resumed=resumed)
    recorder = open_recorder(
        is_main=ctx.is_main,
        run_dir=ctx.run_dir,
        facts=facts,
        progress=t.progress,
        keep_last_k=cfg.checkpoint.keep_last_k,
        resume_step=resume_step,
    )
    engine = Engine(
        model=wrapped,
        optimizer=optimizer,
        train_loader=train_loader,
        eval_loader=eval_loader,
        recorder=recorder,
        settings=LoopSettings(
            epochs=t.epochs,
            max_steps=t.max_steps,
            log_every_steps=t.log_every_steps,
            eval_every_epochs=t.eval_every_epochs,
            global_batch=job.plan.global_batch,
            eval_every_steps=t.eval_every_steps,
            accumulate=t.accumulate,
            precision=str(t.precision),
            clip_grad_norm=t.clip_grad_norm,
            channels_last=t.channels_last,
            checkpoint_every_epochs=cfg.checkpoint.every_epochs,
            checkpoint_every_steps=cfg.checkpoint.every_steps,
            devices=job.plan.devices,
        ),
        device=ctx.device,
        scheduler=scheduler,
        scaler=scaler,
    )
    keeper = CheckpointKeeper(job, ctx, engine, recorder)
    engine.on_checkpoint = keeper
    fault = faults.for_process(ctx.rank, ctx.attempt)
    if fault is not None:
        engine.on_step = fault.after_step
        if isinstance(recorder, Recorder):
            recorder.checkpointer.while_saving = fault.while_saving
    if resumed is not None:
        restore(engine, keeper, resumed, ctx, train=t.mode == "train")
    if t.mode == "eval":
        return evaluate_only(engine, recorder)
    return fit_and_record(engine, recorder)


def configure_determinism(enabled: bool) -> None:
    if not enabled:
        torch.backends.cudnn.benchmark = True  # fastest conv algorithms for fixed input shapes
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def find_checkpoint(resume: str | None, ctx: RunContext) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0 decides which checkpoint (for `auto`, the newest valid one); every rank loads that file.
    After an automatic restart, the run's own newest checkpoint comes first."""
    candidates = (["auto"] if ctx.attempt > 0 and resume != "auto" else []) + ([resume] if resume else [])
    if not candidates:
        return None
    chosen = None
    if ctx.is_main:
        chosen = next(filter(None, (checkpoint.resolve(r, ctx.run_dir) for r in candidates)), None)
    path = distributed.gather_objects(str(chosen[0]) if chosen else None)[0]
    if path is None:
        log.info("no checkpoint in %s yet, starting from scratch", ctx.run_dir)
        return None
    if chosen is not None:
        return chosen
    return Path(str(path)), checkpoint.load(Path(str(path)))


def restore(
    engine: Engine,
    keeper: CheckpointKeeper,
    resumed: tuple[Path, dict[str, Any]],
    ctx: RunContext,
    *,
    train: bool,
) -> None:
    path, state = resumed
    checkpoint.check_matches(state["model"], engine.model.base, path)
    engine.model.base.load_state_dict(state["model"])
    if not train or "optimizer" not in state:
        log.info("loaded weights from %s", path)
        return
    engine.optimizer.load_state_dict(state["optimizer"])
    if engine.scheduler is not None:
        engine.scheduler.load_state_dict(state["scheduler"])
    if engine.scaler is not None and state.get("scaler"):
        engine.scaler.load_state_dict(state["scaler"])
    engine.pos = Position(epoch=state["epoch"], step=state["step"], step_in_epoch=state["step_in_epoch"])
    keeper.best = state["metrics"].get("best")
    same_layout = state["world_size"] == ctx.world_size and state["accumulate"] == engine.s.accumulate
    if same_layout:
        checkpoint.set_rng_state(state["rng"][ctx.rank])
    else:
        log.warning(
            "resuming a run saved with world size %d x accumulate %d as %d x %d: training continues from "
            "step %d with the same global batch, but the sample order and random streams differ from an "
            "uninterrupted run",
            state["world_size"],
            state["accumulate"],
            ctx.world_size,
            engine.s.accumulate,
            state["step"],
        )
    log.info(
        "resumed from %s at step %d (epoch %d, +%d steps)",
        path,
        state["step"],
        state["epoch"] + 1,
        state["step_in_epoch"],
    )


class CheckpointKeeper:
    """Called by the engine on every rank at checkpoint points: all ranks contribute their RNG state,
    rank 0 writes, everyone waits until the files are on disk."""

    def __init__(self, job: Job, ctx: RunContext, engine: Engine, recorder: NullRecorder) -> None:
        self.job, self.ctx, self.engine, self.recorder = job, ctx, engine, recorder
        self.metric = job.cfg.checkpoint.best_metric
        self.higher = job.cfg.checkpoint.best_mode == "max"
        self.best: float | None = None

    def __call__(self, pos: Position, values: dict[str, float], periodic: bool) -> None:
        value = values.get(self.metric)
        improved = value is not None and (
            self.best is None or (value > self.best if self.higher else value < self.best)
        )
        if improved:
            self.best = value
        if not (periodic or improved):
            return
        rngs = distributed.gather_objects(checkpoint.rng_state())
        if self.ctx.is_main:
            e = self.engine
            state = {
                "format": checkpoint.FORMAT,
                "step": pos.step,
                "epoch": pos.epoch,
                "step_in_epoch": pos.step_in_epoch,
                "world_size": self.ctx.world_size,
                "accumulate": e.s.accumulate,
                "model": e.model.base.state_dict(),
                "optimizer": e.optimizer.state_dict(),
                "scheduler": e.scheduler.state_dict() if e.scheduler is not None else {},
                "scaler": e.scaler.state_dict() if e.scaler is not None else {},
                "rng": rngs,
                "config": self.job.to_dict()["config"],
                "metrics": {"best": self.best, "best_metric": self.metric, "values": dict(values)},
            }
            self.recorder.save_checkpoint(state, periodic=periodic, best=improved)
        distributed.barrier()  # nobody runs ahead while rank 0 is still writing


def evaluate_only(engine: Engine, recorder: NullRecorder) -> dict[str, float]:
    try:
        values = engine.evaluate()
    except BaseException as exc:
        recorder.close("failed", error=repr(exc))
        raise
    recorder.epoch(epoch=engine.pos.epoch, epochs=engine.s.epochs, step=engine.step, values=values)
    recorder.close("completed")
    return values


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
    job: Job,
    ctx: RunContext,
    splits: Splits,
    model: torch.nn.Module,
    *,
    loader: str,
    lr: float,
    resumed: tuple[Path, dict[str, Any]] | None,
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
        "devices": p.devices,
        "sync_bn": bool(job.cfg.strategy.sync_bn),
        "global_batch_size": p.global_batch,
        "per_rank_batch_size": p.per_rank_batch * job.cfg.trainer.accumulate,
        "micro_batch_size": p.per_rank_batch,
        "device_type": p.device_type,
        "model": job.choices.get("model", job.cfg.model.get("_target_")),
        "data": job.choices.get("data", job.cfg.data.get("_target_")),
        "optim": job.cfg.optim.name,
        "lr": job.cfg.optim.lr,
        "lr_used": lr,
        "lr_scale_rule": job.cfg.optim.scale_rule,
        "lr_schedule": job.cfg.optim.schedule,
        "precision": str(job.cfg.trainer.precision),
        "accumulate": job.cfg.trainer.accumulate,
        "mode": job.cfg.trainer.mode,
        "resumed_from": str(resumed[0]) if resumed else None,
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

"""The composition root: everything one worker builds, in order, before the engine takes over."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from . import (
    activation_checkpointing,
    distributed,
    faults,
    float8,
    flops,
    memory,
    models,
    optim,
    resume,
    strategies,
    tasks,
    weights,
)
from .config import Mode, Precision
from .context import RunContext
from .data import DataSource, Splits, build_source, loaders
from .engine import Engine, LoopSettings
from .facts import run_facts
from .job import Job
from .launch.supervise import signals_ignored
from .models.moe import balance_over, routing_layers
from .recorder import Best, NullRecorder, Recorder
from .validate import check_split_sizes

log = logging.getLogger(__name__)


def run(job: Job, ctx: RunContext) -> dict[str, float]:
    cfg, trainer = job.cfg, job.cfg.trainer
    peak_memory = memory.Peak(ctx.device)  # this run's own, from here: not an earlier run's in this process
    settings = LoopSettings.from_config(cfg, job.plan)
    strategy = strategies.resolve(cfg.strategy)  # bound to its settings, once for this process
    configure_determinism(trainer.deterministic)
    seed_everything(cfg.seed)  # the same seed on every rank: identical initial weights everywhere
    splits = load_data(build_source(cfg.data), ctx)
    check_split_sizes(len(splits.train.dataset), len(splits.eval.dataset), job.plan, cfg)  # type: ignore[arg-type]
    model = build_model(job, splits)
    peak = flops.peak_flops(trainer.peak_flops, ctx.device, settings.precision)
    settings = with_throughput(settings, splits, model, peak[0])
    settings = with_routing(settings, model, job)
    if settings.precision == Precision.fp8:
        float8.convert(
            model, recipe=str(trainer.fp8_recipe), all_gather=trainer.fp8_all_gather, device=ctx.device
        )
    activations = memory.ActivationMeter()  # the engine measures with it; recomputations report to it
    activation_checkpointing.apply(model, trainer.activation_checkpointing, meter=activations)
    wrapped = strategy.wrap(model, ctx=ctx, measure_comm=trainer.measure_comm)
    if trainer.compile:
        strategy.compile(wrapped)
    seed_everything(cfg.seed + ctx.rank)  # from here on each rank draws its own random stream
    mode = loaders.choose_mode(cfg.loader.mode.value, splits.train, ctx.device)
    train_loader, eval_loader = (make_loader(job, ctx, splits, mode, train=t) for t in (True, False))
    lr = optim.scaled_lr(cfg.optim, job.plan.global_batch)
    optimizer = strategy.build_optimizer(wrapped, optim.spec(cfg.optim, lr=lr))
    weight_scales = lambda: None  # noqa: E731
    if settings.precision == Precision.fp8 and trainer.fp8_all_gather:
        weight_scales = float8.keep_weight_scales(wrapped.base, optimizer, wrapped.comm)
    steps = settings.total_steps(len(train_loader) // trainer.accumulate)
    resumed = resume.find_checkpoint(trainer.resume, ctx)
    best = Best(*tasks.best_of(cfg))
    facts = run_facts(
        job,
        ctx,
        splits,
        model,
        strategy,
        loader=mode,
        lr=lr,
        resumed=resumed[0] if resumed else None,
        flops_per_token=settings.flops_per_token,
        peak=peak,
    )
    recorder = open_recorder(
        ctx,
        facts,
        best=best,
        progress=trainer.progress,
        resumed=resumed,
        mode=trainer.mode,
        resuming=bool(trainer.resume),
    )
    with recorded_if_it_stops(recorder):  # metrics.json now exists, status running, until it stops
        engine = Engine(
            model=wrapped,
            optimizer=optimizer,
            train_loader=train_loader,
            eval_loader=eval_loader,
            recorder=recorder,
            settings=settings,
            device=ctx.device,
            task=tasks.build(cfg.task),
            scheduler=optim.build_schedule(optimizer, cfg.optim, steps),
            started_at=ctx.job_started_at,
            heartbeat=ctx.heartbeat,
            activations=activations,
            peak=peak_memory,
        )
        fault = faults.for_process(ctx.fault, rank=ctx.rank, attempt=ctx.attempt, job_pid=ctx.job_pid)
        engine.on_step = fault.after_step if fault else None
        engine.on_checkpoint = keeper = resume.CheckpointKeeper(
            ctx=ctx,
            strategy=strategy,
            engine=engine,
            recorder=recorder,
            best=best,
            keep_last_k=cfg.checkpoint.keep_last_k,
            config=job.to_dict()["config"],
            while_saving=fault.while_saving if fault else None,
        )
        if resumed is not None:
            keeper.restore(resumed, train=trainer.mode == Mode.train)
        weight_scales()  # of the weights training starts from
        if trainer.mode == Mode.eval:
            return evaluate_only(engine, recorder)
        return fit_and_record(engine, recorder, strategy)


def configure_determinism(enabled: bool) -> None:
    """Set both ways: an in-process run (ddpexp.run in a notebook) must not inherit the previous one's."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
    if torch.are_deterministic_algorithms_enabled() != enabled:  # setting it costs ~1.4 s, asking nothing
        torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.benchmark = not enabled  # fastest conv algorithms for fixed input shapes


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


def build_model(job: Job, splits: Splits) -> torch.nn.Module:
    model = models.build(job.cfg.model, splits.info)
    weights.load_initial(model, job.cfg.model)  # model.weights: the same file on every rank
    if job.cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def with_throughput(
    settings: LoopSettings, splits: Splits, model: torch.nn.Module, peak: float | None
) -> LoopSettings:
    """The loop reports tokens/s for data with tokens, and MFU where the model declares its FLOPs."""
    tokens = splits.info.tokens_per_sample
    return dataclasses.replace(
        settings,
        tokens_per_sample=tokens,
        flops_per_token=flops.model_flops_per_token(model, tokens),
        peak_flops=peak,
    )


def with_routing(settings: LoopSettings, model: torch.nn.Module, job: Job) -> LoopSettings:
    """A mixture of experts: its load-balancing loss is scaled by the sequences one rank's optimizer
    step holds, and the loop reports its routing (the whole model's MoE layers, before any split)."""
    layers = routing_layers(model)
    if not layers:
        return settings
    balance_over(model, job.plan.global_batch // job.plan.data_parallel)
    return dataclasses.replace(settings, routing=(len(layers), layers[0].cfg.experts + 3))


def make_loader(job: Job, ctx: RunContext, splits: Splits, mode: str, *, train: bool) -> loaders.Loader:
    cfg = job.cfg
    pin = cfg.loader.pin_memory if cfg.loader.pin_memory is not None else ctx.device.type == "cuda"
    return loaders.build(
        splits.train if train else splits.eval,
        mode=mode,
        batch_size=job.plan.per_rank_batch if train else job.plan.eval_per_rank_batch,
        rank=job.plan.shard_of_rank[ctx.rank],
        world=job.plan.data_parallel,
        seed=cfg.seed,
        device=ctx.device,
        train=train,
        num_workers=cfg.loader.num_workers,
        pin_memory=pin,
    )


def open_recorder(
    ctx: RunContext,
    facts: dict[str, Any],
    *,
    best: Best,
    progress: bool | None,
    resumed: resume.Found | None,
    mode: Mode,
    resuming: bool = False,
) -> NullRecorder:
    """Rank 0's recorder (a NullRecorder elsewhere). When resuming, TensorBoard drops what an earlier
    attempt logged after the checkpoint's step; after a restart or a resume that found no loadable
    checkpoint (starting from scratch), everything: old and new runs never mix."""
    if not ctx.is_main:
        return NullRecorder()
    purge_after = None
    if mode == Mode.train and resumed is not None:
        purge_after = int(resumed[1].get("step", 0))
    elif mode == Mode.train and (ctx.attempt > 0 or resuming):
        purge_after = 0
    show = progress if progress is not None else ctx.console_is_tty
    # The run's owner while it runs: its launcher, torchrun's agent, or this process in-process.
    owner = ctx.job_pid or (os.getppid() if ctx.plan.launcher == "torchrun" else os.getpid())
    return Recorder(
        ctx.run_dir, facts=facts, progress=show, best=best, resume_step=purge_after, owner_pid=owner
    )


@contextlib.contextmanager
def recorded_if_it_stops(recorder: NullRecorder) -> Iterator[None]:
    """Whatever ends the run before it completes (Ctrl-C, SIGTERM, a preemption, an error), from
    building the engine to the last save, metrics.json ends with the run's true status. The first
    `running` record is written in here too: a stop the moment it is on disk is recorded as well."""
    try:
        recorder.start()
        yield
    except (KeyboardInterrupt, GeneratorExit):
        # GeneratorExit: the block was left without this generator hearing why, which only a second
        # Ctrl-C or SIGTERM landing in the with-statement's exit does (submitit's local controller
        # passes the terminal's on to its jobs).
        with signals_ignored():  # a second Ctrl-C must not cut short the record of the first
            recorder.close("interrupted")
        raise
    except BaseException as exc:
        status = getattr(exc, "status", "interrupted" if getattr(exc, "interrupted", False) else "failed")
        with signals_ignored():
            recorder.close(status, error=str(exc) if status == "preempted" else repr(exc))
        raise


def evaluate_only(engine: Engine, recorder: NullRecorder) -> dict[str, float]:
    values = engine.evaluate()
    recorder.epoch(epoch=engine.pos.epoch, epochs=engine.settings.epochs, step=engine.step, values=values)
    recorder.close("completed")
    return values


def fit_and_record(
    engine: Engine, recorder: NullRecorder, strategy: strategies.Strategy[Any]
) -> dict[str, float]:
    """Run the engine and save the model (within `recorded_if_it_stops`: how it stops is recorded)."""
    result = engine.fit()
    recorder.save_model(strategy.model_state(engine.model))  # every rank: sharded weights gather
    recorder.close("completed")
    return result

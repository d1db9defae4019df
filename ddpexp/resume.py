"""Resuming and checkpoint policy, in one place: which checkpoint a run continues from, what a
checkpoint holds, when one is written, and loading it back into whatever strategy runs now.

File format, atomic writes and reading live in checkpoint.py; this module decides. Only rank 0 owns
the `Checkpointer` (the one `is_main` check of the checkpoint code); every rank contributes its state
(its RNG streams, and for strategies that shard, its part of the weights) and waits for the write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import checkpoint, distributed, weights
from .context import RunContext
from .engine import Engine
from .recorder import Best, NullRecorder

if TYPE_CHECKING:
    from .strategies import Strategy

log = logging.getLogger(__name__)

Found = tuple[Path, dict[str, Any]]


def find_checkpoint(resume: str | None, ctx: RunContext) -> Found | None:
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
        if ctx.is_main and checkpoint.has_any(ctx.run_dir):  # every one of them skipped above
            log.warning("no loadable checkpoint in %s: starting from scratch", ctx.run_dir)
        else:
            log.info("no checkpoint in %s yet, starting from scratch", ctx.run_dir)
        return None
    if chosen is not None:
        return chosen
    return Path(str(path)), checkpoint.load(Path(str(path)))


class CheckpointKeeper:
    """Called by the engine on every rank at checkpoint points (epoch ends, every_steps): decides
    whether to save (periodic, or a new best by the run's `Best`), gathers the state from every rank,
    and has rank 0 write it while the others wait."""

    def __init__(
        self,
        *,
        ctx: RunContext,
        strategy: Strategy[Any],
        engine: Engine,
        recorder: NullRecorder,
        best: Best,
        keep_last_k: int,
        config: dict[str, Any],
        while_saving: Callable[[int], None] | None = None,
    ) -> None:
        self.ctx, self.strategy, self.engine, self.recorder = ctx, strategy, engine, recorder
        self.best = best
        self.best_value: float | None = None
        self.config = config
        self.checkpointer = (
            checkpoint.Checkpointer(ctx.run_dir, keep_last_k=keep_last_k, while_saving=while_saving)
            if ctx.is_main
            else None
        )

    def __call__(self, values: dict[str, float], periodic: bool) -> None:
        value = values.get(self.best.metric)
        improved = self.best.improves(value, self.best_value)
        if improved:
            self.best_value = value
        if not (periodic or improved):
            return
        e = self.engine
        model = self.strategy.model_state(e.model)  # on every rank: sharded strategies gather here
        optimizer = self.strategy.optimizer_state(e.model, e.optimizer)
        rngs = distributed.gather_objects(checkpoint.rng_state())
        loop = e.state_dict()  # on every rank too: the epoch's loss so far is summed over ranks
        if self.checkpointer is not None:
            state = {
                "format": checkpoint.FORMAT,
                **loop,  # position, accumulate, global batch, schedule, loss scaler, epoch loss so far
                "world_size": self.ctx.world_size,
                "data_parallel": self.ctx.plan.data_parallel,  # the shards the sample order is cut into
                "model": model,
                "optimizer": optimizer,
                "rng": rngs,
                "config": self.config,
                "metrics": {"best": self.best_value, "best_metric": self.best.metric, "values": dict(values)},
            }
            self.recorder.flush()  # a run resumed from this checkpoint keeps every point logged before it
            self.checkpointer.save(state, periodic=periodic, best=improved)
        distributed.barrier()  # nobody runs ahead while rank 0 is still writing

    def restore(self, found: Found, *, train: bool) -> None:
        """Load a checkpoint (or bare weights) into the running strategy; with `train`, also the
        optimizer, schedule, position and (for the same layout) every rank's random streams."""
        path, state = found
        e = self.engine
        fitted = weights.fit(state["model"], e.model.base, source=path, setting="trainer.resume")
        self.strategy.load_model_state(e.model, fitted.state)
        if not train or "optimizer" not in state:
            log.info("loaded weights from %s", path)
            return
        self.strategy.load_optimizer_state(e.model, e.optimizer, state["optimizer"])
        e.load_state_dict(state)
        self.best_value = state["metrics"].get("best")
        same_layout = (state["world_size"], state.get("data_parallel", state["world_size"])) == (
            self.ctx.world_size,
            self.ctx.plan.data_parallel,
        )
        if same_layout and state["accumulate"] == e.settings.accumulate:
            checkpoint.set_rng_state(state["rng"][self.ctx.rank])
        else:
            log.warning(
                "resuming a run saved with world size %d x accumulate %d as %d x %d: training continues "
                "from step %d on the samples an uninterrupted run would train each step on (an epoch's "
                "order splits alike over any number of shards), but each rank draws new random streams "
                "(dropout, augmentation) and sums over ranks and micro-batches in another order",
                state["world_size"],
                state["accumulate"],
                self.ctx.world_size,
                e.settings.accumulate,
                state["step"],
            )
        log.info(
            "resumed from %s at step %d (epoch %d, +%d steps)",
            path,
            state["step"],
            state["epoch"] + 1,
            state["step_in_epoch"],
        )

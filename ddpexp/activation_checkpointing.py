"""Activation checkpointing (trainer.activation_checkpointing): keep less of the forward pass for the
backward and recompute the rest there, applied to the model's declared blocks before the strategy
wraps the model.

The blocks are the model's own declaration, the one fsdp shards by: `shard_units()` if it has it, else
`stages()`; only blocks that are submodules of the model count (stages() may build containers for
ddp_mp around modules the model calls one by one, whose forward never runs), and a block inside
another declared block is left to the outer one. A model that declares none is refused in pre-flight.

Each block's forward runs under torch.utils.checkpoint (non-reentrant). The block is not wrapped in
another module: its class is swapped for a subclass whose forward checkpoints the original (as
fully_shard swaps it for its own), so every parameter keeps its name, state_dict keys are the same
with or without checkpointing, and any strategy applied afterwards (DDP, fully_shard, a pipeline's
split, torch.compile) finds the same modules.

- full: each block keeps only its input; the whole block runs again in its backward.
- selective: PyTorch's selective activation checkpointing (create_selective_checkpoint_contexts) with
  an operator policy: the outputs of matrix multiplications, convolutions and attention are kept, every
  other op (norms, activations, pooling, elementwise) is recomputed from them. The kept ops are the
  expensive ones to redo, the recomputed ones are cheap but each adds a tensor the size of the
  activations, so it saves much of full's memory for a fraction of its extra compute.
- selective_half: torchtitan's op-level policy (`selective_ac_option=op`): as selective, but of a
  block's matrix products (mm, addmm) only the first, third, fifth... are kept, every second one
  recomputed: less memory than selective for one more matmul in two redone.

BatchNorm's running statistics are updated once per forward, as without checkpointing: while a block
recomputes, its BatchNorm layers normalise by the batch's statistics without counting the batch again
(torch.utils.checkpoint alone would update them twice).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import models
from .config import ActivationCheckpointing
from .errors import UserError
from .memory import ActivationMeter

log = logging.getLogger(__name__)
_aten = torch.ops.aten
# selective keeps these ops' outputs (the rest is recomputed); attention under each backend's name.
KEPT_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",  # float8's (trainer.precision=fp8)
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)


def declared_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's declared blocks (models.declared_blocks), outermost only."""
    blocks = models.declared_blocks(model)
    nested = {id(sub) for b in blocks for sub in b.modules() if sub is not b}
    return [b for b in blocks if id(b) not in nested]


def check(model: nn.Module, mode: ActivationCheckpointing) -> None:
    """Pre-flight (`model` on the meta device): checkpointing needs blocks to checkpoint."""
    if mode != ActivationCheckpointing.none and not declared_blocks(model):
        raise UserError(
            f"{type(model).__name__} declares no blocks to checkpoint (no shard_units() or stages() "
            "returning its submodules)",
            setting="trainer.activation_checkpointing",
            fix="set trainer.activation_checkpointing=none, or give the model a shard_units() method "
            "returning its blocks (docs/own-model.md)",
        )


def apply(model: nn.Module, mode: ActivationCheckpointing, *, meter: ActivationMeter | None = None) -> int:
    """Checkpoint each declared block of `model` in place; the number of blocks checkpointed. `meter`
    (measuring activation memory) is told when a block recomputes."""
    if mode == ActivationCheckpointing.none:
        return 0
    check(model, mode)
    blocks = declared_blocks(model)
    for block in blocks:
        block.__class__ = _checkpointed(type(block))
        # In the instance's own attributes (not a submodule, nor a state_dict entry).
        block.__dict__["_ac"] = _Settings(mode=mode, meter=meter)
    log.info(
        "activation checkpointing (%s) of %d blocks of %s", mode.value, len(blocks), type(model).__name__
    )
    return len(blocks)


def _checkpointed(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` with a forward that checkpoints its own; one class for every block of one type."""
    if getattr(cls, "_ac_checkpointed", False):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"Checkpointed{cls.__name__}", (cls,), {"forward": _forward_of(cls), "_ac_checkpointed": True}
        )
    return _CLASSES[cls]


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def hook_options(checkpoint_fn: Any) -> dict[str, Any]:
    """The meter sees what selective keeps only where checkpoint honours saved-tensor hooks around it;
    a torch without that switch (2.11 has none) would hand the keyword on to the block's forward."""
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint_fn).parameters:
        return {"respect_saved_tensors_hooks": True}
    return {}


_RESPECT_HOOKS = hook_options(checkpoint)


# The matrix products selective_half keeps one in two of.
HALVED_OPS = frozenset(getattr(_aten, name).default for name in ("mm", "addmm", "_scaled_mm"))


@dataclass(frozen=True)
class _Settings:
    mode: ActivationCheckpointing
    meter: ActivationMeter | None

    @property
    def selective(self) -> bool:
        return self.mode != ActivationCheckpointing.full

    def policy(self) -> Any:
        """A policy for one checkpointed call (selective_half's counts that call's matmuls)."""
        return keep_expensive_ops if self.mode == ActivationCheckpointing.selective else half_of_matmuls()


def _forward_of(cls: type[nn.Module]) -> Any:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = functools.partial(cls.forward, self)
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward anyway
            return run(*args, **kwargs)
        settings: _Settings = self.__dict__["_ac"]
        meter = settings.meter
        if torch.compiler.is_compiling():  # compiled: the partitioner recomputes, from the same policy
            if not settings.selective:
                return checkpoint(run, *args, use_reentrant=False, **kwargs)
            half = settings.mode == ActivationCheckpointing.selective_half
            contexts = half_contexts if half else selective_contexts
            return checkpoint(run, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        measuring = meter is not None and meter.measuring
        return checkpoint(
            run,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(_contexts, self, settings),
            # Recompute the whole block while measuring, so the tensors it made are done with at its end.
            early_stop=not measuring,
            **_RESPECT_HOOKS,
            **kwargs,
        )

    return forward


def keep_expensive_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """selective's policy: keep what is costly to recompute, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# What compiled code checkpoints with (the compiler takes a context function defined at module level).
def selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(keep_expensive_ops)


def half_contexts() -> Any:
    return create_selective_checkpoint_contexts(half_of_matmuls())


def half_of_matmuls() -> Any:
    """selective_half's policy for one checkpointed call: selective's, but every second matrix product
    (counted apart in the forward and in the recomputation, which must decide alike) recomputed."""
    seen = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in HALVED_OPS:
            seen[ctx.is_recompute] += 1
            kept = seen[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE
        return keep_expensive_ops(ctx, op, *args, **kwargs)

    return policy


def _contexts(
    block: nn.Module, settings: _Settings
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """torch.utils.checkpoint's context_fn: (around the forward, around the recomputation)."""
    forward, recompute = (
        create_selective_checkpoint_contexts(settings.policy())
        if settings.selective
        else (contextlib.nullcontext(), contextlib.nullcontext())
    )
    return forward, _Recomputation(block, recompute, settings.meter)


class _Recomputation:
    """`_recomputation`, entered afresh each time: a backward split into the inputs' and the weights'
    gradients (the zero-bubble pipeline schedules) recomputes a checkpointed block once for each."""

    def __init__(
        self, block: nn.Module, inner: contextlib.AbstractContextManager[Any], meter: ActivationMeter | None
    ) -> None:
        self.block, self.inner, self.meter = block, inner, meter
        self.entered: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        context = _recomputation(self.block, self.inner, self.meter)
        self.entered.append(context)
        context.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self.entered.pop().__exit__(*exc)


@contextlib.contextmanager
def _recomputation(
    block: nn.Module, inner: contextlib.AbstractContextManager[Any], meter: ActivationMeter | None
) -> Iterator[None]:
    """Around a block's recomputation. Its BatchNorm layers run as in the forward (the same tensors
    saved, which checkpoint checks) with momentum 0, which leaves their running statistics as they are,
    and their batch count is put back."""
    norms = [
        (m, m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
        for m in block.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
    ]
    for m, _, _ in norms:
        m.momentum = 0.0
    try:
        with inner, meter.recomputing() if meter is not None else contextlib.nullcontext():
            yield
    finally:
        with torch.no_grad():
            for m, momentum, count in norms:
                m.momentum = momentum
                if count is not None and m.num_batches_tracked is not None:
                    m.num_batches_tracked.copy_(count)

"""Bytes that live on this rank, by category, counted from the tensors themselves (the local shard of
a sharded tensor), so they mean the same on CPU and GPU and show what sharding saves:

  params      the model's parameters as this rank holds them between steps (FSDP: its shard)
  grads       their gradients after the backward of a step (FSDP: the reduce-scattered shard)
  optim_state the optimizer's state tensors on this rank (ZeRO: its shard; SGD: momentum buffers)

Measured once, after the first optimizer step and before the gradients are released. Memory that
exists only inside a step (gathered FSDP parameters, activations, communication buffers) is not in
these numbers; mem/peak_mb (CUDA max allocated, or RSS on CPU) covers it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

MB = 2**20


def local_bytes(t: Any) -> int:
    """Bytes of this rank's part of `t` (a DTensor's local shard, or the tensor itself)."""
    if t is None:
        return 0
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        t = to_local()
    return int(t.numel() * t.element_size())


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[Any]:
    # ZeroRedundancyOptimizer keeps this rank's shard in the optimizer it wraps (`optim`).
    inner = getattr(optimizer, "optim", None)
    source = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    for state in source.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def resident_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    # A parameter on the meta device is held by another rank (a pipeline's other stages).
    params = [p for p in model.parameters() if not p.is_meta]
    return {
        "mem/params_mb": sum(local_bytes(p) for p in params) / MB,
        "mem/grads_mb": sum(local_bytes(p.grad) for p in params) / MB,
        "mem/optim_state_mb": sum(local_bytes(t) for t in _state_tensors(optimizer)) / MB,
    }

"""The run's model, rebuilt from its config on the meta device (shapes, no memory), and what its inputs
look like: what a strategy's `communication` needs to size what it sends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from .measured import MeasuredRun


@dataclass(frozen=True)
class ModelShape:
    """The run's model on the meta device, and what its inputs look like."""

    model: Any  # nn.Module on the meta device
    input_shape: tuple[int, ...] | None
    input_dtype: Any  # torch.dtype
    note: str | None = None  # how it was obtained, where not from the run's config


def model_shape(run: MeasuredRun) -> ModelShape:
    """The run's model rebuilt from its config.yaml on the meta device (shapes, no memory); where that
    is impossible (no config at hand, the model's code not importable) one flat parameter of
    facts.parameters elements: the bytes stay right, FSDP's padding, buckets and stages do not."""
    import torch
    from torch import nn

    reason = "no config.yaml at hand"
    unimportable = None if run.config is None else _unimportable(run.config.model.get("_target_"))
    if unimportable is not None:
        reason = unimportable
    elif run.config is not None:
        try:
            from .. import models
            from ..data import build_source

            info = build_source(run.config.data).info()
            with torch.device("meta"):
                model = models.build(run.config.model, info)
            dtype = torch.long if info.vocab_size is not None else torch.float32
            return ModelShape(model, tuple(info.input_shape), dtype)
        except Exception as exc:  # a model of the user's that does not build here
            reason = f"rebuilding it failed: {' '.join(str(exc).split())[:120]}"
    count = int(run.facts.get("parameters") or 0)
    if count <= 0:
        raise UserError(
            "cannot tell the model's size: no config.yaml and no facts.parameters",
            setting="RUN_DIR",
            fix="give the run directory itself (it holds config.yaml)",
        )
    flat = nn.Module()
    flat.weight = nn.Parameter(torch.empty(count, device="meta"))
    note = (
        f"model taken as one flat tensor of {count:,} parameters ({reason}): its bytes stay right, FSDP's "
        "padding, buckets and stages do not"
    )
    return ModelShape(flat, None, torch.float32, note)


def _unimportable(target: object) -> str | None:
    """Why the model's builder `target` (model._target_) does not import here, or None where it does."""
    if not isinstance(target, str):
        return None
    from hydra._internal.utils import _locate

    try:
        _locate(target)
    except Exception as exc:
        cause = exc.__cause__ or exc
        why = f"{type(cause).__name__}: {' '.join(str(cause).split())[:80]}"
        return (
            f"its code, {target}, does not import here ({why}): run ddpexp-predict from the directory "
            "the run was started in, or put its module on PYTHONPATH"
        )
    return None

"""Float8 training (trainer.precision=fp8): the linear layers of the model's blocks compute in float8,
everything else in bf16, as torchtitan trains Llama 3 on H100s.

Each `nn.Linear` inside a block the model declares (models.declared_blocks: the ones fsdp shards and
activation checkpointing wraps) whose two dimensions are multiples of 16 becomes torchao's
`Float8Linear` with dynamic scaling: at every call the input and the weight are cast to float8 e4m3
and the output's gradient to e5m2, each with a scale from its own absolute maximum (`tensorwise`: one
scale a tensor; `rowwise`: one a row, `trainer.fp8_recipe`), and the products run in
`torch._scaled_mm` with bf16 outputs. The embedding and the output head stay bf16 (they are outside
the blocks), and so does everything that is not a matrix product, under the engine's bf16 autocast or
FSDP's bf16 parameters. Parameters, gradients and optimizer state stay as stored (fp32).

The layer's state dict is a Linear's (weight, bias), so checkpoints move between fp8 and any other
precision or strategy. Dimensions not multiples of 16 are left in bf16: `_scaled_mm` needs them so.

On a CPU the products are emulated (torchao's `emulate`): the same casts to float8 with the same
scales, each product computed on the float8 values widened to fp32. torch._scaled_mm does run on a
CPU, but as a reference loop about 50 times slower than the emulation on gpt_tiny's shapes
(docs/training.md), so a CPU run proves the recipe's numerics, not the kernel's speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

from . import models
from .errors import UserError


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao registers an Enum with torch's pytree on import, which torch now logs a deprecation
    warning for: not the user's concern."""
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pytree.setLevel(level)


def eligible(model: nn.Module) -> list[str]:
    """The names of the linear layers fp8 converts: inside the model's declared blocks, both dims
    multiples of 16."""
    inside = {id(m) for block in models.declared_blocks(model) for m in block.modules()}
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and id(m) in inside
        and m.in_features % 16 == 0
        and m.out_features % 16 == 0
    ]


def check(model: nn.Module) -> None:
    """One line with the fix when fp8 would convert nothing."""
    if eligible(model):
        return
    linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
    why = (
        "has no linear layers"
        if not linear
        else "declares no blocks (shard_units() or stages())"
        if not models.declared_blocks(model)
        else "has no linear layer in its blocks with both dims multiples of 16"
    )
    raise UserError(
        f"trainer.precision=fp8 computes the linear layers of the model's blocks in float8; "
        f"{type(model).__name__} {why}",
        setting="trainer.precision",
        fix="use trainer.precision=bf16, or a transformer (model=gpt_tiny, gpt_small, llama3_2_1b...)",
    )


def convert(model: nn.Module, *, recipe: str = "tensorwise", device: Any = None) -> int:
    """Swap the eligible linear layers for torchao's Float8Linear in place; returns how many. `device`:
    where the run computes (refused where float8 products cannot run; on a CPU they are emulated);
    None: a prediction's fake model, traced with the products a GPU runs."""
    import torch

    _check_device(device)
    with _quiet_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(eligible(model))
    config = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
    if device is not None and torch.device(device).type != "cuda":
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in names)
    return len(names)


def _check_device(device: Any) -> None:
    """float8 products need a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell)."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise UserError(
            f"float8 matrix products need a GPU of compute capability 8.9 or later; "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}",
            setting="trainer.precision",
            fix="use trainer.precision=bf16 on this GPU (fp8 runs on H100, H200, L40S, B200...)",
        )


def is_float8(module: Any) -> bool:
    with _quiet_import():
        from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)

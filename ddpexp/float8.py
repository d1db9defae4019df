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
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from . import models
from .errors import UserError

log = logging.getLogger(__name__)


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


def weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the layers fp8 converts (`eligible`), on a converted model or not."""
    names = set(eligible(model))
    return [m.weight for name, m in model.named_modules() if name in names]


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


def convert(
    model: nn.Module, *, recipe: str = "tensorwise", all_gather: bool = False, device: Any = None
) -> int:
    """Swap the eligible linear layers for torchao's Float8Linear in place; returns how many. `device`:
    where the run computes (refused where float8 products cannot run; on a CPU they are emulated);
    None: a prediction's fake model, traced with the products a GPU runs. `all_gather`: FSDP gathers
    their weights in float8 (tensorwise only)."""
    import torch

    _check_device(device)
    with _quiet_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(eligible(model))
    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    if device is not None and torch.device(device).type != "cuda":
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in names)
    if all_gather:
        for name, module in model.named_modules():
            if name in names:
                module.register_state_dict_post_hook(_plain_weight)
    return len(names)


def _plain_weight(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    """A weight torchao wrapped for FSDP's float8 gather is saved as the tensor it wraps: a Linear's
    state, loadable at any precision (and by torch.load's weights_only) where no FSDP gathered it."""
    with _quiet_import():
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weight = state.get(prefix + "weight")
    if isinstance(weight, WeightWithDynamicFloat8CastTensor):
        state[prefix + "weight"] = weight._tensor


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


def gathered_weights(model: nn.Module) -> list[Any]:
    """The float8 layers' weights FSDP gathers in float8 (trainer.fp8_all_gather): DTensors whose local
    shard is torchao's float8-casting weight, in a module FSDP manages."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    with _quiet_import():
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return []
    return [
        m.weight
        for m in model.modules()
        if is_float8(m)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]


def keep_weight_scales(model: nn.Module, optimizer: Any, meter: Any = None) -> Callable[[], None]:
    """Under trainer.fp8_all_gather: after every optimizer step, the scales of all the weights FSDP
    gathers in float8 from one all-reduce of their absolute maxima (torchao's
    precompute_float8_dynamic_scale_for_fsdp, as torchtitan runs it), rather than an all-reduce of one
    float for each weight at each of its gathers. Counted into `meter` (kind parameters): the maxima,
    one float a weight, all-reduced over each mesh dimension the weights are sharded on. Returns what
    computes them once, outside any step, for the weights training starts from (after a resume's
    restore): the first step then sends what every other does. Where FSDP gathers no weight, as under
    ddp or tensor parallelism alone, the setting changes nothing (a line in the log says so)."""
    import time

    weights = gathered_weights(model)
    if not weights:
        log.info("trainer.fp8_all_gather: FSDP gathers no float8 weight in this run; nothing changes")
        return lambda: None
    with _quiet_import():
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    # One all-reduce for each mesh dimension the weights are split on (FSDP's, tensor parallelism's).
    dims = sum(not p.is_replicate() for p in weights[0].placements)
    nbytes = len(weights) * 4 * dims

    def after_step(*_: Any) -> None:
        start = time.perf_counter()
        precompute_float8_dynamic_scale_for_fsdp(model)
        if meter is not None:
            meter.record(start, time.perf_counter(), nbytes, "parameters")

    optimizer.register_step_post_hook(after_step)
    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def is_float8(module: Any) -> bool:
    with _quiet_import():
        from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)

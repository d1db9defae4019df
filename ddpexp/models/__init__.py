"""Models. Each is a build function (or class) named by `_target_` in conf/model/*.yaml, or on the
command line: `model._target_=my_models.Net` builds your own.

The dataset's facts are wired into the build function, never hand-copied between YAML files: it
receives those of `num_classes`, `input_shape`, `vocab_size` and `pad_index` (text) that it declares
as parameters. A build function that takes `**kwargs` instead (torchvision's and timm's
`resnet18(*, weights=None, progress=True, **kwargs)`) receives `num_classes` only, their convention.

`model.weights` and `model.weights_strict` are ddpexp's settings (initial weights, see weights.py),
never arguments of the build function. Models may also say how they split into pipeline stages for
model parallelism: `stages()` returns submodules whose composition, in order, is the forward pass.
"""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..data import DataInfo
from ..errors import UserError


def wired_kwargs(model_cfg: DictConfig, info: DataInfo) -> dict[str, Any]:
    """The dataset-derived arguments the model's build function takes; a conflicting value forced by
    the user, or a text model on images (and vice versa), is an error. A vocab_size larger than the
    dataset's is not a conflict: the embedding has rows the data never looks up."""
    offered = info.model_kwargs()
    found = _parameters(model_cfg)
    target = model_cfg.get("_target_", "?")
    if found is not None:
        accepted, takes_kwargs = found
        if takes_kwargs:  # torchvision's/timm's convention: num_classes, the rest is the model's own
            accepted = accepted | set(KWARGS_GET)
        elif "vocab_size" in offered and "vocab_size" not in accepted:
            raise UserError(
                f"{target} reads images but this dataset gives token ids",
                setting="model",
                fix="use a language model (model=gpt_tiny, or your own that takes vocab_size)"
                if info.targets == "token"
                else "use a text model (model=gcnn or model=embbag) with data=imdb",
            )
        elif "vocab_size" in accepted and "vocab_size" not in offered:
            raise UserError(
                f"{target} reads token ids but this dataset gives images",
                setting="model",
                fix="give it token ids (data=python_stdlib task=lm for a language model such as gpt_tiny, "
                "data=imdb for a text classifier), or use an image model (convnet, resnet18...)",
            )
        offered = {k: v for k, v in offered.items() if k in accepted}
    wired = offered
    for key, value in wired.items():
        forced = model_cfg.get(key)
        if forced is None:
            continue
        forced = OmegaConf.to_container(forced) if OmegaConf.is_config(forced) else forced
        if key == "vocab_size" and isinstance(forced, int) and forced > value:
            wired[key] = forced  # rows no token id reaches (GPT-2's vocabulary on a byte corpus)
        elif forced != value:
            raise UserError(
                f"is {forced} but the dataset provides {value}",
                setting=f"model.{key}",
                fix=f"set model.vocab_size>={value}, or null: the dataset's"
                if key == "vocab_size"
                else f"remove the model.{key} override: it is wired from the dataset",
            )
    return wired


def declared_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks the model declares (`shard_units()`, else `stages()`) that are submodules of it.
    stages() may build containers for ddp_mp around modules the model calls one by one (ResNet's stem
    and head), whose own forward never runs: fsdp and activation checkpointing leave those out."""
    for name in ("shard_units", "stages"):
        declared = getattr(model, name, None)
        if callable(declared):
            inside = {id(m) for m in model.modules() if m is not model}
            return [m for m in declared() if id(m) in inside]
    return []


# ddpexp's own settings in the model group: read by weights.py, never passed to the build function.
SETTINGS = ("weights", "weights_strict")
# What a build function that takes **kwargs is given (the torchvision/timm convention).
KWARGS_GET = ("num_classes",)


def _parameters(model_cfg: DictConfig) -> tuple[set[str], bool] | None:
    """(the build function's parameter names, whether it takes **kwargs); None if it cannot be found
    (instantiate reports that)."""
    import inspect

    from hydra._internal.utils import _locate  # get_method would log its failure as an error

    try:
        fn = _locate(model_cfg["_target_"])
        params = inspect.signature(fn).parameters.values()
    except Exception:
        return None  # instantiate() will report the bad target
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}, takes_kwargs


def build(model_cfg: DictConfig, info: DataInfo) -> nn.Module:
    """The model, randomly initialised (model.weights are loaded by the caller: weights.load_initial)."""
    arguments = OmegaConf.masked_copy(model_cfg, [str(k) for k in model_cfg if k not in SETTINGS])
    try:
        return instantiate(arguments, **wired_kwargs(model_cfg, info), _convert_="all")
    except InstantiationException as exc:
        if isinstance(exc.__cause__, UserError):  # the build function's own refusal, as it said it
            raise exc.__cause__ from None
        raise

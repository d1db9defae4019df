"""Models. Each is a build function named by `_target_` in conf/model/*.yaml.

Build functions receive `num_classes` and `input_shape` from the dataset (never hand-copied between
YAML files). Models also say how they split into pipeline stages for model parallelism: `stages()`
returns submodules whose composition, in order, is the forward pass.
"""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..data import DataInfo
from ..errors import UserError


def wired_kwargs(model_cfg: DictConfig, info: DataInfo) -> dict[str, Any]:
    """The dataset-derived arguments the model's build function takes; a conflicting value forced by
    the user, or a text model on images (and vice versa), is an error."""
    offered = info.model_kwargs()
    accepted = _parameters(model_cfg)
    target = model_cfg.get("_target_", "?")
    if accepted is not None:
        if "vocab_size" in offered and "vocab_size" not in accepted:
            raise UserError(
                f"{target} reads images but this dataset gives token ids",
                setting="model",
                fix="use a text model (model=gcnn or model=embbag) with data=imdb",
            )
        if "vocab_size" in accepted and "vocab_size" not in offered:
            raise UserError(
                f"{target} reads token ids but this dataset gives images",
                setting="model",
                fix="use data=imdb with this model, or an image model (convnet, resnet18...)",
            )
        offered = {k: v for k, v in offered.items() if k in accepted}
    wired = offered
    for key, value in wired.items():
        forced = model_cfg.get(key)
        if forced is None:
            continue
        forced = OmegaConf.to_container(forced) if OmegaConf.is_config(forced) else forced
        if forced != value:
            raise UserError(
                f"is {forced} but the dataset provides {value}",
                setting=f"model.{key}",
                fix=f"remove the model.{key} override: it is wired from the dataset",
            )
    return wired


def _parameters(model_cfg: DictConfig) -> set[str] | None:
    """Keyword parameters of the build function, or None if it takes **kwargs (then pass all)."""
    import inspect

    from hydra.utils import get_method

    try:
        fn = get_method(model_cfg["_target_"])
        params = inspect.signature(fn).parameters.values()
    except Exception:
        return None  # instantiate() will report the bad target
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def build(model_cfg: DictConfig, info: DataInfo) -> nn.Module:
    return instantiate(model_cfg, **wired_kwargs(model_cfg, info), _convert_="all")

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
    """The dataset-derived arguments for the model; a conflicting value forced by the user is an error."""
    wired = info.model_kwargs()
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


def build(model_cfg: DictConfig, info: DataInfo) -> nn.Module:
    return instantiate(model_cfg, **wired_kwargs(model_cfg, info), _convert_="all")

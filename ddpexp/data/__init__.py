"""Datasets. Each one is a build function (named by `_target_` in conf/data/*.yaml) returning a
DataSource: a cheap, lazy handle the parent can validate with before anything is launched, and that
each worker then loads."""

from __future__ import annotations

from typing import Any

from ..errors import UserError
from .external import SETTINGS, External, keyword_parameters
from .source import (
    DataInfo,
    DataSource,
    Split,
    Splits,
    corrupt_file_error,
    missing_files_error,
    resolve_root,
)

__all__ = [
    "DataInfo",
    "DataSource",
    "Split",
    "Splits",
    "build_source",
    "corrupt_file_error",
    "missing_files_error",
    "resolve_root",
]


def build_source(data_cfg: Any) -> DataSource:
    """The data section's `_target_`, called: a DataSource as it is, or the torch Dataset(s) a builder
    of yours returned, wrapped (data/external.py, with its settings val_fraction, split_seed and
    num_classes held back from builders that do not declare them)."""
    from hydra.utils import get_method, instantiate
    from omegaconf import OmegaConf

    # Resolved where it stands: a copy of the section alone would lose what its interpolations point
    # at elsewhere (block_size: ${oc.select:model.block_size,128}).
    if OmegaConf.is_config(data_cfg):
        data_cfg = OmegaConf.create(OmegaConf.to_container(data_cfg, resolve=True))
    target = str(data_cfg["_target_"])
    declared = keyword_parameters(get_method(target)) or set()
    held = {k: data_cfg[k] for k in SETTINGS if k in data_cfg and k not in declared}
    arguments = OmegaConf.masked_copy(data_cfg, [k for k in data_cfg if k not in held])
    made = instantiate(arguments, _convert_="all")
    if isinstance(made, DataSource):
        if held:
            key = next(iter(held))
            raise UserError(
                f"is not an argument of {target}, which builds its own DataSource",
                setting=f"data.{key}",
                fix=f"remove data.{key}",
            )
        return made
    settings = {**SETTINGS, **{k: v for k, v in held.items() if v is not None}}
    return External(made, target=target, **settings)

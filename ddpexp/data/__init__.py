"""Datasets. Each one is a build function (named by `_target_` in conf/data/*.yaml) returning a
DataSource: a cheap, lazy handle the parent can validate with before anything is launched, and that
each worker then loads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know to fit the data (wired into the model's build function)."""

    num_classes: int
    input_shape: tuple[int, ...]  # (C, H, W) for images

    def model_kwargs(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "input_shape": list(self.input_shape)}


@dataclass
class Split:
    dataset: Dataset[Any]
    # (inputs, targets) when the whole split is in memory with no per-sample transform: lets the
    # device-resident loader skip the DataLoader entirely.
    tensors: tuple[torch.Tensor, torch.Tensor] | None = None
    collate: Callable[[list[Any]], Any] | None = None

    @classmethod
    def from_tensors(cls, x: torch.Tensor, y: torch.Tensor) -> Split:
        return cls(dataset=TensorDataset(x, y), tensors=(x, y))


@dataclass
class Splits:
    train: Split
    eval: Split
    info: DataInfo


class DataSource:
    """A dataset before loading. Subclasses override what applies to them."""

    name = "dataset"

    def info(self) -> DataInfo:
        raise NotImplementedError

    def check(self) -> None:
        """Raise UserError if the data cannot be loaded (files missing...). Cheap, no side effects."""

    def prepare(self, work_dir: Path) -> None:
        """Once per run, on rank 0 only, before the others load (downloads, vocabularies)."""

    def load(self, work_dir: Path) -> Splits:
        raise NotImplementedError

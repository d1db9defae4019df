"""Synthetic data of any shape, generated deterministically from a seed, with targets from a fixed
random linear teacher, so they are learnable (tests and benchmarks need that): the teacher's argmax
as a class label, or (regression=true) the teacher's `num_classes` outputs themselves as float
targets, as tutorial 004's toy regression."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .source import DataInfo, DataSource, Split, Splits


class Synthetic(DataSource):
    name = "synthetic"

    def __init__(
        self,
        *,
        num_train: int,
        num_eval: int,
        num_classes: int,
        shape: list[int],
        seed: int,
        regression: bool = False,
    ) -> None:
        self.num_train = num_train
        self.num_eval = num_eval
        self.num_classes = num_classes
        self.shape = tuple(shape)
        self.seed = seed
        self.regression = regression

    def info(self) -> DataInfo:
        return DataInfo(
            num_classes=self.num_classes,
            input_shape=self.shape,
            targets="value" if self.regression else "class",
            train_samples=self.num_train,
            eval_samples=self.num_eval,
        )

    def load(self, work_dir: Path) -> Splits:
        g = torch.Generator().manual_seed(self.seed)
        n = self.num_train + self.num_eval
        x = torch.randn(n, *self.shape, generator=g)
        dim = math.prod(self.shape)
        teacher = torch.randn(dim, self.num_classes, generator=g) / math.sqrt(dim)
        scores = x.reshape(n, dim) @ teacher
        y = scores if self.regression else scores.argmax(dim=1)
        t = self.num_train
        return Splits(
            train=Split.from_tensors(x[:t], y[:t]),
            eval=Split.from_tensors(x[t:], y[t:]),
            info=self.info(),
        )


def synthetic(
    *,
    num_train: int = 2048,
    num_eval: int = 512,
    num_classes: int = 10,
    shape: list[int] | None = None,
    seed: int = 0,
    regression: bool = False,
) -> Synthetic:
    return Synthetic(
        num_train=num_train,
        num_eval=num_eval,
        num_classes=num_classes,
        shape=list(shape) if shape is not None else [1, 28, 28],
        seed=seed,
        regression=regression,
    )

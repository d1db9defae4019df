"""A model as a user would write one: no stages(), so model parallelism cannot split it."""

from __future__ import annotations

import math

import torch
from torch import nn


def unsplittable(*, num_classes: int, input_shape: list[int]) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


class Tied(nn.Module):
    """A model with one weight used twice, in two of its stages() blocks: `middle` and `again` hold
    one Linear weight (state_dict names it under both), as language models tie their embedding and
    output layer. Its blocks are submodules, so fsdp takes them as shard units."""

    def __init__(self, *, num_classes: int, input_shape: list[int], hidden: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU())
        self.middle = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())
        self.again = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())
        self.again[0].weight = self.middle[0].weight
        self.head = nn.Linear(hidden, num_classes)

    def stages(self) -> list[nn.Module]:
        return [self.stem, self.middle, self.again, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.again(self.middle(self.stem(x))))


def tied(*, num_classes: int, input_shape: list[int]) -> nn.Module:
    return Tied(num_classes=num_classes, input_shape=input_shape)

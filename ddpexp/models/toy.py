"""The tutorials' toy model: linear -> ReLU -> linear on flattened inputs."""

from __future__ import annotations

import math

import torch
from torch import nn


class Toy(nn.Module):
    def __init__(self, *, num_classes: int, input_shape: list[int], hidden: int) -> None:
        super().__init__()
        self.net1 = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU())
        self.net2 = nn.Linear(hidden, num_classes)

    def stages(self) -> list[nn.Module]:
        return [self.net1, self.net2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x))


def toy(*, num_classes: int, input_shape: list[int], hidden: int = 10) -> Toy:
    return Toy(num_classes=num_classes, input_shape=input_shape, hidden=hidden)

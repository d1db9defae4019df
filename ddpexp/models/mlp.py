"""A multi-layer perceptron on flattened inputs: no BatchNorm, so its distributed runs must match
single-process training exactly (the parity tests rely on that)."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, *, num_classes: int, input_shape: list[int], hidden: list[int]) -> None:
        super().__init__()
        sizes = [math.prod(input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(sizes[-1], num_classes)

    def stages(self) -> list[nn.Module]:
        return [self.body, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def mlp(*, num_classes: int, input_shape: list[int], hidden: list[int] | None = None) -> MLP:
    return MLP(
        num_classes=num_classes, input_shape=input_shape, hidden=list(hidden) if hidden else [256, 128]
    )

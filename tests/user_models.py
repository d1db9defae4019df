"""A model as a user would write one: no stages(), so model parallelism cannot split it."""

from __future__ import annotations

import math

from torch import nn


def unsplittable(*, num_classes: int, input_shape: list[int]) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))

"""Models as a user would write them: `unsplittable` has no stages(), so model parallelism cannot split
it; `misbehaving` (tests/conf/model/misbehaving.yaml) goes wrong inside its own forward on one rank, as
a user's code can, without any help from ddpexp's fault injection."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

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


def shared_module(*, num_classes: int, input_shape: list[int]) -> nn.Module:
    """Tied's blocks sharing the Linear module itself, not only its weight (a decoder reusing the
    encoder's layer): one module under two paths."""
    model = Tied(num_classes=num_classes, input_shape=input_shape)
    model.again[0] = model.middle[0]
    return model


class Misbehaving(nn.Module):
    """A linear model whose training forward number `at_call` on rank `rank` does `action`: `hang`
    (waits for an event nobody sets, as a deadlock does; first it touches the file $MISBEHAVING_MARK,
    if set, for a test to wait on) or `exit` (os._exit(3), as a C extension that calls exit() does: no
    exception, no Python cleanup)."""

    def __init__(self, *, num_classes: int, input_shape: list[int], rank: int, at_call: int, action: str):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
        self.rank, self.at_call, self.action = rank, at_call, action
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and os.environ.get("RANK") == str(self.rank):
            self.calls += 1
            if self.calls == self.at_call:
                if self.action == "exit":
                    os._exit(3)
                if "MISBEHAVING_MARK" in os.environ:  # a test waits for this moment
                    Path(os.environ["MISBEHAVING_MARK"]).touch()
                threading.Event().wait()
        return self.body(x)


def misbehaving(
    *, num_classes: int, input_shape: list[int], rank: int, at_call: int, action: str
) -> nn.Module:
    return Misbehaving(
        num_classes=num_classes, input_shape=input_shape, rank=rank, at_call=at_call, action=action
    )


class Tower(nn.Module):
    """`depth` equal blocks (linear, BatchNorm, GELU, linear, GELU) between a stem and a head, as a
    transformer stacks its layers: shard_units() names the blocks (what activation checkpointing and
    fsdp take), stages() the stem, the blocks and the head (what ddp_mp and pipeline split)."""

    def __init__(self, *, num_classes: int, input_shape: list[int], width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width))
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(), nn.Linear(width, width), nn.GELU()
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, num_classes)

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def stages(self) -> list[nn.Module]:
        return [self.stem, *self.blocks, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tower(*, num_classes: int, input_shape: list[int], width: int = 64, depth: int = 6) -> nn.Module:
    return Tower(num_classes=num_classes, input_shape=input_shape, width=width, depth=depth)


def small_gpt(*, input_shape: list[int], vocab_size: int) -> nn.Module:
    """A builder of one's own for a language model: takes only what the data gives, so every setting of
    the transformer option it replaces (some of them null) must be dropped."""
    from ddpexp.models.gpt import gpt

    return gpt(input_shape=input_shape, vocab_size=vocab_size, n_layer=1, n_head=2, dim=32)

"""Strategies: one small module per way of spreading training over devices.

Every module exposes the same tiny interface:

- ``USES_PROCESS_GROUP``: whether it runs as one process per rank with torch.distributed;
- ``devices_per_process(cfg) -> int``: how many devices one process drives (the launcher's arithmetic);
- ``check(cfg, host) -> None``: refuse combinations that cannot work (raise UserError), before launch;
- ``wrap(model, *, ctx, cfg) -> Wrapped``: put the model on its device(s) and wrap it.

Adding a strategy = one module here + one YAML in conf/strategy/ + one line in STRATEGIES.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import ModuleType

from torch import nn

from ..errors import UserError

STRATEGIES: dict[str, str] = {
    "single": "ddpexp.strategies.single",
    "ddp": "ddpexp.strategies.ddp",
}


def get(name: str) -> ModuleType:
    if name not in STRATEGIES:
        raise UserError(
            f"unknown strategy {name!r}",
            setting="strategy",
            fix=f"choose one of: {', '.join(STRATEGIES)}",
        )
    return importlib.import_module(STRATEGIES[name])


@dataclass
class Wrapped:
    """What the engine trains, so that it never needs to know which strategy it runs.

    ``module`` is called for training forward passes; ``base`` is the plain model underneath (its
    state_dict is what checkpoints hold, and exact evaluation runs on it, collective-free).
    ``no_sync`` suppresses gradient synchronisation for all but the last micro-batch of an
    accumulated step; ``sync_grads`` runs after the last backward of a step, before the optimizer.
    """

    module: nn.Module
    base: nn.Module
    no_sync: Callable[[], AbstractContextManager[object]] = field(default=nullcontext)
    sync_grads: Callable[[], None] = field(default=lambda: None)

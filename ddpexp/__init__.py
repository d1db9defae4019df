"""ddpexp: config-driven experiments that compare distributed training strategies in PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Result", "UserError", "load_model", "run", "sweep"]

if TYPE_CHECKING:
    from .api import Result, load_model, run, sweep
    from .errors import UserError

# Before anything loads torch, in every way in (the command line, ddpexp.run, the workers' forkserver):
# the one place OpenMP's wait policy is set.
from . import host

host.quiet_waits()


def __getattr__(name: str) -> Any:
    # Lazy: `python -m ddpexp --help` and the worker processes must not pay for importing torch here.
    if name in ("Result", "load_model", "run", "sweep"):
        from . import api

        return getattr(api, name)
    if name == "UserError":
        from .errors import UserError

        return UserError
    raise AttributeError(f"module 'ddpexp' has no attribute {name!r}")

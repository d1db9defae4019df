"""zero: ddp with the optimizer state sharded across ranks (ZeRO stage 1), through torch's
`ZeroRedundancyOptimizer`. DDP all-reduces the full gradients as usual (every ddp setting applies,
strategy.comm_hook included); each rank then steps only the parameters it owns, with the configured
optimizer on its shard of the state (momentum, Adam moments), and broadcasts the updated parameters to
the others. Parameters and gradients stay replicated: only mem/optim_state_mb shrinks, to about 1/W.

Checkpoints hold the full optimizer state, as a plain optimizer's state_dict: every rank sends its
shard to rank 0 (`consolidate_state_dict`, collective), and on resume every rank is given the full
state and keeps its own shard. So a zero checkpoint resumes under ddp or single, and theirs under zero.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..optim import OptimizerSpec
from . import Wrapped, register
from .comm import Collective, Held, Workload, all_parameter_bytes, tensor_bytes, timed_call
from .ddp import Ddp, DdpConfig, ddp_communication, warn_powersgd_restarts

if TYPE_CHECKING:
    import torch


@dataclass
class ZeroConfig(DdpConfig):
    """Every ddp setting applies (the gradients are all-reduced by DDP as usual)."""


@register
class Zero(Ddp):
    """ddp's wrapping and settings; the optimizer and its checkpoint state are ZeRO's."""

    name = "zero"
    schema = ZeroConfig

    def build_optimizer(self, wrapped: Wrapped, make: OptimizerSpec) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # The class and settings optim.* chose, built on this rank's shard of the parameters only.
        params = list(wrapped.base.parameters())
        zero = ZeroRedundancyOptimizer(params, optimizer_class=make.cls, **make.kwargs)
        if wrapped.comm is not None and zero.world_size > 1:
            # step() ends with _sync_params, each owner broadcasting its updated parameters and waiting
            # for all: every parameter it was given once per step, counted like an all-gather's.
            sent = all_parameter_bytes(wrapped.base)
            sync = timed_call(wrapped.comm, zero._sync_params, lambda: sent, "parameters")  # type: ignore[attr-defined]
            zero._sync_params = sync  # type: ignore[attr-defined]
        return zero

    def optimizer_state(self, wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        zero = _zero(optimizer)
        zero.consolidate_state_dict(to=0)  # collective: every rank sends its shard to rank 0
        return zero.state_dict() if zero.rank == 0 else {}  # only rank 0 writes the checkpoint

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        warn_powersgd_restarts(wrapped)
        # ZeroRedundancyOptimizer keeps its own shard of the full state and overwrites the entries of
        # the others' with None: give it a copy, not the checkpoint's dict.
        _zero(optimizer).load_state_dict({**state, "state": dict(state["state"])})

    def held(self, *, job: Workload) -> list[Held]:
        """ddp's, but each rank keeps the optimizer state of its partition only: ZeroRedundancyOptimizer
        hands the parameters out largest first, each to the rank holding the fewest elements so far
        (the lowest such rank on a tie)."""
        sizes, owned = [0] * job.world, [0] * job.world
        for p in sorted(job.model.parameters(), key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += p.numel()
            owned[rank] += tensor_bytes([p]) if p.requires_grad else 0
        return [replace(h, optimized=b) for h, b in zip(super().held(job=job), owned, strict=True)]

    def communication(self, *, job: Workload) -> list[Collective]:
        """ddp's (the metered gradient all-reduce, the same bytes), then ZeroRedundancyOptimizer's
        `_sync_params` after every step: each rank broadcasts the parameters it owns to the others
        (parameter by parameter, asynchronously, waited for at the end of step()), so every parameter
        once, in fp32, from its owner: W broadcasts of about S/W each, after the backward pass, nothing
        to hide behind. Metered as parameters (comm/bytes_per_step/parameters = S)."""
        world = job.world
        if world < 2:
            return ddp_communication(self.settings, job=job)
        everything = float(all_parameter_bytes(job.model))
        sync = Collective(
            "parameter broadcast from each owner after the step",
            "broadcast",
            everything,
            world,
            calls=world,
            counted=everything,
            inter_node=job.spans_nodes(world),
        )
        return [*ddp_communication(self.settings, job=job), sync]


def _zero(optimizer: torch.optim.Optimizer) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError(f"zero checkpoints need its ZeroRedundancyOptimizer, got {type(optimizer).__name__}")
    return optimizer

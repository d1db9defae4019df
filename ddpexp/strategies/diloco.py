"""diloco: DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models"). Every rank trains its own copy with the run's optimizer (the inner optimizer: `optim=adamw`,
as in the paper) for `strategy.sync_every` (H) steps; then every rank computes its pseudo-gradient,
the global parameters at the last synchronisation minus its parameters now, the ranks average it (one
all-reduce), and an outer optimizer steps the global parameters with it: SGD with Nesterov momentum
(`outer_lr` 0.7, `outer_momentum` 0.9, `outer_nesterov`: the paper's). Every rank's copy then becomes
the new global parameters. The inner optimizer's state stays local and carries over from one round to
the next, as in the paper; the outer optimizer's state (its momentum) is the same on every rank.

This is local_sgd's loop (local_sgd.py, `Periodic`) with an outer step where local SGD averages: with
outer_lr 1 and no momentum the outer step lands on the average, so DiLoCo is local SGD (and with H = 1
and SGD as the inner optimizer, ddp, up to float rounding: tested). Like local SGD it costs, per rank,
the global parameters and the outer momentum: two copies of the model beside the trained one, outside
the mem/* counts.

The global parameters are the run's model: what is evaluated, saved in model.pt and checkpoints, and
what a single-process strategy resumes from. Between synchronisations they are those of the last one
(the steps since then are in the ranks' copies only), so the last steps of a run whose step count is
not a multiple of H are not in model.pt. Checkpoints also hold every rank's copy and inner optimizer
state and the outer optimizer's state (so a run resumes bitwise); a changed outer_lr, outer_momentum or
outer_nesterov applies from the resume on.

Streaming (`strategy.fragments` = F > 1, Douillard et al. 2025, "Streaming DiLoCo"): the trained
parameters are cut into F runs of consecutive parameters of about equal bytes, and fragment k has its
outer step after the steps that are (k+1) x H/F mod H: each fragment still synchronises every H steps,
but the fragments take turns, so the bytes of one synchronisation, and the peak bandwidth, are 1/F.
The paper's overlap of a fragment's communication with the next inner steps (and its quantised
pseudo-gradients) is left out: every synchronisation here is a blocking all-reduce, which keeps the
algorithm exact and the DDP reduction testable.

Bytes (`comm/bytes_per_step`, kind gradients: pseudo-gradients) are S/H per step, as local SGD's.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..checkpoint import to_cpu
from ..errors import UserError, require_positive
from . import Wrapped, register
from .comm import Collective, CommMeter, Held, Workload, parameter_bytes
from .local_sgd import (
    LocalSgd,
    LocalSgdConfig,
    Periodic,
    averaged,
    check_sync_every,
    periodic_communication,
    same_start,
    unflatten,
)

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext
    from ..plan import HostFacts, Plan

log = logging.getLogger(__name__)


@dataclass
class DilocoConfig(LocalSgdConfig):
    # Inner steps between two outer steps (H).
    sync_every: int = 50
    # The outer optimizer: SGD on the averaged pseudo-gradient (global parameters at the last
    # synchronisation - parameters now), with this learning rate and momentum, Nesterov's if
    # outer_nesterov (and outer_momentum > 0). outer_lr 1 with no momentum is local SGD.
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    # Streaming DiLoCo: the parameters in this many parts that synchronise in turn, H/fragments steps
    # apart (1: all at once).
    fragments: int = 1


@register
class Diloco(LocalSgd):
    """local_sgd's wrapping, checkpoints and byte accounting; an outer step where it averages."""

    name = "diloco"
    schema = DilocoConfig
    settings: DilocoConfig

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        s = self.settings
        check_sync_every(s.sync_every)
        require_positive({"strategy.outer_lr": s.outer_lr, "strategy.fragments": s.fragments})
        if not 0 <= s.outer_momentum < 1:
            raise UserError(
                f"must be in [0, 1), got {s.outer_momentum}",
                setting="strategy.outer_momentum",
                fix="set strategy.outer_momentum to 0 (none) or e.g. 0.9 (the paper's)",
            )
        if s.fragments > s.sync_every:
            raise UserError(
                f"{s.fragments} fragments cannot take turns within {s.sync_every} steps",
                setting="strategy.fragments",
                fix=f"use strategy.fragments<={s.sync_every}, or a larger strategy.sync_every",
            )
        # One rank is allowed: the outer step on one copy's H-step progress is still DiLoCo (a
        # Lookahead-like slow/fast pair of weights); nothing is sent.

    def check_model(self, model: nn.Module) -> None:
        trained = sum(1 for p in model.parameters() if p.requires_grad)
        if self.settings.fragments > trained:
            raise UserError(
                f"the model has {trained} trained parameter tensors, too few for "
                f"{self.settings.fragments} fragments",
                setting="strategy.fragments",
                fix=f"use strategy.fragments<={trained}",
            )

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = model.to(ctx.device)
        same_start(model)
        meter = CommMeter() if measure_comm else None
        return self.wrapped(model, OuterStep(model, settings=self.settings, meter=meter))

    def held(self, *, job: Workload) -> list[Held]:
        """local_sgd's, and the outer optimizer's momentum: a copy of the trained parameters."""
        momentum = parameter_bytes(job.model) if self.settings.outer_momentum > 0 else 0
        return [dataclasses.replace(h, copies=h.copies + momentum) for h in super().held(job=job)]

    def communication(self, *, job: Workload) -> list[Collective]:
        """local SGD's (S/H bytes per step, one buffer average where the model has floating buffers),
        the pseudo-gradients' all-reduce in F calls of S/F every H steps."""
        s = self.settings
        out = periodic_communication(job, every=s.sync_every, what="pseudo-gradient")
        if out and s.fragments > 1:
            what = (
                f"pseudo-gradient all-reduce, {s.fragments} fragments in turn, "
                f"each every {s.sync_every} step(s)"
            )
            out[0] = dataclasses.replace(out[0], what=what, calls=out[0].calls * s.fragments)
        return out


class OuterStep(Periodic):
    """DiLoCo's synchronisation: `global_params` are the global parameters (those of the last
    synchronisation), stepped by the outer optimizer on the averaged pseudo-gradient."""

    kind: ClassVar[str] = "gradients"

    def __init__(self, model: nn.Module, *, settings: DilocoConfig, meter: CommMeter | None) -> None:
        super().__init__(model, every=settings.sync_every, meter=meter, fragments=settings.fragments)
        self.settings = settings
        self.outer = torch.optim.SGD(self.global_params, **self._hyperparameters())
        self._said_no_outer_step = False

    def _hyperparameters(self) -> dict[str, Any]:
        s = self.settings
        return {
            "lr": s.outer_lr,
            "momentum": s.outer_momentum,
            "nesterov": s.outer_nesterov and s.outer_momentum > 0,
        }

    def refresh(self) -> None:
        """The run's model is the global one, which only an outer step moves: before the first, every
        evaluation scores the starting weights, and the console says why its numbers stand still."""
        first = min(p or self.every for p in self.phases)
        if self.steps < first and not self._said_no_outer_step:
            self._said_no_outer_step = True
            if self.rank == 0:
                log.warning(
                    "diloco: no outer step yet (the first comes after step %d, strategy.sync_every=%d): "
                    "evaluations until then score the starting weights",
                    first,
                    self.every,
                )

    @torch.no_grad()
    def exchange(self, part: list[int]) -> int:
        anchors = [self.global_params[i] for i in part]
        deltas = [a - self.params[i] for a, i in zip(anchors, part, strict=True)]
        flat = averaged(deltas, self.world)
        for anchor, delta in zip(anchors, unflatten(flat, deltas), strict=True):
            anchor.grad = delta
        self.outer.step()  # parameters without a gradient (the other fragments') are left alone
        self.outer.zero_grad(set_to_none=True)
        for anchor, i in zip(anchors, part, strict=True):
            self.params[i].copy_(anchor)
        return flat.numel() * flat.element_size() if self.world > 1 else 0

    def extra_state(self) -> dict[str, Any]:
        return {"outer": to_cpu(self.outer.state_dict())}

    def load_extra_state(self, own: dict[str, Any]) -> None:
        if "outer" not in own:
            return
        self.outer.load_state_dict(own["outer"])
        for group in self.outer.param_groups:  # the settings of this run, not the saved ones
            group.update(self._hyperparameters())

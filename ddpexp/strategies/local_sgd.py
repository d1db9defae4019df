"""local_sgd: every rank trains its own copy of the model, with its own optimizer, on its own shard of
every global batch, and every `strategy.sync_every` (H) optimizer steps the copies are averaged: one
all-reduce of the trained parameters (sum / W) every H steps instead of one of the gradients every
step (local SGD, Stich 2019; post-local SGD, Lin et al. 2020). The optimizer state (momentum, Adam's
moments) stays local: never averaged, never reset. DiLoCo (diloco.py) is this loop with an outer
optimizer at each synchronisation, and shares everything here.

Written out rather than with torch.distributed.algorithms.model_averaging (PeriodicModelAverager,
PostLocalSGDOptimizer), because that averager (1) averages when its own counter is 0 mod H, i.e. after
optimizer steps 1, H+1, 2H+1..., one step off the steps a run and its checkpoints count; (2) averages
parameters only, so BatchNorm statistics would drift apart per rank; (3) re-points every parameter's
`.data` into its flat buffer; and (4) leaves no place to count bytes and time for the CommMeter. What
remains to write is one flat all-reduce (divided by W first, then summed, as DDP's hook does) in a
post-step hook of the optimizer.

When: right after optimizer steps H, 2H, 3H... (counted across epochs and resumes), inside the
optimizer's step, before the learning-rate schedule moves. With H = 1 and SGD (any momentum, any weight
decay: its update is linear in the gradient) this is ddp up to float rounding (tested); Adam-type
optimizers are not linear in the gradient, so for them H = 1 is another algorithm than ddp.

The model a run evaluates, saves (model.pt) and puts in checkpoints is the average of the ranks' copies
now: what a synchronisation now would give (between synchronisations the copies differ). It is computed
into a copy of the model before every evaluation and save (one all-reduce, which is not training
communication and is not metered) and never fed back into training, so evaluating more or less often
changes nothing else. The copy costs one model's parameters per rank, outside the mem/* counts.
Checkpoints also hold every rank's own parameters, buffers and optimizer state, so a run resumes
bitwise; from a checkpoint of another world size or strategy every rank starts from the saved model and
the saved (rank 0's) optimizer state, with a warning.

Floating buffers (BatchNorm statistics) are averaged at each synchronisation too (a second all-reduce,
metered as buffers); integer ones (batch counts) are equal on every rank already.

Bytes (`comm/bytes_per_step`, kind parameters): the flat buffer each rank hands to all-reduce, S (the
trained parameters), once every H steps: S/H per step, counted as naive_allreduce counts a collective.
fp16 is refused in pre-flight (`fp16_conflict`; the engine too, `Wrapped.own_steps`): its loss scaler
may skip a step on one rank alone, and the synchronisations would fall out of step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from .. import distributed
from ..checkpoint import to_cpu
from ..config import StrategyConfig
from ..errors import UserError
from ..optim import OptimizerSpec
from . import FP16_OWN_STEPS, Strategy, Wrapped, register
from .comm import Collective, CommMeter, Held, Workload, all_parameter_bytes, parameter_bytes, tensor_bytes

if TYPE_CHECKING:
    from torch import nn

    from ..context import RunContext
    from ..plan import HostFacts, Plan

log = logging.getLogger(__name__)


@dataclass
class LocalSgdConfig(StrategyConfig):
    # Optimizer steps between two averagings of the parameters (H): 1 averages after every step.
    sync_every: int = 8


@register
class LocalSgd(Strategy[LocalSgdConfig]):
    name = "local_sgd"
    schema = LocalSgdConfig

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        check_sync_every(self.settings.sync_every)
        if plan.world_size < 2:
            raise UserError(
                "local SGD averages the copies of several ranks; with one process there is nothing to "
                "average (it is strategy=single)",
                setting="dist.nprocs",
                fix="use dist.nprocs=2 or more, or strategy=single",
            )

    def fp16_conflict(self, *, world_size: int) -> str | None:
        return FP16_OWN_STEPS

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = model.to(ctx.device)
        same_start(model)
        meter = CommMeter() if measure_comm else None
        return self.wrapped(model, Averaging(model, every=self.settings.sync_every, meter=meter))

    def wrapped(self, model: nn.Module, periodic: Periodic) -> Wrapped:
        return PeriodicWrapped(
            module=model,
            base=model,
            eval_module=periodic.global_model,
            sync_buffers=periodic.refresh,  # the global model, never this rank's copy, is scored and saved
            comm=periodic.meter,
            own_steps=True,
            periodic=periodic,
        )

    def build_optimizer(self, wrapped: Wrapped, make: OptimizerSpec) -> torch.optim.Optimizer:
        optimizer = make(wrapped.base.parameters())
        optimizer.register_step_post_hook(_periodic(wrapped).after_step)
        return optimizer

    def model_state(self, wrapped: Wrapped) -> dict[str, torch.Tensor]:
        periodic = _periodic(wrapped)
        periodic.refresh()
        return periodic.global_model.state_dict()

    def load_model_state(self, wrapped: Wrapped, state: dict[str, torch.Tensor]) -> None:
        _periodic(wrapped).load_model(state)

    def optimizer_state(self, wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _periodic(wrapped).optimizer_state(optimizer, key=self.name)

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        _periodic(wrapped).load_optimizer_state(optimizer, state, key=self.name)

    def held(self, *, job: Workload) -> list[Held]:
        """ddp's, and the global model: one more copy of the parameters on every rank."""
        copies = all_parameter_bytes(job.model)
        return [dataclasses.replace(h, copies=copies) for h in super().held(job=job)]

    def communication(self, *, job: Workload) -> list[Collective]:
        return periodic_communication(job, every=self.settings.sync_every, what="parameter average")


def check_sync_every(every: int) -> None:
    if every < 1:
        raise UserError(
            f"the ranks synchronise every sync_every optimizer steps, which must be 1 or more, got {every}",
            setting="strategy.sync_every",
            fix="set strategy.sync_every to 1 or more (1: every step)",
        )


def periodic_communication(job: Workload, *, every: int, what: str) -> list[Collective]:
    """One all-reduce of the trained parameters' size S every `every` steps (S/every bytes and 1/every
    calls per step, after the optimizer's step: nothing to hide behind), and one of the floating
    buffers where the model has any; nothing with one rank. Counted as the meter counts them."""
    if job.world < 2:
        return []
    spans = job.spans_nodes(job.world)
    sent = parameter_bytes(job.model) / every
    out = [
        Collective(
            f"{what} all-reduce every {every} step(s)",
            "all_reduce",
            sent,
            job.world,
            calls=1 / every,
            counted=sent,
            inter_node=spans,
        )
    ]
    floats = tensor_bytes(b for b in job.model.buffers() if b.is_floating_point()) / every
    if floats:
        what = f"buffer average all-reduce every {every} step(s)"
        out.append(
            Collective(what, "all_reduce", floats, job.world, 1 / every, counted=floats, inter_node=spans)
        )
    return out


def same_start(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers (the seeds agree; this makes it certain)."""
    if distributed.active():
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)


class Periodic:
    """A rank's side of the periodic synchronisation: counts optimizer steps, synchronises the
    parameters after every `every`-th (or, in `fragments` consecutive parts of about equal bytes, each
    part in turn, every/fragments steps apart: streaming DiLoCo), keeps the global model
    (`global_model`: what is evaluated and saved), and this rank's part of checkpoints. Subclasses say
    what a synchronisation does with a part's parameters (`exchange`)."""

    kind: ClassVar[str] = "parameters"  # what the meter counts the parameters' all-reduce as

    def __init__(self, model: nn.Module, *, every: int, meter: CommMeter | None, fragments: int = 1) -> None:
        self.model, self.every, self.meter = model, every, meter
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.floats = [b for b in model.buffers() if b.is_floating_point()]
        self.global_model = copy.deepcopy(model).requires_grad_(False)
        trained = [p.requires_grad for p in model.parameters()]
        self.global_params = [g for g, t in zip(self.global_model.parameters(), trained, strict=True) if t]
        self.parts = split_by_bytes(self.params, fragments)
        # Part k synchronises after the steps that are (k+1) x every/fragments mod every: the last part
        # (all of them, unfragmented) after steps every, 2 x every...
        self.phases = [(k + 1) * every // fragments % every for k in range(fragments)]
        self.world = distributed.world_size()
        self.rank = dist.get_rank() if distributed.active() else 0
        self.cuda = any(p.is_cuda for p in self.params)
        self.steps = 0  # optimizer steps this synchronisation has seen (restored from checkpoints)

    # ----------------------------------------------------------------------------- training

    def after_step(self, *_: Any) -> None:
        """The optimizer's post-step hook: synchronise what is due after this step (metered)."""
        self.steps += 1
        self.stepped()
        phase = self.steps % self.every
        if phase == 0 and self.floats:
            with self._metered("buffers") as sent:
                sent.append(average_in_place(self.floats, self.world))
            with torch.no_grad():
                for g, b in zip(self.global_model.buffers(), self.model.buffers(), strict=True):
                    g.copy_(b)
        for part, due in zip(self.parts, self.phases, strict=True):
            if phase == due:
                with self._metered(self.kind) as sent:
                    sent.append(self.exchange(part))

    def stepped(self) -> None:
        """This rank's copy has moved (before any synchronisation of this step)."""

    def exchange(self, part: list[int]) -> int:
        """Synchronise the parameters of `part` (indices into `params`) on every rank at once; the bytes
        this rank handed to collectives."""
        raise NotImplementedError

    def refresh(self) -> None:
        """Before evaluations and saves, on every rank: make `global_model` the run's model now."""

    def _metered(self, kind: str) -> _Metered:
        return _Metered(self.meter, kind, self.cuda)

    # ----------------------------------------------------------------------------- checkpoints

    @torch.no_grad()
    def load_model(self, state: dict[str, torch.Tensor]) -> None:
        """Every rank loads the saved model into its copy and the global one, and a fresh period
        begins (a checkpoint of this strategy then gives each rank its own copy back:
        load_optimizer_state)."""
        self.model.load_state_dict(state)
        self.global_model.load_state_dict(state)
        self.steps = 0

    def optimizer_state(self, optimizer: torch.optim.Optimizer, *, key: str) -> dict[str, Any]:
        """Rank 0's optimizer state as a plain optimizer's (so any strategy can resume from it), with
        every rank's own copy and optimizer state and the synchronisation's own under `key` (rank 0
        writes the checkpoint: the others return nothing). Collective."""
        mine = {
            "params": [p.detach().cpu().clone() for p in self.params],
            "buffers": [b.cpu().clone() for b in self.model.buffers()],
            "optimizer": to_cpu(optimizer.state_dict()),
        }
        ranks = distributed.gather_to_rank0(mine)
        if ranks is None:
            return {}
        own = {"world_size": self.world, "steps": self.steps, "ranks": ranks, **self.extra_state()}
        return {**ranks[0]["optimizer"], key: own}

    @torch.no_grad()
    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], *, key: str
    ) -> None:
        """After load_model. A checkpoint of this strategy at this world size: every rank gets its own
        copy, optimizer state and place in the period back, bitwise. Otherwise every rank continues
        from the saved model with the saved optimizer state, in a fresh period."""
        own = state.get(key)
        if own is None or own["world_size"] != self.world:
            if own is not None:
                log.warning(
                    "resuming a %s checkpoint of %d ranks on %d: every rank continues from the saved "
                    "model with rank 0's optimizer state, and a new period of %d steps starts (the run "
                    "is not bitwise the uninterrupted one)",
                    key,
                    own["world_size"],
                    self.world,
                    self.every,
                )
                self.load_extra_state(own)
            optimizer.load_state_dict(state)
            return
        mine = own["ranks"][self.rank]
        optimizer.load_state_dict(mine["optimizer"])
        for p, saved in zip(self.params, mine["params"], strict=True):
            p.copy_(saved)
        for b, saved in zip(self.model.buffers(), mine["buffers"], strict=True):
            b.copy_(saved)
        self.steps = int(own["steps"])
        self.load_extra_state(own)
        self.stepped()

    def extra_state(self) -> dict[str, Any]:
        """What a subclass saves of its own (the same on every rank)."""
        return {}

    def load_extra_state(self, own: dict[str, Any]) -> None:
        pass


class Averaging(Periodic):
    """Local SGD: a synchronisation averages the parameters; the global model is their average now."""

    def __init__(self, model: nn.Module, *, every: int, meter: CommMeter | None) -> None:
        super().__init__(model, every=every, meter=meter)
        self.fresh = True  # global_model holds the average of the copies as they are now

    def stepped(self) -> None:
        self.fresh = False

    def exchange(self, part: list[int]) -> int:
        return average_in_place([self.params[i] for i in part], self.world)

    def load_model(self, state: dict[str, torch.Tensor]) -> None:
        super().load_model(state)
        self.fresh = True  # every rank's copy is the saved model, and so is the global one

    @torch.no_grad()
    def refresh(self) -> None:
        """The average of the copies now, into global_model (a collective, unless they are equal: just
        after a synchronisation); training's copies are left as they are."""
        if self.fresh:
            return
        params: list[torch.Tensor] = [p.detach() for p in self.params]
        floats = self.floats
        if self.steps % self.every:
            params = unflatten(averaged(params, self.world), params)
            floats = unflatten(averaged(floats, self.world), floats) if floats else []
        averaged_floats = iter(floats)
        for mine, now in zip(self.global_params, params, strict=True):
            mine.copy_(now)
        for buffer, b in zip(self.global_model.buffers(), self.model.buffers(), strict=True):
            buffer.copy_(next(averaged_floats) if b.is_floating_point() else b)
        self.fresh = True


class _Metered:
    """Times a synchronous collective for the meter, every time (`CommMeter.record_unsampled`: it runs
    every H steps, which sampling one step in k would miss), on CUDA between device synchronisations,
    and counts the bytes appended to the list it gives."""

    def __init__(self, meter: CommMeter | None, kind: str, cuda: bool) -> None:
        self.meter, self.kind, self.cuda = meter, kind, cuda
        self.sent: list[int] = []

    def __enter__(self) -> list[int]:
        if self.meter is not None and self.cuda:
            torch.cuda.synchronize()  # time the collective, not the optimizer's kernels still queued
        self.start = time.perf_counter()
        return self.sent

    def __exit__(self, *exc: object) -> None:
        if self.meter is None or exc[0] is not None or not sum(self.sent):
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.meter.record_unsampled(self.start, time.perf_counter(), sum(self.sent), self.kind)


def averaged(tensors: list[torch.Tensor], world: int) -> torch.Tensor:
    """The tensors' average over the ranks, as one new flat tensor (each divided by W, then summed)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).div_(world)
    if world > 1:
        dist.all_reduce(flat)
    return flat


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]


@torch.no_grad()
def average_in_place(tensors: list[torch.Tensor], world: int) -> int:
    """Average the tensors over the ranks in place, in one all-reduce; the bytes handed to it (none
    with one rank, or nothing to average)."""
    if not tensors or world < 2:
        return 0
    flat = averaged(tensors, world)
    for t, part in zip(tensors, unflatten(flat, tensors), strict=True):
        t.copy_(part)
    return flat.numel() * flat.element_size()


def split_by_bytes(params: Sequence[torch.Tensor], parts: int) -> list[list[int]]:
    """`parts` runs of consecutive indices into `params` (at least as many), none empty, of about
    equal bytes: each parameter goes to the part its middle byte falls in."""
    sizes = [p.numel() * p.element_size() for p in params]
    total = max(sum(sizes), 1)
    out: list[list[int]] = [[] for _ in range(parts)]
    done, k = 0, -1
    for i, size in enumerate(sizes):
        wanted = int((done + size / 2) * parts / total)
        # no part skipped (at most one further), and enough parameters left for the parts after
        k = min(max(wanted, k, parts - (len(sizes) - i)), k + 1, parts - 1)
        out[k].append(i)
        done += size
    return out


@dataclass
class PeriodicWrapped(Wrapped):
    periodic: Periodic | None = None  # this rank's synchronisation, for the optimizer and checkpoints


def _periodic(wrapped: Wrapped) -> Periodic:
    if not isinstance(wrapped, PeriodicWrapped) or wrapped.periodic is None:
        raise TypeError(f"needs the model its own wrap returned, got {type(wrapped).__name__}")
    return wrapped.periodic

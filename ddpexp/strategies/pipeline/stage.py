"""One pipeline stage in a process: its part of the model, the torch.distributed.pipelining schedule
that trains it, evaluation's plain send/recv between stages, its share of checkpoints, and the timer
behind pipe/bubble_frac. strategy=pipeline (this package) and strategy=nd's pp meshes both run their
stages here; see the package's docstring for the layout, the gradient's scaling and what is measured."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ... import distributed
from ...checkpoint import to_cpu
from ...models.moe import unrecorded_routing
from ..comm import CommMeter
from ..ddp_mp import group, model_stages
from ..fsdp import full_model_state, full_optimizer_state, load_full_model_state, load_full_optimizer_state

if TYPE_CHECKING:
    from ...context import RunContext
    from ...tasks import Loss


# The member name is what Hydra matches (strategy.schedule=1f1b), so the functional form.
Schedule = StrEnum(
    "Schedule",
    [
        ("gpipe", "gpipe"),
        ("1f1b", "1f1b"),
        ("interleaved_1f1b", "interleaved_1f1b"),
        ("interleaved_zero_bubble", "interleaved_zero_bubble"),
        ("zbv", "zbv"),
        ("dualpipev", "dualpipev"),
    ],
)
# Schedules that run several stages on each rank (torch's PipelineScheduleMulti), and of those the
# ones whose stages fold back in a V (rank r holds stages r and 2p - 1 - r) and need exactly two.
MULTI = frozenset(Schedule(n) for n in ("interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"))
V_SHAPED = frozenset(Schedule(n) for n in ("zbv", "dualpipev"))


def stages_per_rank(schedule: Schedule, asked: int | None) -> int:
    """The stages each rank runs: what strategy.stages_per_rank asks, else 1 for the single-stage
    schedules and 2 for the others."""
    if asked is not None:
        return asked
    return 2 if schedule in MULTI else 1


def stage_ranks(schedule: Schedule, ranks: int, per_rank: int) -> list[int]:
    """The pipeline rank running each of the ranks x per_rank stages: in a loop (stage s on rank s mod
    p), or in a V (down the ranks, then back up), as torch's generate_stage_to_rank_mapping places them."""
    if schedule not in V_SHAPED:
        return [s % ranks for s in range(ranks * per_rank)]
    return [s % ranks if (s // ranks) % 2 == 0 else ranks - 1 - s % ranks for s in range(ranks * per_rank)]


def bubble_textbook(schedule: Schedule, *, ranks: int, microbatches: int, per_rank: int) -> float:
    """The idle share of a rank's step the schedule's paper gives, for p ranks, m micro-batches and v
    stages per rank, assuming equal stages, free communication and a backward split into an input and
    a weight part each as long as the forward (the zero-bubble papers' F = B = W):
    GPipe and 1F1B (p - 1) / (m + p - 1); interleaved 1F1B (p - 1) / (v m + p - 1) (Megatron-LM's
    bubble shrunk v-fold); interleaved zero bubble, ZB-H1 with v stages per rank, whose weight
    backwards fill two thirds of 1F1B's bubble: (p - 1) / (3 v m + p - 1); ZB-V and DualPipeV 0 (both
    papers' schedules are bubble-free when F = B = W)."""
    p, m, v = ranks, microbatches, per_rank
    if p == 1 or schedule in V_SHAPED:
        return 0.0
    if schedule == Schedule("interleaved_zero_bubble"):
        return (p - 1) / (3 * v * m + p - 1)
    if schedule == Schedule("interleaved_1f1b"):
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def in_flight(
    schedule: Schedule, *, ranks: int, microbatches: int, per_rank: int, rank: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each stage on pipeline rank `rank` (in order), after each of its computations: (micro-batches
    whose activations it holds for their backward, micro-batches whose weight gradients it has
    computed after an input backward). GPipe holds all m at once (every forward before any backward),
    1F1B those of its warm-up, min(m, p - rank); the multi-stage schedules as torch orders the rank's
    actions (its pipeline_order, made with stand-ins for the stages): a forward adds its micro-batch
    to the stage, a full backward takes it off, an input backward keeps it (the weights' gradient
    needs it), and a weight backward moves it to the second count: what a split backward leaves
    (memory.Run.kept) stays until the step ends. The rank's peak is the point that weighs most."""
    p, m = ranks, microbatches
    if schedule not in MULTI:
        return (((m if schedule == Schedule("gpipe") else min(m, p - rank), 0),),)
    mine = stages_of(schedule, p, per_rank, rank)
    live, done = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0)
    points = []
    for kind, stage in _actions(schedule, p, m, per_rank, rank):
        if kind == "F":
            live[stage] += 1
        elif kind in ("B", "W"):
            live[stage] -= 1
            done[stage] += kind == "W"
        points.append(tuple((live[s], done[s]) for s in mine))
    return tuple(dict.fromkeys(points))


def splits_backward(schedule: Schedule) -> bool:
    """Whether the schedule splits backwards into the inputs' and the weights' gradients."""
    return schedule in (Schedule("interleaved_zero_bubble"), Schedule("zbv"), Schedule("dualpipev"))


def stages_of(schedule: Schedule, ranks: int, per_rank: int, rank: int) -> list[int]:
    """The stages pipeline rank `rank` runs."""
    return [s for s, owner in enumerate(stage_ranks(schedule, ranks, per_rank)) if owner == rank]


@functools.cache
def _actions(
    schedule: Schedule, ranks: int, microbatches: int, per_rank: int, rank: int
) -> list[tuple[str, int]]:
    """(F | I | W | B, stage) of each computation torch's schedule runs on `rank`, in order."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    count = ranks * per_rank
    stand_ins = [
        SimpleNamespace(
            num_stages=count,
            group_size=ranks,
            group_rank=rank,
            stage_index=index,
            is_first=index == 0,
            is_last=index == count - 1,
            submod=nn.Identity(),
            stage_index_to_group_rank=None,
        )
        for index in stages_of(schedule, ranks, per_rank, rank)
    ]
    made = getattr(schedules, _SCHEDULE_CLASSES[schedule])(stand_ins, microbatches, loss_fn=_no_loss)
    out: list[tuple[str, int]] = []
    for action in made.pipeline_order[rank]:
        if action is None:
            continue
        for one in action.sub_actions or (action,):
            out.append((one.computation_type.value, one.stage_index))
    return out


def _no_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return outputs


@dataclass(frozen=True)
class StageLayout:
    """Where one rank sits in its pipeline: its place `stage` of `stages` ranks, the global rank of each
    place (whom evaluation's activations go to), its pipeline's process group (None: the world is the
    pipeline), the group of the same place in every replica whose gradients the runner averages (None:
    no replicas, or the parts' own FSDP reduces them), that group's source rank, and whether this
    rank's copy of its parts is the one checkpoints hold (one rank per place)."""

    stage: int
    stages: int
    ranks: tuple[int, ...]
    pipe_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    dp_root: int = 0
    owner: bool = True


class StageRunner(nn.Module):
    """This rank's parts of the model and everything it needs to run them: its place in the layout, the
    process groups, the pipelining schedule for training, and its forward for evaluation (which sends
    the activations on and returns the outputs on the rank of the last stage, None elsewhere).

    The model's stages() are grouped into stages x per_rank parts, placed on the ranks as the schedule
    places them (`stage_ranks`); `part` is this rank's part, or its parts in a ModuleList (`parts`).
    `prepare` parallelises each part further before the schedule takes it (strategy=nd: tensor
    parallelism and FSDP on the stage's own sub-mesh); its parameters may then be DTensors, which the
    checkpoint methods gather whole. `local_norm` is the parts' gradient norm (default: plain tensors')."""

    def __init__(
        self,
        model: nn.Module,
        layout: StageLayout,
        microbatches: int,
        schedule: Schedule,
        *,
        ctx: RunContext,
        per_rank: int = 1,
        prepare: Callable[[nn.Module], None] | None = None,
        local_norm: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.stage, self.stages, self.microbatches = layout.stage, layout.stages, microbatches
        self.schedule_name, self.per_rank = schedule, per_rank
        self.device = ctx.device
        self.local_norm = local_norm or torch.nn.utils.get_total_norm

        self.owner_of = stage_ranks(schedule, self.stages, per_rank)
        count = len(self.owner_of)
        self.mine = [index for index, owner in enumerate(self.owner_of) if owner == self.stage]
        self.is_first, self.is_last = 0 in self.mine, count - 1 in self.mine
        all_parts = group(model_stages(model), count)
        self.parts = [all_parts[index].to(self.device) for index in self.mine]
        for index, other in enumerate(all_parts):
            if index not in self.mine:
                other.to("meta")  # the other stages' weights live on other ranks
        if prepare is not None:
            for part in self.parts:
                prepare(part)
        self.part: nn.Module = self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)
        self.sharded = any(_is_dtensor(p) for p in self.part.parameters())
        self.order, self.names, self.param_index = _naming(model, self.part)
        self._broadcast_from_replica0([*self.part.parameters(), *self.part.buffers()])

        self.timer = StageTimer(self.device)
        self.scale = 1.0
        self.losses: list[torch.Tensor] = []
        self.task_loss: Loss | None = None  # the step's: train_step's argument
        from torch.distributed.pipelining import schedules

        stage_class = timed_stage_class()
        self.senders = [
            stage_class(part, index, count, self.device, group=layout.pipe_group, timer=self.timer)
            for part, index in zip(self.parts, self.mine, strict=True)
        ]
        kind = getattr(schedules, _SCHEDULE_CLASSES[schedule])
        # scale_grads=False: scaling is in the loss (see the package docstring).
        taken: Any = self.senders if schedule in MULTI else self.senders[0]
        self.schedule = kind(taken, microbatches, loss_fn=self._loss, scale_grads=False)

    def meter_sends(self, meter: CommMeter | None) -> None:
        """Count what this rank's stages send to other ranks in `meter` (kind activations)."""
        for sender in self.senders:
            sender.meter = meter

    # ------------------------------------------------------------------------- checkpoints
    # The whole model's state, gathered on rank 0 under the model's own names, from the rank of each
    # stage that owns its part. Every rank calls them: gathering a sharded part is collective too.

    def model_state(self) -> dict[str, torch.Tensor]:
        local = full_model_state(self.part, on_every_rank=True) if self.sharded else self.part.state_dict()
        mine = {full: local[key].detach().cpu() for key, full in self.names} if self.layout.owner else {}
        merged: dict[str, torch.Tensor] = {}
        for part in distributed.gather_to_rank0(mine) or []:
            merged.update(part)
        return {name: merged[name] for name in self.order if name in merged}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        mine = {key: state[full] for key, full in self.names if full in state}
        if self.sharded:
            load_full_model_state(self.part, mine)
        else:
            self.part.load_state_dict(mine, strict=False)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The state a plain optimizer over the whole model would hold: entries and param_groups
        numbered in model.parameters() order (as every other strategy's checkpoint numbers them)."""
        sharded = self.sharded
        local = (
            full_optimizer_state(self.part, optimizer, on_every_rank=True)
            if sharded
            else optimizer.state_dict()
        )
        index = self.param_index
        mine: dict[str, Any] = {}
        if self.layout.owner:
            mine = {
                "state": {index[i]: to_cpu(value) for i, value in local["state"].items()},
                "param_groups": [
                    {**g, "params": [index[i] for i in g["params"]]} for g in local["param_groups"]
                ],
            }
        parts = [p for p in distributed.gather_to_rank0(mine) or [] if p]
        if not parts:
            return {}
        groups = [dict(g) for g in parts[0]["param_groups"]]
        for part in parts[1:]:
            for merged, theirs in zip(groups, part["param_groups"], strict=True):
                merged["params"] = merged["params"] + theirs["params"]
        for merged in groups:
            merged["params"] = sorted(merged["params"])
        state = {k: v for part in parts for k, v in part["state"].items()}
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        local_of = {g: i for i, g in enumerate(self.param_index)}
        groups = []
        for g in state["param_groups"]:
            params = [local_of[p] for p in g["params"] if p in local_of]
            if params:
                groups.append({**g, "params": params})
        entries = {local_of[p]: value for p, value in state["state"].items() if p in local_of}
        mine = {"state": entries, "param_groups": groups}
        if self.sharded:
            load_full_optimizer_state(self.part, optimizer, mine)
        else:
            optimizer.load_state_dict(mine)

    # ------------------------------------------------------------------------- training

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn: the task's mean loss of one micro-batch, kept for reporting, and
        backpropagated scaled so that the step's gradient is that of the per-rank batch's mean loss
        (x 1/accumulate)."""
        assert self.task_loss is not None, "only train_step runs the schedule"
        with self.timer.compute():
            loss = self.task_loss(outputs, targets)
        self.losses.append(loss.detach())
        return loss * (self.scale / self.microbatches)

    def train_step(self, inputs: Any, targets: torch.Tensor, scale: float, loss: Loss) -> torch.Tensor | None:
        self.scale, self.task_loss = scale, loss
        self.losses.clear()
        args = (inputs.to(self.device, non_blocking=True),) if self.is_first else ()
        target = targets.to(self.device, non_blocking=True) if self.is_last else None
        with self.timer.step():
            if self.is_last:
                self.schedule.step(*args, target=target, return_outputs=False)
            else:
                self.schedule.step(*args, return_outputs=False)
        if not self.is_last:
            return None
        # The first step also called the loss once to infer the gradients' shapes: the last m count.
        return torch.stack(self.losses[-self.microbatches :]).mean()

    def average_grads(self, meter: CommMeter | None) -> None:
        """With replicas: average this stage's gradients over its data-parallel group, once per
        optimizer step (after every backward of the step, accumulated ones included)."""
        if self.layout.dp_group is None:
            return
        params = [p for p in self.part.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every replica reduces the same buffer
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        start = time.perf_counter()
        dist.all_reduce(flat, group=self.layout.dp_group)
        if meter is not None:
            if flat.is_cuda and meter.timing:
                torch.cuda.synchronize(flat.device)
            meter.record(start, time.perf_counter(), flat.numel() * flat.element_size())
        flat.div_(dist.get_world_size(self.layout.dp_group))
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The whole model's gradient norm (trainer.clip_grad_norm): the stages' squared norms summed
        over the pipeline (after average_grads, every replica's are the same)."""
        grads = [p.grad for p in params if p.grad is not None]
        local = self.local_norm(grads) if grads else torch.zeros((), device=self.device)
        squared = local.double().pow(2)
        dist.all_reduce(squared, group=self.layout.pipe_group)
        return squared.sqrt().to(local.dtype)

    def sync_buffers(self) -> None:
        """A stage's buffers are its own; with replicas, replica 0's copy is the one every replica holds."""
        self._broadcast_from_replica0(list(self.part.buffers()))

    def _broadcast_from_replica0(self, tensors: list[torch.Tensor]) -> None:
        if self.layout.dp_group is None or not tensors:
            return
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, src=self.layout.dp_root, group=self.layout.dp_group)

    def bubble_metrics(self) -> dict[str, float]:
        """The epoch's measured bubble, averaged over the ranks that timed a step, and the textbook one."""
        compute_s, step_s = self.timer.take()
        mine = [1.0 - compute_s / step_s, 1.0] if step_s > 0 else [0.0, 0.0]
        totals = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        frac_sum, ranks = totals.tolist()
        textbook = bubble_textbook(
            self.schedule_name, ranks=self.stages, microbatches=self.microbatches, per_rank=self.per_rank
        )
        out = {"pipe/bubble_frac_textbook": textbook}
        if ranks:
            out["pipe/bubble_frac"] = max(frac_sum / ranks, 0.0)
        return out

    # ------------------------------------------------------------------------- evaluation

    def forward(self, inputs: Any) -> torch.Tensor | None:
        """One eval batch through the pipeline: each of this rank's stages in turn receives the previous
        stage's activations (the first stage: the batch; a stage on this rank: its output), runs its
        part, and sends the result on where the next stage is another rank's; only the rank of the
        last stage returns it."""
        x: torch.Tensor | None = None
        for index, part in zip(self.mine, self.parts, strict=True):
            if index == 0:
                x = inputs.to(self.device, non_blocking=True)
            elif self.owner_of[index - 1] != self.stage:
                x = _recv(self.layout.ranks[self.owner_of[index - 1]], self.device)
            x = part(x)
            if index == len(self.owner_of) - 1:
                return x
            if self.owner_of[index + 1] != self.stage:
                assert x is not None
                _send(x, self.layout.ranks[self.owner_of[index + 1]])
        return None


_SCHEDULE_CLASSES = {
    Schedule("gpipe"): "ScheduleGPipe",
    Schedule("1f1b"): "Schedule1F1B",
    Schedule("interleaved_1f1b"): "ScheduleInterleaved1F1B",
    Schedule("interleaved_zero_bubble"): "ScheduleInterleavedZeroBubble",
    Schedule("zbv"): "ScheduleZBVZeroBubble",
    Schedule("dualpipev"): "ScheduleDualPipeV",
}


@functools.cache
def timed_stage_class() -> type:
    """TimedStage, made on first use: torch.distributed.pipelining takes about 1.3 s to import (it
    pulls in torch._dynamo and DTensor), which every process of every run would otherwise pay at
    start-up, since the strategy registry imports this module whatever the strategy."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage that adds the time of its forward and backward computations to `timer`, and
        the bytes it sends to its neighbours (activations forward, their gradients backward) to
        `meter`, where there is one."""

        def __init__(self, *args: Any, timer: StageTimer, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.timer = timer
            self.meter: CommMeter | None = None

        def get_fwd_send_ops(self, *args: Any, **kwargs: Any) -> Any:
            return self._counted(super().get_fwd_send_ops(*args, **kwargs))

        def get_bwd_send_ops(self, *args: Any, **kwargs: Any) -> Any:
            return self._counted(super().get_bwd_send_ops(*args, **kwargs))

        def _counted(self, ops: list[Any]) -> list[Any]:
            if self.meter is not None:
                sent = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                self.meter.count(sent, "activations")
            return ops

        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            # The first step runs each stage once on uninitialised inputs to learn the shapes: not a
            # forward of the training, so a mixture of experts does not count its routing.
            with unrecorded_routing():
                return super()._forward_metadata_inference(*args, **kwargs)

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with self.timer.compute():
                return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with self.timer.compute():
                return super().backward_one_chunk(*args, **kwargs)

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with self.timer.compute():  # the zero-bubble schedules' deferred weight gradients
                return super().backward_weight_one_chunk(*args, **kwargs)

    return TimedStage


class StageTimer:
    """Compute time and step time of one stage, from the second step on (the first infers shapes).
    CPU: wall clock around each computation. CUDA: events on the current stream, read once per epoch,
    so a wait for a neighbour's tensor shows as a gap between computations, as on the CPU."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self.clock = clock
        self.steps_seen = 0
        self._compute: list[tuple[Any, Any]] = []
        self._steps: list[tuple[Any, Any]] = []
        self._measuring = False

    def _now(self) -> Any:
        if not self.cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def compute(self) -> _Span:
        return _Span(self, self._compute if self._measuring else None)

    def step(self) -> _Span:
        self._measuring = self.steps_seen > 0
        self.steps_seen += 1
        return _Span(self, self._steps if self._measuring else None)

    def take(self) -> tuple[float, float]:
        """(compute seconds, step seconds) since the last call."""
        if self.cuda and self._steps:
            torch.cuda.synchronize()

        def total(spans: list[tuple[Any, Any]]) -> float:
            if self.cuda:
                return sum(a.elapsed_time(b) for a, b in spans) / 1000.0
            return float(sum(b - a for a, b in spans))

        compute_s, step_s = total(self._compute), total(self._steps)
        self._compute, self._steps = [], []
        return compute_s, step_s


class _Span:
    def __init__(self, timer: StageTimer, into: list[tuple[Any, Any]] | None) -> None:
        self.timer, self.into = timer, into
        self.start: Any = None

    def __enter__(self) -> None:
        if self.into is not None:
            self.start = self.timer._now()

    def __exit__(self, *exc: object) -> None:
        if self.into is not None:
            self.into.append((self.start, self.timer._now()))


# --------------------------------------------------------------------------- helpers


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _naming(model: nn.Module, part: nn.Module) -> tuple[list[str], list[tuple[str, str]], list[int]]:
    """(the model's state_dict names in order; (part's key, model's name) for every name of the
    model whose tensor the part holds: a tied tensor under each of its names, as the model's own
    state_dict() has it; for each of the part's parameters, its number in model.parameters())."""
    full = model.state_dict(keep_vars=True)
    key_of: dict[int, str] = {}
    for key, tensor in part.state_dict(keep_vars=True).items():
        key_of.setdefault(id(tensor), key)
    names = [(key_of[id(t)], name) for name, t in full.items() if id(t) in key_of]
    number = {id(p): i for i, p in enumerate(model.parameters())}
    return list(full), names, [number[id(p)] for p in part.parameters()]


# Activations between stages during evaluation: a header (dtype, rank, shape), then the tensor.
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
_MAX_DIMS = 8


def _send(t: torch.Tensor, dst: int) -> None:
    if t.dim() > _MAX_DIMS:
        raise RuntimeError(f"pipeline evaluation sends at most {_MAX_DIMS}-D activations, got {t.dim()}-D")
    header = [_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())]
    dist.send(torch.tensor(header, dtype=torch.int64, device=t.device), dst)
    dist.send(t.contiguous(), dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src)
    code, dims, *shape = header.tolist()
    t = torch.empty(shape[:dims], dtype=_DTYPES[code], device=device)
    dist.recv(t, src)
    return t

"""pipeline: pipeline parallelism across processes. The model's `stages()` are grouped into
strategy.stages consecutive parts (ddp_mp's grouping, balanced by parameter count); each process
owns one part, and every per-rank batch is cut into strategy.microbatches micro-batches that flow
through the parts with torch.distributed.pipelining's GPipe (all forwards, then all backwards) or
1F1B (one forward, one backward in the steady state: at most `stages` micro-batches' activations
alive per stage) schedule. strategy.replicas copies of the whole pipeline train data-parallel.

Rank layout: rank = replica x stages + stage (world size = stages x replicas). Process groups, made
by every rank in the same order: one pipeline group per replica (its stages, which pass activations
and their gradients point to point) and, with replicas > 1, one data-parallel group per stage (that
stage in every replica, which averages its gradients after the step's last backward). Every stage of
a replica reads the same data shard (Strategy.data_layout): the first stage uses the inputs, the
last the targets, so the global batch splits over `replicas` shards.

The gradient is the full-batch mean loss's: each micro-batch's mean loss is backpropagated times
scale / microbatches (scale = 1/trainer.accumulate), and the schedule's own division by the number of
micro-batches is off, because it divides every gradient the parameters hold, those accumulated by
earlier micro-batches of an accumulated step included.

Evaluation runs through the pipeline, forward only, with plain send/recv of each batch's activations
(the eval batches' sizes vary, the schedule's buffers do not); the last stage returns the outputs and
scores them, every sample once. Each rank holds only its part: the rest of the model lives on the
meta device. Checkpoints and model.pt hold the whole model, gathered on rank 0 under the model's own
names, and the optimizer state as a plain optimizer over the whole model numbers it.

pipe/bubble_frac is measured: per rank, 1 - (time in its part's forward, backward and loss) / (time
in the schedule's step), i.e. the share of the step spent waiting for activations or gradients (and
in the schedule's bookkeeping), averaged over ranks; the first step (metadata inference) is left out.
pipe/bubble_frac_textbook is (p - 1) / (m + p - 1) for p stages and m micro-batches, which assumes
equal stages and free communication.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed
from ..checkpoint import to_cpu
from ..config import StrategyConfig
from ..errors import UserError, require_positive
from ..optim import OptimizerSpec
from . import FP16_OWN_STEP, ReportColumn, Strategy, Wrapped, register
from .comm import Collective, CommMeter, Held, Workload
from .ddp_mp import boundary_bytes, group, model_stages, refuse_ties_across
from .fsdp import full_model_state, full_optimizer_state, load_full_model_state, load_full_optimizer_state

if TYPE_CHECKING:
    from ..context import RunContext
    from ..plan import HostFacts, Plan
    from ..tasks import Loss

# The member name is what Hydra matches (strategy.schedule=1f1b), so the functional form.
Schedule = StrEnum("Schedule", [("gpipe", "gpipe"), ("1f1b", "1f1b")])


@dataclass
class PipelineConfig(StrategyConfig):
    # Processes in one pipeline: the model's stages() are grouped into this many consecutive parts.
    stages: int = 2
    # gpipe: every micro-batch's forward, then every backward | 1f1b: alternate once the pipe is full
    # (fewer activations alive; needs microbatches >= stages).
    schedule: Schedule = Schedule.gpipe
    # Micro-batches each per-rank batch is cut into (it must divide the per-rank batch).
    microbatches: int = 4
    # Data-parallel copies of the whole pipeline: world size = stages x replicas.
    replicas: int = 1


@register
class Pipeline(Strategy[PipelineConfig]):
    name = "pipeline"
    schema = PipelineConfig
    report_columns = (
        ReportColumn("bubble: measured/textbook", ("pipe/bubble_frac", "pipe/bubble_frac_textbook")),
    )

    def default_nprocs(self, *, device_type: str, host: HostFacts, devices_per_process: int) -> int:
        _require_positive(self.settings)
        return self.settings.stages * self.settings.replicas

    def data_layout(self, *, world_size: int) -> list[int]:
        """Every stage of replica r reads shard r. A world that is not stages x replicas has no layout."""
        _require_positive(self.settings)
        wanted = self.settings.stages * self.settings.replicas
        if world_size != wanted:
            raise UserError(
                f"{world_size} processes for {self.settings.stages} stages x {self.settings.replicas} "
                f"replica(s) = {wanted}",
                setting="dist.nprocs",
                fix=f"drop dist.nprocs (pipeline starts {wanted}), or set dist.nprocs={wanted}; "
                "or change strategy.stages / strategy.replicas",
            )
        return [rank // self.settings.stages for rank in range(world_size)]

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        check_microbatches(plan, self.settings.microbatches, self.settings.schedule, self.settings.stages)

    def check_model(self, model: nn.Module) -> None:
        check_stages(model, self.settings.stages, setting="strategy.stages")

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        s = self.settings
        runner = StageRunner(model, layout_of(s, ctx.rank), s.microbatches, s.schedule, ctx=ctx)
        meter = CommMeter() if measure_comm else None
        runner.meter_sends(meter)
        return Wrapped(
            module=runner,
            base=model,
            eval_module=runner,
            train_step=runner.train_step,
            sync_grads=lambda: runner.average_grads(meter),
            sync_buffers=runner.sync_buffers,
            comm=meter,
            extra_metrics=runner.bubble_metrics,
            grad_norm=runner.grad_norm,
        )

    def build_optimizer(self, wrapped: Wrapped, make: OptimizerSpec) -> torch.optim.Optimizer:
        return make(_runner(wrapped).part.parameters())  # this stage's parameters only

    # ------------------------------------------------------------------------- cost model

    def fp16_conflict(self, *, world_size: int) -> str | None:
        return FP16_OWN_STEP

    def compute_share(self, *, job: Workload) -> float:
        """Each stage computes 1/p of its replica's batch (1/replicas of the global batch), in m
        micro-batches, and the schedule takes m + p - 1 micro-batch slots (forward, then backward): the
        textbook bubble (p - 1)/(m + p - 1) of idle slots. Assumes equal stages."""
        p, m = self.settings.stages, self.settings.microbatches
        replicas = _replicas(self.settings, job.world)
        return schedule_slots(m, p) / (p * replicas)

    def held(self, *, job: Workload) -> list[Held]:
        """Each rank its stage's part of the model (rank = replica x stages + stage), `stage_held`."""
        s = self.settings
        parts = group(model_stages(job.model), s.stages)
        samples = job.global_batch / s.replicas / job.accumulate / s.microbatches
        return [
            stage_held(
                parts, rank % s.stages, samples=samples, microbatches=s.microbatches, schedule=s.schedule
            )
            for rank in range(job.world)
        ]

    def communication(self, *, job: Workload) -> list[Collective]:
        """Activations forward and their gradients backward across the widest stage boundary, one
        transfer per micro-batch slot of the schedule: 2(m + p - 1) on the critical path, each waited
        for before the stage computes (no overlap credited); counted as the meter counts them: each
        stage sends m micro-batches' over each of its boundaries, 2m times the boundaries' bytes over
        p ranks on average. With replicas, each stage's gradient all-reduced over its replicas after
        the step, all stages at once (the largest bounds the time), counted as the meter counts it:
        every rank its stage's bytes, S/p on average."""
        p, m = self.settings.stages, self.settings.microbatches
        replicas = _replicas(self.settings, job.world)
        parts = group(model_stages(job.model), p)
        micro = job.global_batch / job.accumulate / replicas / m
        sizes = boundary_bytes(parts, job, micro)
        slots = 2 * (m + p - 1) * job.accumulate
        what = "activations and their gradients between stages, per micro-batch slot"
        if not sizes:
            what += "; their size unknown: latency only"
        out = [
            Collective(
                what,
                "sendrecv",
                float(slots * max(sizes, default=0)),
                2,
                slots,
                counted=2 * m * job.accumulate * sum(sizes) / p,
                inter_node=job.spans_nodes(p),
                timed=False,
            )
        ]
        if replicas > 1:
            stage_bytes = [sum(q.numel() * q.element_size() for q in part.parameters()) for part in parts]
            out.append(
                Collective(
                    "each stage's gradient all-reduce over the replicas, after the step",
                    "all_reduce",
                    float(max(stage_bytes)),
                    replicas,
                    counted=sum(stage_bytes) / p,
                    inter_node=job.nodes > 1,
                )
            )
        return out

    # ------------------------------------------------------------------------- checkpoints

    def model_state(self, wrapped: Wrapped) -> dict[str, torch.Tensor]:
        return _runner(wrapped).model_state()

    def load_model_state(self, wrapped: Wrapped, state: dict[str, torch.Tensor]) -> None:
        _runner(wrapped).load_model_state(state)

    def optimizer_state(self, wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _runner(wrapped).optimizer_state(optimizer)

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        _runner(wrapped).load_optimizer_state(optimizer, state)


def schedule_slots(microbatches: int, stages: int) -> float:
    """The micro-batch slots a schedule of m micro-batches over p stages takes, per micro-batch:
    (m + p - 1) / m, the textbook bubble (forward, then backward) on top of the work."""
    return (microbatches + stages - 1) / microbatches


def stage_held(
    parts: list[nn.Module], stage: int, *, samples: float, microbatches: int, schedule: Schedule
) -> Held:
    """What the rank running `stage` of `parts` holds and computes: its part's parameters, and the
    activations of the micro-batches its schedule keeps in flight: GPipe all of them (every forward
    before any backward), 1F1B those of its warm-up, min(m, stages - stage)."""
    in_flight = microbatches if schedule == Schedule("gpipe") else min(microbatches, len(parts) - stage)
    last = stage == len(parts) - 1
    return Held.replica(
        parts[stage], samples, chain=tuple(parts[: stage + 1]), in_flight=in_flight, loss=last
    )


def check_microbatches(plan: Plan, micro: int, schedule: Schedule, stages: int) -> None:
    """Refuse micro-batches that do not split the per-rank batch, or too few for 1F1B."""
    batch = plan.per_rank_batch
    if batch % micro:
        divisor = max(d for d in range(1, micro + 1) if batch % d == 0)
        per_batch = plan.global_batch // batch  # replicas x accumulated micro-batches
        raise UserError(
            f"the per-rank batch {batch} does not split into {micro} micro-batches",
            setting="strategy.microbatches",
            fix=f"use strategy.microbatches={divisor} (a divisor of {batch}), or "
            f"trainer.batch_size={_round_up(plan.global_batch, micro * per_batch)}",
        )
    if schedule == Schedule("1f1b") and micro < stages:
        raise UserError(
            f"1F1B needs at least as many micro-batches as stages ({stages}), got {micro}",
            setting="strategy.microbatches",
            fix=f"use strategy.microbatches>={stages}, or strategy.schedule=gpipe",
        )


def check_stages(model: nn.Module, count: int, *, setting: str) -> None:
    """Refuse a model that does not split into `count` stages covering every layer, or with a weight
    tied across two of them (`setting`: the degree that asks for the stages)."""
    stages = model_stages(model)
    if len(stages) < count:
        raise UserError(
            f"{type(model).__name__} splits into at most {len(stages)} stages, not {count}",
            setting=setting,
            fix=f"use {setting}<={len(stages)}",
        )
    outside = _outside_stages(model, stages)
    if outside:
        raise UserError(
            f"{type(model).__name__}'s stages() leave out {', '.join(outside[:3])}"
            + (f" (and {len(outside) - 3} more)" if len(outside) > 3 else "")
            + ": no stage would train or save them",
            setting="strategy",
            fix="make stages() cover every layer of the model, or use strategy=ddp",
        )
    refuse_ties_across(model, group(stages, count))


def _replicas(settings: PipelineConfig, world: int) -> int:
    """The replicas `world` processes make of `stages`-stage pipelines (a whole number, or a refusal)."""
    if world % settings.stages:
        raise UserError(
            f"{world} processes do not make whole pipelines of {settings.stages} stages",
            setting="devices",
            fix=f"use a multiple of strategy.stages={settings.stages}",
        )
    return world // settings.stages


@dataclass(frozen=True)
class StageLayout:
    """Where one rank's stage sits: its stage of `stages`, the global ranks it receives activations from
    and sends them to, its pipeline's process group (None: the world is the pipeline), the group of
    the same stage in every replica whose gradients the runner averages (None: no replicas, or the
    part's own FSDP reduces them), that group's source rank, and whether this rank's copy of its part
    is the one checkpoints hold (one rank per stage)."""

    stage: int
    stages: int
    prev: int
    next: int
    pipe_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    dp_root: int = 0
    owner: bool = True


def layout_of(settings: PipelineConfig, rank: int) -> StageLayout:
    """strategy=pipeline's layout: rank = replica x stages + stage (see the module docstring)."""
    stages, replicas = settings.stages, settings.replicas
    stage, replica = rank % stages, rank // stages
    pipe_group, dp_group = _make_groups(stages, replicas, stage=stage, replica=replica)
    return StageLayout(stage, stages, rank - 1, rank + 1, pipe_group, dp_group, stage, replica == 0)


class StageRunner(nn.Module):
    """This rank's part of the model and everything it needs to run it: its place in the layout, the
    process groups, the pipelining schedule for training, and its forward for evaluation (which sends
    the activations on and returns the outputs on the last stage, None elsewhere).

    `prepare` parallelises the part further before the schedule takes it (strategy=nd: tensor
    parallelism and FSDP on the stage's own sub-mesh); its parameters may then be DTensors, which the
    checkpoint methods gather whole. `local_norm` is the part's gradient norm (default: plain tensors')."""

    def __init__(
        self,
        model: nn.Module,
        layout: StageLayout,
        microbatches: int,
        schedule: Schedule,
        *,
        ctx: RunContext,
        prepare: Callable[[nn.Module], None] | None = None,
        local_norm: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.stage, self.stages, self.microbatches = layout.stage, layout.stages, microbatches
        self.device = ctx.device
        self.is_first, self.is_last = self.stage == 0, self.stage == self.stages - 1
        self.local_norm = local_norm or torch.nn.utils.get_total_norm

        parts = group(model_stages(model), self.stages)
        self.part = parts[self.stage].to(self.device)
        for index, other in enumerate(parts):
            if index != self.stage:
                other.to("meta")  # the other stages' weights live on other ranks
        if prepare is not None:
            prepare(self.part)
        self.sharded = any(_is_dtensor(p) for p in self.part.parameters())
        self.order, self.names, self.param_index = _naming(model, self.part)
        self._broadcast_from_replica0([*self.part.parameters(), *self.part.buffers()])

        self.timer = StageTimer(self.device)
        self.scale = 1.0
        self.losses: list[torch.Tensor] = []
        self.task_loss: Loss | None = None  # the step's: train_step's argument
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        self.sender = timed_stage_class()(
            self.part, self.stage, self.stages, self.device, group=self.layout.pipe_group, timer=self.timer
        )
        kind = ScheduleGPipe if schedule == Schedule("gpipe") else Schedule1F1B
        # scale_grads=False: scaling is in the loss (see the module docstring).
        self.schedule = kind(self.sender, microbatches, loss_fn=self._loss, scale_grads=False)

    def meter_sends(self, meter: CommMeter | None) -> None:
        """Count what this stage sends to its neighbours in `meter` (kind activations)."""
        self.sender.meter = meter

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
        p, m = self.stages, self.microbatches
        out = {"pipe/bubble_frac_textbook": (p - 1) / (m + p - 1)}
        if ranks:
            out["pipe/bubble_frac"] = max(frac_sum / ranks, 0.0)
        return out

    # ------------------------------------------------------------------------- evaluation

    def forward(self, inputs: Any) -> torch.Tensor | None:
        """One eval batch through the pipeline: receive the previous stage's activations (the first
        stage: the batch), run this part, send the result on; only the last stage returns it."""
        x = (
            inputs.to(self.device, non_blocking=True)
            if self.is_first
            else _recv(self.layout.prev, self.device)
        )
        out: torch.Tensor = self.part(x)
        if self.is_last:
            return out
        _send(out, self.layout.next)
        return None


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

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with self.timer.compute():
                return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with self.timer.compute():
                return super().backward_one_chunk(*args, **kwargs)

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


def _require_positive(settings: PipelineConfig) -> None:
    require_positive(
        {
            "strategy.stages": settings.stages,
            "strategy.microbatches": settings.microbatches,
            "strategy.replicas": settings.replicas,
        }
    )


def _round_up(n: int, m: int) -> int:
    return ((n + m - 1) // m) * m


def _runner(wrapped: Wrapped) -> StageRunner:
    runner = wrapped.eval_module
    if not isinstance(runner, StageRunner):
        raise TypeError(f"pipeline checkpoints need its StageRunner, got {type(runner).__name__}")
    return runner


def _make_groups(
    stages: int, replicas: int, *, stage: int, replica: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's pipeline group, its data-parallel group). new_group is collective over the whole
    world: every rank makes every group, in the same order. One replica: the pipeline is the world."""
    if replicas == 1:
        return None, None
    pipes = [dist.new_group([r * stages + s for s in range(stages)]) for r in range(replicas)]
    data = [dist.new_group([r * stages + s for r in range(replicas)]) for s in range(stages)]
    return cast("dist.ProcessGroup", pipes[replica]), cast("dist.ProcessGroup", data[stage])


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


def _outside_stages(model: nn.Module, stages: list[nn.Module]) -> list[str]:
    """The model's tensors that no stage holds."""
    inside = {id(t) for s in stages for t in s.state_dict(keep_vars=True).values()}
    return [name for name, t in model.state_dict(keep_vars=True).items() if id(t) not in inside]


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

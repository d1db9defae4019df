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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ...config import StrategyConfig
from ...errors import UserError, require_positive
from ...optim import OptimizerSpec
from .. import FP16_OWN_STEP, ReportColumn, Strategy, Wrapped, register
from ..comm import Collective, CommMeter, Held, Workload
from ..ddp_mp import boundary_bytes, group, model_stages, refuse_ties_across
from .stage import (
    MULTI,
    V_SHAPED,
    Schedule,
    StageLayout,
    StageRunner,
    bubble_textbook,
    in_flight,
    splits_backward,
    stage_ranks,
    stages_of,
    stages_per_rank,
)

if TYPE_CHECKING:
    from ...context import RunContext
    from ...plan import HostFacts, Plan


@dataclass
class PipelineConfig(StrategyConfig):
    # Processes in one pipeline: the model's stages() are grouped into this many consecutive parts.
    stages: int = 2
    # gpipe: every micro-batch's forward, then every backward | 1f1b: alternate once the pipe is full
    # (fewer activations alive; needs microbatches >= stages) | interleaved_1f1b: 1F1B over several
    # stages per rank in a loop (a smaller bubble) | interleaved_zero_bubble: that, with each backward
    # split into the inputs' and the weights' gradients, the latter filling the bubble | zbv, dualpipev:
    # two stages per rank in a V, zero-bubble (ZB-V) or DeepSeek's DualPipeV.
    schedule: Schedule = Schedule.gpipe
    # Stages each rank runs (the model is cut into stages x stages_per_rank parts); null: 1 for gpipe
    # and 1f1b, 2 for the others (zbv and dualpipev need exactly 2).
    stages_per_rank: int | None = None
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
        s = self.settings
        check_schedule(s.schedule, s.stages_per_rank, checkpointing=plan.activation_checkpointing)
        check_microbatches(plan, s.microbatches, s.schedule, s.stages, s.stages_per_rank)

    def check_model(self, model: nn.Module) -> None:
        s = self.settings
        per_rank = stages_per_rank(s.schedule, s.stages_per_rank)
        check_stages(model, s.stages * per_rank, setting="strategy.stages", per_rank=per_rank)

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        s = self.settings
        per_rank = stages_per_rank(s.schedule, s.stages_per_rank)
        layout = layout_of(s, ctx.rank)
        runner = StageRunner(model, layout, s.microbatches, s.schedule, ctx=ctx, per_rank=per_rank)
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
        s = self.settings
        replicas = _replicas(s, job.world)
        slots = schedule_slots(s.microbatches, s.stages, s.schedule, s.stages_per_rank)
        return slots / (s.stages * replicas)

    def held(self, *, job: Workload) -> list[Held]:
        """Each rank its stage's part of the model (rank = replica x stages + stage), `stage_held`."""
        s = self.settings
        samples = job.global_batch / s.replicas / job.accumulate / s.microbatches
        pipe = Pipe(s.schedule, s.stages, s.microbatches, stages_per_rank(s.schedule, s.stages_per_rank))
        parts = group(model_stages(job.model), pipe.count)
        return [stage_held(parts, pipe, rank % s.stages, samples=samples) for rank in range(job.world)]

    def communication(self, *, job: Workload) -> list[Collective]:
        """Activations forward and their gradients backward across the widest stage boundary, one
        transfer per micro-batch slot of the schedule: 2(m + p - 1) on the critical path, each waited
        for before the stage computes (no overlap credited); counted as the meter counts them: each
        stage sends m micro-batches' over each of its boundaries, 2m times the boundaries' bytes over
        p ranks on average. With replicas, each stage's gradient all-reduced over its replicas after
        the step, all stages at once (the largest bounds the time), counted as the meter counts it:
        every rank its stage's bytes, S/p on average."""
        s = self.settings
        p, m = s.stages, s.microbatches
        replicas = _replicas(s, job.world)
        pipe = Pipe(s.schedule, p, m, stages_per_rank(s.schedule, s.stages_per_rank))
        parts = group(model_stages(job.model), pipe.count)
        micro = job.global_batch / job.accumulate / replicas / m
        sizes = pipe.crossing(boundary_bytes(parts, job, micro))
        slots = 2 * (m * pipe.per_rank + p - 1) * job.accumulate
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


GPIPE = Schedule("gpipe")


@dataclass(frozen=True)
class Pipe:
    """A pipeline's shape: its schedule over `ranks` ranks of m micro-batches, `per_rank` stages each."""

    schedule: Schedule
    ranks: int
    microbatches: int
    per_rank: int = 1

    @property
    def count(self) -> int:
        """The model's parts: ranks x per_rank stages."""
        return self.ranks * self.per_rank

    def mine(self, rank: int) -> list[int]:
        """The stages pipeline rank `rank` runs."""
        return stages_of(self.schedule, self.ranks, self.per_rank, rank)

    def crossing(self, sizes: list[int]) -> list[int]:
        """The bytes of each stage boundary (one per pair of consecutive stages) that crosses ranks: a V
        schedule's turn, stage p - 1 to p on the last rank, hands its activations on in place."""
        owner = stage_ranks(self.schedule, self.ranks, self.per_rank)
        return [size for index, size in enumerate(sizes) if owner[index] != owner[index + 1]]


def schedule_slots(
    microbatches: int, stages: int, schedule: Schedule = GPIPE, per_rank: int | None = None
) -> float:
    """The micro-batch slots a schedule's step takes per micro-batch of work: 1 / (1 - its textbook
    bubble), (m + p - 1) / m for GPipe and 1F1B (`bubble_textbook`)."""
    v = stages_per_rank(schedule, per_rank)
    return 1.0 / (1.0 - bubble_textbook(schedule, ranks=stages, microbatches=microbatches, per_rank=v))


def stage_held(parts: list[nn.Module], pipe: Pipe, rank: int, *, samples: float) -> Held:
    """What pipeline rank `rank` holds and computes: its stages' parts' parameters, and the activations
    of the micro-batches its schedule keeps in flight on each of them (`in_flight`: at the point of
    its step where they weigh most); a stage after the first it runs is an `extra` of the first's."""
    timeline = in_flight(
        pipe.schedule, ranks=pipe.ranks, microbatches=pipe.microbatches, per_rank=pipe.per_rank, rank=rank
    )
    slots = schedule_slots(pipe.microbatches, pipe.ranks, pipe.schedule, pipe.per_rank)
    mine = pipe.mine(rank)
    peak = tuple(max(counts[i][0] for counts in timeline) for i in range(len(mine)))
    split = splits_backward(pipe.schedule)
    each = [
        Held.replica(
            parts[index],
            samples,
            chain=tuple(parts[: index + 1]),
            in_flight=count,
            loss=index == len(parts) - 1,
            slots=slots,
            split_backward=split,
        )
        for index, count in zip(mine, peak, strict=True)
    ]
    if len(each) == 1:
        return each[0]
    first = each[0]
    return Held.replica(
        nn.ModuleList([parts[index] for index in mine]),
        samples,
        chain=first.chain,
        in_flight=first.in_flight,
        loss=first.loss,
        slots=slots,
        extra=tuple(each[1:]),
        timeline=timeline,
        split_backward=split,
    )


def check_schedule(schedule: Schedule, per_rank: int | None, *, checkpointing: str) -> None:
    """Refuse stages per rank the schedule cannot run (fewer than 1; other than 2 for a V schedule; more
    than 1 for GPipe and 1F1B, which run one stage a rank), and selective activation checkpointing
    under a schedule that splits backwards: torch allows one backward through a selectively
    checkpointed block, and the split runs two (the inputs', then the weights')."""
    if splits_backward(schedule) and checkpointing.startswith("selective"):
        raise UserError(
            f"{schedule} splits each backward in two (the inputs' gradients, then the weights'), and "
            f"torch's selective checkpointing lets a block be backpropagated once",
            setting="trainer.activation_checkpointing",
            fix="use trainer.activation_checkpointing=full (or none), or strategy.schedule=interleaved_1f1b",
        )
    if per_rank is None:
        return
    if per_rank < 1:
        raise UserError(
            f"strategy.stages_per_rank={per_rank}: a rank runs at least one stage",
            setting="strategy.stages_per_rank",
            fix="use strategy.stages_per_rank>=1, or drop it",
        )
    if schedule in V_SHAPED and per_rank != 2:
        raise UserError(
            f"{schedule} runs exactly 2 stages per rank (a V), not {per_rank}",
            setting="strategy.stages_per_rank",
            fix="drop strategy.stages_per_rank, or use strategy.schedule=interleaved_1f1b for other counts",
        )
    if schedule not in MULTI and per_rank != 1:
        raise UserError(
            f"{schedule} runs one stage per rank, not {per_rank}",
            setting="strategy.stages_per_rank",
            fix="use strategy.schedule=interleaved_1f1b or interleaved_zero_bubble for several stages a rank",
        )


def check_microbatches(
    plan: Plan, micro: int, schedule: Schedule, stages: int, per_rank: int | None = None
) -> None:
    """Refuse micro-batches that do not split the per-rank batch, or too few for the schedule."""
    batch = plan.per_rank_batch
    require_positive({"strategy.microbatches": micro})
    if batch % micro:
        divisor = max(d for d in range(1, micro + 1) if batch % d == 0)
        per_batch = plan.global_batch // batch  # replicas x accumulated micro-batches
        raise UserError(
            f"the per-rank batch {batch} does not split into {micro} micro-batches",
            setting="strategy.microbatches",
            fix=f"use strategy.microbatches={divisor} (a divisor of {batch}), or "
            f"trainer.batch_size={_round_up(plan.global_batch, micro * per_batch)}",
        )
    least = {Schedule("1f1b"): stages, Schedule("dualpipev"): 2 * stages}.get(schedule, 0)
    if micro < least:
        name, what = ("1F1B", "stages") if least == stages else ("DualPipeV", f"stages ({stages} ranks x 2)")
        raise UserError(
            f"{name} needs at least as many micro-batches as {what} ({least}), got {micro}",
            setting="strategy.microbatches",
            fix=f"use strategy.microbatches>={least}, or strategy.schedule=gpipe",
        )
    if schedule in (Schedule("interleaved_1f1b"), Schedule("interleaved_zero_bubble")):
        rounds = max(1, micro // stages)
        if micro % rounds:
            nearest = _round_up(micro, stages)
            raise UserError(
                f"{schedule} runs micro-batches in rounds of {stages} (the ranks): {micro} is not a "
                f"multiple of its {rounds} rounds",
                setting="strategy.microbatches",
                fix=f"use strategy.microbatches={nearest} (a multiple of the {stages} ranks), "
                f"or at most {stages}",
            )


def check_stages(model: nn.Module, count: int, *, setting: str, per_rank: int = 1) -> None:
    """Refuse a model that does not split into `count` stages covering every layer, or with a weight
    tied across two of them (`setting`: the degree that asks for the stages; `per_rank` stages each)."""
    stages = model_stages(model)
    if len(stages) < count:
        each = f" x {per_rank} per rank" if per_rank > 1 else ""
        raise UserError(
            f"{type(model).__name__} splits into at most {len(stages)} stages, not {count // per_rank}{each}",
            setting=setting,
            fix=f"use {setting}<={max(len(stages) // per_rank, 1)}"
            + (", or fewer strategy.stages_per_rank" if per_rank > 1 else ""),
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
    refuse_ties_across(model, group(stages, count), setting)


def _replicas(settings: PipelineConfig, world: int) -> int:
    """The replicas `world` processes make of `stages`-stage pipelines (a whole number, or a refusal)."""
    if world % settings.stages:
        raise UserError(
            f"{world} processes do not make whole pipelines of {settings.stages} stages",
            setting="devices",
            fix=f"use a multiple of strategy.stages={settings.stages}",
        )
    return world // settings.stages


def layout_of(settings: PipelineConfig, rank: int) -> StageLayout:
    """strategy=pipeline's layout: rank = replica x stages + stage (see the module docstring)."""
    stages, replicas = settings.stages, settings.replicas
    stage, replica = rank % stages, rank // stages
    pipe_group, dp_group = _make_groups(stages, replicas, stage=stage, replica=replica)
    ranks = tuple(replica * stages + s for s in range(stages))
    return StageLayout(stage, stages, ranks, pipe_group, dp_group, stage, replica == 0)


# --------------------------------------------------------------------------- helpers


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


def _outside_stages(model: nn.Module, stages: list[nn.Module]) -> list[str]:
    """The model's tensors that no stage holds."""
    inside = {id(t) for s in stages for t in s.state_dict(keep_vars=True).values()}
    return [name for name, t in model.state_dict(keep_vars=True).items() if id(t) not in inside]

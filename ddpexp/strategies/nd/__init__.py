"""nd: data, tensor, context and pipeline parallelism composed on one device mesh.

The degrees (strategy.dp_replicate, dp_shard, cp, tp, pp; one of them may be -1, the rest of the world)
make one `DeviceMesh` (init_device_mesh, dims pp x dp_replicate x dp_shard x cp x tp, see degrees.py),
built once per worker; each parallelism works on its sub-mesh. Applied in torchtitan's order:

1. pipeline split (pp > 1): this rank keeps its stage's part of the model (the pipeline strategy's grouping);
2. tensor parallelism (tp > 1): the model's own plan (`parallel_plan()`), parallelize_module on the
   tp mesh; sequence_parallel=true keeps the activations between blocks split along the sequence;
3. activation checkpointing: trainer.activation_checkpointing, applied before any strategy (it swaps
   the blocks' classes and keeps their names, so the plan still finds every module);
4. compile (trainer.compile): each block compiled in place (`nn.Module.compile`, per block, as
   torchtitan does), called after wrap: compilation happens at a block's first call, so each graph
   is the block as tensor parallelism and checkpointing made it, with FSDP's hooks around it, the
   same thing torchtitan's call between the two yields;
5. data parallelism (dp_replicate x dp_shard x cp > 1): FSDP2 (fully_shard) over the data-parallel
   mesh, each of the model's shard units, then the root; with dp_replicate > 1 HSDP, the 2-D mesh:
   parameters sharded within a group of dp_shard x cp ranks, gradients all-reduced across the groups;
   offload=true keeps the shards, their gradients and the optimizer state in host memory (fsdp's).
6. context parallelism (cp > 1): each training step and evaluation forward runs with this rank's part
   of every sequence, attention as a ring (context_parallel.py).

Why one new strategy rather than today's strategies as presets of the degrees: each of those has its
own code path, measured tables and parity tests, which a rewrite under new degrees would all put at
risk for no gain to their users; nd is what composes. nd with dp_shard=W alone is fsdp's layout, and
with tp=1 and pp=1 it runs the same fully_shard calls.

Ranks that differ only in tp, cp (and pp) read the same data shard (`data_layout`): the global batch
splits over dp_replicate x dp_shard. Evaluation: every rank runs the forward (it is collective), the tp
and cp rank 0 of each data shard scores it, so every eval token counts once.

Checkpoints and model.pt hold the full, unsharded state (fsdp's full-state helpers gather the
DTensors of any mesh), so a run resumes under single, under another mesh, or under any strategy.

Bytes (`comm/bytes_per_step`): FSDP's all-gathers and reduce-scatters as fsdp counts them (and HSDP's
all-reduce of each shard's gradient across the groups, counted by its size), and tensor parallelism's
collectives (kind tensor_parallel: tensor_parallel.CollectiveCounter), and context parallelism's ring
(kind context_parallel, the same counter). `communication` declares them all for ddpexp-predict, from
the same plan on the meta device.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ... import activation_checkpointing, float8
from ...config import Precision, StrategyConfig
from ...errors import UserError
from ...models.moe import unrecorded_routing
from ...optim import OptimizerSpec
from .. import FP16_OWN_STEP, Strategy, Wrapped, register
from ..comm import Collective, CommMeter, Held, Overlap, Workload, sequence_part
from ..ddp_mp import boundary_bytes, group, model_stages
from ..fsdp import (
    MixedPrecision,
    Precisions,
    ReduceDtype,
    chunk_len,
    float8_scale_traffic,
    full_model_state,
    full_optimizer_state,
    gathered_bytes,
    gathered_sizes,
    load_full_model_state,
    load_full_optimizer_state,
    metered_collectives,
    no_grad_sync,
    offload_policy,
    offload_traffic,
    precisions,
    shard_of,
    sharded_traffic,
    unit_params,
    unit_shards,
    units_and_ties,
)
from ..pipeline import (
    Pipe,
    check_microbatches,
    check_schedule,
    check_stages,
    schedule_slots,
    stage_held,
)
from ..pipeline.stage import Schedule, StageLayout, StageRunner, stages_per_rank
from . import context_parallel, expert_parallel, tensor_parallel
from .degrees import NAMES, Degrees, resolve

if TYPE_CHECKING:
    from ...context import RunContext
    from ...plan import HostFacts, Plan
    from ...tasks import Loss

log = logging.getLogger(__name__)


@dataclass
class NdConfig(StrategyConfig):
    # Data-parallel groups, gradients all-reduced across them (HSDP's replicas; 1: none).
    dp_replicate: int = 1
    # Ranks each group shards the parameters, gradients and optimizer state over (FSDP2); -1: the rest.
    dp_shard: int = -1
    # Tensor-parallel ranks: each layer split over them by the model's parallel_plan().
    tp: int = 1
    # Pipeline stages.
    pp: int = 1
    # Context-parallel ranks: each holds 1/cp of every sequence, attention exchanging keys and values
    # around them (the sequence must split into 2 x cp chunks).
    cp: int = 1
    # Expert-parallel ranks (a mixture of experts): each dp_shard group splits into groups of ep ranks
    # over which every MoE layer's experts are spread, tokens sent to them by all-to-all.
    ep: int = 1
    # With tp > 1: activations between blocks (and the norms) split along the sequence over the tp ranks.
    sequence_parallel: bool = False
    # With tp > 1: the head's logits stay split by vocabulary and the cross-entropy reduces over the tp
    # ranks (torch's loss_parallel), instead of every tp rank gathering the whole logits.
    loss_parallel: bool = False
    # FSDP: free gathered parameters after each unit's forward (gathered again for backward). With
    # pp > 1 parameters stay gathered until the step's last micro-batch's backward, whatever this says.
    reshard_after_forward: bool = True
    # pp > 1: micro-batches each per-rank batch is cut into, their schedule (gpipe | 1f1b |
    # interleaved_1f1b | interleaved_zero_bubble | zbv | dualpipev: strategy=pipeline's) and the stages
    # each pp rank runs (null: the schedule's, 1 or 2).
    microbatches: int = 4
    schedule: Schedule = Schedule.gpipe
    stages_per_rank: int | None = None
    # With dp > 1, the dtype FSDP gathers parameters and computes in (null: trainer.precision's, so bf16
    # training gathers bf16 and does not autocast; fp32: as stored) and reduces gradients in: fsdp's.
    mixed_precision: MixedPrecision | None = None
    reduce_dtype: ReduceDtype = ReduceDtype.fp32
    # With dp > 1: FSDP's shards, their gradients and the optimizer state in host memory, the optimizer
    # stepping there (fsdp's offload).
    offload: bool = False


@register
class Nd(Strategy[NdConfig]):
    name = "nd"
    schema = NdConfig

    def precisions(self, degrees: Degrees, precision: str) -> Precisions:
        """FSDP's mixed-precision policy over the data-parallel ranks; none without them (tensor and
        pipeline parallelism alone train under the engine's autocast)."""
        if degrees.fsdp == 1:
            return Precisions(None, None)
        return precisions(self.settings.mixed_precision, self.settings.reduce_dtype, precision)

    def degrees(self, world: int) -> Degrees:
        s = self.settings
        given = {"pp": s.pp, "dp_replicate": s.dp_replicate, "dp_shard": s.dp_shard, "cp": s.cp, "tp": s.tp}
        degrees = resolve(given, world)
        expert_parallel.check(ep=s.ep, dp_shard=degrees.dp_shard)
        return degrees

    # ------------------------------------------------------------------------- launch and layout

    def default_nprocs(self, *, device_type: str, host: HostFacts, devices_per_process: int) -> int:
        """The product of the degrees; with one of them -1, the most whole multiples of the others'
        product the host's default (its GPUs; 2 on a CPU) holds, at least one (dp_shard -1 with
        expert parallelism: a multiple of ep, which splits it)."""
        s = self.settings
        given = (s.pp, s.dp_replicate, s.dp_shard, s.cp, s.tp)
        if any(g == 0 or g < -1 for g in given):
            return 1  # check() names the bad degree
        fixed = math.prod(g for g in given if g != -1)
        if -1 not in given:
            return fixed
        if s.dp_shard == -1 and s.ep > 1:
            fixed *= s.ep
        default = super().default_nprocs(
            device_type=device_type, host=host, devices_per_process=devices_per_process
        )
        return fixed * max(default // fixed, 1)

    def data_layout(self, *, world_size: int) -> list[int]:
        degrees = self.degrees(world_size)
        return [degrees.data_shard(rank) for rank in range(world_size)]

    # ------------------------------------------------------------------------- before launch

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        degrees = self.degrees(plan.world_size)
        if degrees.pp > 1:
            s = self.settings
            checkpointing = plan.activation_checkpointing
            check_schedule(s.schedule, s.stages_per_rank, checkpointing=checkpointing)
            check_microbatches(plan, s.microbatches, s.schedule, degrees.pp, s.stages_per_rank)
        if self.settings.offload and degrees.fsdp == 1:
            raise UserError(
                f"offload moves FSDP's shards to host memory, and this mesh ({degrees.describe()}) has no "
                "data-parallel ranks to shard over",
                setting="strategy.offload",
                fix="give the mesh data-parallel ranks (strategy.dp_shard=-1), or drop strategy.offload",
            )
        for setting in ("sequence_parallel", "loss_parallel"):
            if getattr(self.settings, setting) and degrees.tp == 1:
                log.warning("strategy.%s=true with tp=1 splits nothing: it changes nothing", setting)

    def check_model(self, model: nn.Module) -> None:
        if self.settings.pp > 1:
            per_rank = self._pipe(self.settings.pp).per_rank
            check_stages(model, self.settings.pp * per_rank, setting="strategy.pp", per_rank=per_rank)
        if self.settings.tp > 1:  # a model without a plan (or one without loss_parallel) is refused
            self._plan(model, self.settings.tp)
        config = getattr(model, "config", None)
        length = getattr(config, "block_size", None)  # the data's, unless set longer (checked again)
        context_parallel.check(model, cp=self.settings.cp, length=length)
        expert_parallel.check_model(model, self.settings.ep, self.settings.cp)

    # ------------------------------------------------------------------------- in each worker

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        from torch.distributed.device_mesh import init_device_mesh

        degrees = self.degrees(ctx.world_size)
        ep = self.settings.ep
        if ep > 1:  # dp_shard as (dp_shard / ep) x ep: the same ranks, an ep group inside each shard group
            i = NAMES.index("dp_shard")
            shape = (*degrees.shape[:i], degrees.dp_shard // ep, ep, *degrees.shape[i + 1 :])
            names = (*NAMES[:i], "dp_shard_out", "ep", *NAMES[i + 1 :])
            mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
            mesh["dp_shard_out", "ep"]._flatten("dp_shard")
            expert_replicas = mesh["dp_replicate", "dp_shard_out"]._flatten("expert_replicas")
        else:
            mesh = init_device_mesh(ctx.device.type, degrees.shape, mesh_dim_names=NAMES)
        at = degrees.coordinates(ctx.rank)
        plan = self._plan(model, degrees.tp)
        shard = "dp_shard"
        if degrees.cp > 1:  # the cp ranks hold the same parameters: FSDP shards over them too
            shard = "dp_shard_cp"
            mesh["dp_shard", "cp"]._flatten(shard)
        dp_mesh = mesh["dp_replicate", shard] if degrees.dp_replicate > 1 else mesh[shard]
        # With stages, FSDP keeps the gathered parameters for all micro-batches (torchtitan's default).
        reshard = self.settings.reshard_after_forward and degrees.pp == 1
        mixed = self.precisions(degrees, ctx.plan.precision)
        policy: dict[str, Any] = {"mp_policy": mixed.policy()} if mixed.param is not None else {}
        if self.settings.offload:
            policy["offload_policy"] = offload_policy(ctx.device)

        def ignored(module: nn.Module) -> set[nn.Parameter] | None:
            """Split experts are expert parallelism's to reduce, not FSDP's."""
            return (expert_parallel.expert_params(module) or None) if ep > 1 else None

        def parallelise(part: nn.Module) -> None:
            """Tensor parallelism, then FSDP, on the modules of `part` (the whole model, or a stage)."""
            inside = {id(m) for m in part.modules()}
            if plan:
                mine = {
                    path: style for path, style in plan.items() if id(model.get_submodule(path)) in inside
                }
                tensor_parallel.apply(model, mesh["tp"], mine)
            if ep > 1:
                expert_parallel.split(part, mesh)
            if degrees.fsdp > 1:
                from torch.distributed.fsdp import fully_shard

                for unit in units_and_ties(model)[0]:
                    if id(unit) in inside:
                        experts = ignored(unit)
                        fully_shard(
                            unit,
                            mesh=dp_mesh,
                            reshard_after_forward=reshard,
                            ignored_params=experts,
                            **policy,
                        )
                fully_shard(
                    part, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored(part), **policy
                )

        meter = CommMeter() if measure_comm else None
        stage: StageRunner | None = None
        if degrees.pp > 1:
            stride = degrees.world // degrees.pp  # the same place in the next stage's sub-mesh
            layout = StageLayout(
                stage=at["pp"],
                stages=degrees.pp,
                ranks=tuple(ctx.rank + (place - at["pp"]) * stride for place in range(degrees.pp)),
                pipe_group=mesh["pp"].get_group(),
                owner=at["dp_replicate"] == at["dp_shard"] == at["cp"] == at["tp"] == 0,
            )
            s = self.settings
            stage = StageRunner(
                model,
                layout,
                s.microbatches,
                s.schedule,
                ctx=ctx,
                per_rank=self._pipe(degrees.pp).per_rank,
                prepare=parallelise,
                local_norm=_norm,
            )
            trained: nn.Module = stage
        else:
            model = model.to(ctx.device)
            parallelise(model)
            trained = model
        no_sync: Any = contextlib.nullcontext
        if degrees.fsdp > 1:
            roots: list[Any] = [trained] if stage is None else stage.parts
            no_sync = lambda: _no_grad_sync(roots)  # noqa: E731
            if meter is not None:
                meter = _fsdp_meter(trained if stage is None else stage.part, hsdp=degrees.dp_replicate > 1)
        if stage is not None:
            stage.meter_sends(meter)
        expert_sync = None
        if ep > 1:
            expert_parallel.route(model, mesh["ep"], meter)
            replicas = expert_replicas.get_group() if expert_replicas.size() > 1 else None
            expert_sync = expert_parallel.sync_expert_grads(
                trained if stage is None else stage, replicas, degrees.dp, meter
            )
        # Every cp rank's loss is its part's mean (their mean the whole's); one scores evaluation.
        scores = at["tp"] == 0 and (stage is None or stage.is_last)
        loss_parallel = degrees.tp > 1 and self.settings.loss_parallel
        shards = context_parallel.SequenceShards(mesh["cp"], model) if degrees.cp > 1 else None
        counter = None
        if meter is not None and (degrees.tp > 1 or shards is not None):
            kinds = {str(mesh["cp"].get_group().group_name): context_parallel.KIND} if shards else {}
            counter = tensor_parallel.CollectiveCounter(meter, kinds)
        runner = _Runner(
            trained,
            scores=scores,
            evaluates=scores and at["cp"] == 0,
            meter=meter,
            counter=counter,
            stage=stage,
            loss_parallel=loss_parallel,
            shards=shards,
            expert_sync=expert_sync,
        )
        own_step = degrees.tp > 1 or stage is not None or shards is not None
        return Wrapped(
            module=trained,
            base=model,
            no_sync=no_sync,
            sync_grads=runner.sync_grads,
            eval_module=runner,
            comm=meter,
            collective_eval=True,
            train_step=runner.train_step if own_step else None,
            grad_norm=_grad_norm if stage is None else stage.grad_norm,
            extra_metrics=None if stage is None else stage.bubble_metrics,
            sync_buffers=None if stage is None else _stage_buffers(stage.part, degrees, at["pp"]),
            autocast=mixed.autocast,
        )

    def build_optimizer(self, wrapped: Wrapped, make: OptimizerSpec) -> torch.optim.Optimizer:
        return make(wrapped.module.parameters())  # a stage's: its part's only

    def compile(self, wrapped: Wrapped) -> None:
        """Each of this rank's blocks compiled in place, as torchtitan compiles (the rest runs eager; a
        stage without blocks, all of it); a model that declares no blocks, whole. See the module's
        docstring for where this sits."""
        blocks = activation_checkpointing.declared_blocks(wrapped.base)  # outermost: none compiled twice
        if not blocks:
            super().compile(wrapped)
            return
        mine = {id(m) for m in wrapped.module.modules()}
        for block in blocks:
            if id(block) in mine:
                block.compile()

    # ------------------------------------------------------------------------- checkpoints

    def model_state(self, wrapped: Wrapped) -> dict[str, torch.Tensor]:
        if isinstance(wrapped.module, StageRunner):
            return wrapped.module.model_state()
        return full_model_state(wrapped.base)

    def load_model_state(self, wrapped: Wrapped, state: dict[str, torch.Tensor]) -> None:
        if isinstance(wrapped.module, StageRunner):
            wrapped.module.load_model_state(state)
        else:
            load_full_model_state(wrapped.base, state)

    def optimizer_state(self, wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(wrapped.module, StageRunner):
            return wrapped.module.optimizer_state(optimizer)
        return full_optimizer_state(wrapped.base, optimizer)

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        if isinstance(wrapped.module, StageRunner):
            wrapped.module.load_optimizer_state(optimizer, state)
        else:
            load_full_optimizer_state(wrapped.base, optimizer, state)

    # ------------------------------------------------------------------------- cost model

    def fp16_conflict(self, *, world_size: int) -> str | None:
        degrees = self.degrees(world_size)
        return FP16_OWN_STEP if degrees.tp > 1 or degrees.pp > 1 else None

    def compute_share(self, *, job: Workload) -> float:
        """Each data shard's work (1/dp of the batch) split over the tp and cp ranks and the pp stages;
        with stages, in m + pp - 1 micro-batch slots for m micro-batches: the bubble, as pipeline's."""
        degrees = self.degrees(job.world)
        s = self.settings
        bubble = (
            schedule_slots(s.microbatches, degrees.pp, s.schedule, s.stages_per_rank)
            if degrees.pp > 1
            else 1.0
        )
        return bubble / (degrees.dp * degrees.cp * degrees.tp * degrees.pp)

    def held(self, *, job: Workload) -> list[Held]:
        """Each rank its stage's part (pipeline's `stage_held`, with pp > 1), each parameter of it as
        the rank holds it: its chunk on the dimension tensor parallelism splits it on, of that its row
        chunk over dp_shard x cp (FSDP; HSDP's groups hold the same). Without resharding FSDP keeps the
        gathered parameters through the step. With tensor parallelism its activations are those of
        the model split as `wrap` splits it (`split`); with context parallelism, of 1/cp of each
        sequence (`sequence_split`)."""
        degrees = self.degrees(job.world)
        plan = self._plan(job.model, degrees.tp)
        dims = tensor_parallel.split_dims(job.model, plan)
        pipe = self._pipe(degrees.pp)
        stages = group(model_stages(job.model), pipe.count) if degrees.pp > 1 else [job.model]
        chunks = self.settings.microbatches if degrees.pp > 1 else 1
        samples = job.global_batch / degrees.dp / job.accumulate / chunks
        reshard = self.settings.reshard_after_forward and degrees.pp == 1
        mixed = self.precisions(degrees, job.precision)
        shapes = tensor_parallel.local_shapes(job.model, plan, degrees.tp)
        loss_context = None
        if degrees.tp > 1 and self.settings.loss_parallel:
            loss_context = functools.partial(tensor_parallel.loss_context, True)
        units = unit_params(job.model)
        ep, experts = self.settings.ep, expert_parallel.expert_params(job.model)
        if ep > 1:  # each rank its 1/ep of the experts, whole: FSDP neither shards nor gathers them
            units = [[p for p in unit if p not in experts] for unit in units]
        own = gathered_sizes(job)
        split = self._predicted_split(degrees, ep) if degrees.tp > 1 or ep > 1 else None
        split_key = (degrees.tp, self.settings.sequence_parallel, self.settings.loss_parallel, ep)
        held: dict[tuple[int, ...], Held] = {}  # ranks at the same stage and chunks hold alike
        per_stage: dict[int, tuple[list[nn.Parameter], Held, list[list[nn.Parameter]]]] = {}
        out = []
        for rank in range(job.world):
            at = degrees.coordinates(rank)
            place = (at["pp"], at["tp"], at["dp_shard"], at["cp"])
            if place not in held:
                if at["pp"] not in per_stage:  # what does not depend on the rank's chunks, once a stage
                    runs = pipe.mine(at["pp"]) if degrees.pp > 1 else [0]
                    params = [p for index in runs for p in stages[index].parameters()]
                    ids = {id(p) for p in params}
                    if degrees.pp > 1:
                        base = stage_held(stages, pipe, at["pp"], samples=samples)
                    else:
                        base = Held.replica(job.model, samples)
                    per_stage[at["pp"]] = (params, base, [[p for p in u if id(p) in ids] for u in units])
                params, base, mine_units = per_stage[at["pp"]]
                sharded = trained = 0
                for p in params:
                    shape = list(p.shape) or [1]
                    if id(p) in dims:
                        shape[dims[id(p)]] = chunk_len(shape[dims[id(p)]], degrees.tp, at["tp"])
                    mine = (
                        shard_of(shape, degrees.shard, at["dp_shard"] * degrees.cp + at["cp"])
                        * p.element_size()
                        if not (ep > 1 and p in experts)
                        else math.prod(shape) // ep * p.element_size()
                    )
                    sharded += mine
                    trained += mine if p.requires_grad else 0
                offload = self.settings.offload and degrees.fsdp > 1
                in_step, buffers = None, 0
                if degrees.shard > 1:
                    in_step, buffers = gathered_bytes(
                        mine_units, mixed, reshard=reshard, shapes=shapes, own=own
                    )
                    buffers += 0 if reshard or offload else sharded
                how: dict[str, Any] = {
                    "split": split,
                    "split_key": split_key,
                    "loss_context": loss_context,
                    "param_dtype": mixed.param,
                    "sequence_split": degrees.cp,
                }
                held[place] = replace(
                    base,
                    params=sharded,
                    grads=trained,
                    optimized=trained,
                    in_step=in_step,
                    buffers=buffers,
                    offloaded=offload,
                    extra=tuple(replace(e, **how) for e in base.extra),
                    **how,
                )
            out.append(held[place])
        return out

    def _pipe(self, pp: int) -> Pipe:
        s = self.settings
        return Pipe(s.schedule, pp, s.microbatches, stages_per_rank(s.schedule, s.stages_per_rank))

    def _predicted_split(self, degrees: Degrees, ep: int) -> Callable[[nn.Module], None]:
        """The model as one rank holds it, for the memory model: tensor parallelism's split on this
        job's mesh (of the process group in force), then expert parallelism's routing as one rank of
        `ep` runs it (balanced)."""
        routed = expert_parallel.predicted_split(ep) if ep > 1 else None

        def split(model: nn.Module) -> None:
            from torch.distributed.device_mesh import DeviceMesh

            if degrees.tp > 1:
                # The first ranks of the process group in force (it may hold more: a prediction's fake one).
                ranks = torch.arange(degrees.world).reshape(degrees.shape)
                mesh = DeviceMesh("cpu", ranks, mesh_dim_names=NAMES)
                tensor_parallel.apply(model, mesh["tp"], self._plan(model, degrees.tp))
            if routed is not None:
                routed(model)

        return split

    def _plan(self, model: nn.Module, tp: int) -> dict[str, Any]:
        """The model's tensor-parallel plan over `tp` ranks ({} without tensor parallelism)."""
        if tp == 1:
            return {}
        s = self.settings
        return tensor_parallel.plan_of(
            model, tp=tp, sequence_parallel=s.sequence_parallel, loss_parallel=s.loss_parallel
        )

    def communication(self, *, job: Workload) -> list[Collective]:
        """Per optimizer step: tensor parallelism's collectives (tensor_parallel.communication, from
        the model's plan and the shapes of one micro-batch's forward on the meta device), FSDP's over
        the data-parallel ranks, each parameter as a rank holds it after the tensor-parallel split
        (fsdp's count: all-gathers of each unit's shard, again for the backward with
        reshard_after_forward, one reduce-scatter of its gradient; HSDP's all-reduce of the reduced
        shard across the groups), with cp > 1 the ring's keys and values (context_parallel.communication)
        and with pp > 1 the activations between stages (pipeline's count; every tp rank sends its own
        copy to its counterpart in the next stage, with sequence parallelism its part of the sequence,
        with cp its part of each sequence). With stages, each rank holds and sends for its own
        stage only: the per-rank counts are averages over the stages (the meter averages over ranks),
        the parameters stay gathered for all micro-batches, and FSDP reduces after each schedule
        step."""
        degrees = self.degrees(job.world)
        pp, chunks = degrees.pp, self.settings.microbatches if degrees.pp > 1 else 1
        passes = job.accumulate * chunks  # forward and backward passes per optimizer step
        out: list[Collective] = []
        plan = self._plan(job.model, degrees.tp)
        mixed = self.precisions(degrees, job.precision)
        # The step computes in FSDP's parameter dtype, else under autocast's, else as stored.
        autocast = None if mixed.param is not None else Precision.of(job.precision).autocast_dtype
        computed = mixed.param or autocast or torch.float32
        shape = sequence_part(job.input_shape or (), degrees.cp)  # what each rank runs
        if degrees.tp > 1:
            out += tensor_parallel.communication(
                job.model,
                plan,
                tp=degrees.tp,
                micro_batch=job.global_batch // passes // degrees.dp,
                input_shape=shape,
                input_dtype=job.input_dtype,
                microbatches=passes,
                inter_node=job.spans_nodes(degrees.tp),
                param_dtype=mixed.param,
                autocast_dtype=autocast,
                float8=frozenset(float8.eligible(job.model)) if job.precision == "fp8" else frozenset(),
                float8_weights_gathered=job.gathers_float8 and degrees.shard > 1,
            )
        if degrees.cp > 1:
            out += context_parallel.communication(
                job.model,
                cp=degrees.cp,
                tp=degrees.tp,
                micro_batch=job.global_batch / passes / degrees.dp,
                length=(job.input_shape or (0,))[0],
                element_size=computed.itemsize,
                passes=passes,
                recomputed=job.activation_checkpointing == "full",
                inter_node=job.spans_nodes(degrees.tp * degrees.cp),
            )
        ep = self.settings.ep
        if ep > 1:
            # The tokens leave in the stream's dtype (FSDP's parameter dtype, or fp32: autocast's norms
            # give fp32), the experts' outputs return in their matmuls'.
            out += expert_parallel.communication(
                job.model,
                ep=ep,
                micro_batch=job.global_batch / passes / degrees.dp,
                length=(job.input_shape or (0,))[0],
                passes=passes,
                token_size=(mixed.param or torch.float32).itemsize,
                output_size=computed.itemsize,
                inter_node=job.spans_nodes(degrees.tp * degrees.cp * ep),
                per_node=min(ep, job.procs_per_node),
            )
        if degrees.fsdp > 1:
            out += self._data_parallel(
                job, degrees, tensor_parallel.local_shapes(job.model, plan, degrees.tp)
            )
        if pp == 1:
            return out
        out = [replace(c, bytes=c.bytes / pp, calls=c.calls / pp, counted=c.counted / pp) for c in out]
        pipe = self._pipe(pp)
        parts = group(model_stages(job.model), pipe.count)
        sizes = pipe.crossing(boundary_bytes(parts, job, job.global_batch / passes / degrees.dp / degrees.cp))
        slots = 2 * (chunks * pipe.per_rank + pp - 1) * job.accumulate
        what = "activations and their gradients between stages, per micro-batch slot"
        # Each tp rank sends its counterpart's copy; with sequence parallelism only its part of the sequence.
        part = degrees.tp if degrees.tp > 1 and self.settings.sequence_parallel else 1
        sent = float(slots * max(sizes, default=0) / degrees.tp / part)
        counted = 2 * chunks * job.accumulate * sum(sizes) / pp / part
        sends = Collective(
            what, "sendrecv", sent, 2, slots, counted=counted, inter_node=job.nodes > 1, timed=False
        )
        return [*out, sends]

    def _data_parallel(
        self, job: Workload, degrees: Degrees, shapes: dict[int, tuple[int, ...]]
    ) -> list[Collective]:
        """FSDP's traffic over dp_shard x cp (fsdp.sharded_traffic, each parameter as this rank holds it
        after the tensor-parallel split) and with HSDP each reduced shard's all-reduce across the
        replica groups. Per unit, all-gathers: one per micro-batch of the engine (with stages: per
        schedule step, for all its micro-batches); reduce-scatters: one per step (with stages: per
        schedule step)."""
        staged = degrees.pp > 1
        reduces = job.accumulate if staged else 1
        # Ranks lie tp innermost, then cp, dp_shard, dp_replicate (degrees.py): a shard group is tp x
        # cp x dp_shard consecutive ranks, a replica group spans tp x cp x dp_shard x dp_replicate.
        shard_spans = job.spans_nodes(degrees.tp * degrees.shard)
        replica_spans = job.spans_nodes(degrees.tp * degrees.fsdp)
        gather, reduce = self.precisions(degrees, job.precision).element_sizes()
        units = unit_params(job.model)
        ep, experts = self.settings.ep, expert_parallel.expert_params(job.model)
        if ep > 1:  # the split experts are expert parallelism's to reduce (below), not FSDP's
            units = [[p for p in unit if p not in experts] for unit in units]
        own = gathered_sizes(job)
        shards = unit_shards(units, degrees.shard, element_size=gather, shapes=shapes, own=own)
        grads = unit_shards(units, degrees.shard, element_size=reduce, shapes=shapes)
        out = sharded_traffic(
            shards,
            degrees.shard,
            gathers=job.accumulate,
            reduces=reduces,
            again=self.settings.reshard_after_forward and not staged,
            inter_node=shard_spans,
            reduced=grads,
            per_node=max(1, job.procs_per_node // degrees.tp),
        )
        # The float8 weights are sharded over dp_shard x cp and, split by tensor parallelism, over tp.
        out += float8_scale_traffic(
            len(own),
            [
                (degrees.shard, shard_spans, max(1, job.procs_per_node // degrees.tp)),
                (degrees.tp, job.spans_nodes(degrees.tp), min(degrees.tp, job.procs_per_node)),
            ],
        )
        if ep > 1 and degrees.fsdp > ep:
            out.append(
                expert_parallel.expert_reduction(
                    experts,
                    ep=ep,
                    tp=degrees.tp,
                    replicas=degrees.fsdp // ep,
                    inter_node=replica_spans,
                    per_node=max(1, job.procs_per_node // (degrees.tp * ep)),
                )
            )
        if self.settings.offload:
            again = self.settings.reshard_after_forward and not staged
            out += offload_traffic(
                units,
                degrees.shard,
                gathers=job.accumulate,
                reduces=reduces,
                again=again,
                reduce_size=reduce,
                shapes=shapes,
            )
        if degrees.dp_replicate > 1 and grads:
            reduced = float(sum(grads)) * reduces
            out.append(
                Collective(
                    "each shard's gradient all-reduce across the replica groups (HSDP)",
                    "all_reduce",
                    reduced,
                    degrees.dp_replicate,
                    len(shards) * reduces,
                    Overlap.backward,
                    counted=reduced,
                    inter_node=replica_spans,
                    per_node=max(1, job.procs_per_node // (degrees.tp * degrees.shard)),
                )
            )
        return out


def _stage_buffers(part: nn.Module, degrees: Degrees, stage: int) -> Callable[[], None]:
    """A stage's buffers (BatchNorm's running statistics) as its first rank holds them, broadcast to
    the stage's other ranks; each stage's own, as its ranks hold no other's (the default broadcast of
    the whole model's would wait forever for buffers a rank does not have). Every rank makes every
    stage's group, in the same order, as new_group requires."""
    import torch.distributed as dist

    stride = degrees.world // degrees.pp  # ranks lie pp outermost: a stage's are consecutive
    groups = [dist.new_group(list(range(s * stride, (s + 1) * stride))) for s in range(degrees.pp)]
    group, first = groups[stage], stage * stride
    assert isinstance(group, dist.ProcessGroup)  # this rank's own stage's group

    def sync() -> None:
        if stride == 1:
            return
        with torch.no_grad():
            for b in part.buffers():
                dist.broadcast(b, src=first, group=group)

    return sync


@contextlib.contextmanager
def _no_grad_sync(roots: list[Any]) -> Iterator[None]:
    """fsdp's no_grad_sync over each FSDP root (a pipeline rank's stages are one root each)."""
    with contextlib.ExitStack() as stack:
        for root in roots:
            stack.enter_context(no_grad_sync(root))
        yield


def _fsdp_meter(model: nn.Module, *, hsdp: bool) -> CommMeter:
    """fsdp's meter, and with HSDP the all-reduce of each reduced shard across the groups, counted
    (by the shard's bytes) from FSDP's hook on its result; not timed."""
    meter = metered_collectives(model)
    if hsdp:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(lambda t: meter.count(t.numel() * t.element_size()))
    return meter


class _Runner(nn.Module):
    """The model as the engine drives it under nd: its training step (under the collective counter,
    with tensor or context parallelism; a stage's through the pipeline schedule; with cp on this rank's
    part of each sequence), the gradients' last reduction, and the evaluation forward, scored once per
    data shard (tp and cp rank 0; of the last stage)."""

    def __init__(
        self,
        trained: nn.Module,
        *,
        scores: bool,
        evaluates: bool,
        meter: CommMeter | None,
        counter: tensor_parallel.CollectiveCounter | None,
        stage: StageRunner | None,
        loss_parallel: bool = False,
        shards: context_parallel.SequenceShards | None = None,
        expert_sync: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.expert_sync = expert_sync
        self.trained = trained
        self.loss_parallel = loss_parallel
        self.stage = stage
        self.scores = scores
        self.evaluates = evaluates
        self.meter = meter
        self.counter = counter
        self.shards = shards
        self.shapes_known = stage is None

    def _counting(self) -> contextlib.AbstractContextManager[Any]:
        return self.counter.counting() if self.counter is not None else contextlib.nullcontext()

    def train_step(self, inputs: Any, targets: torch.Tensor, scale: float, loss: Loss) -> torch.Tensor | None:
        if self.shards is None:
            return self._train_step(inputs, targets, scale, loss)
        device = next(iter(self.trained.parameters())).device
        with self.shards.training(inputs.to(device), targets.to(device)) as (part, labels):
            return self._train_step(part, labels, scale, loss)

    def _train_step(
        self, inputs: Any, targets: torch.Tensor, scale: float, loss: Loss
    ) -> torch.Tensor | None:
        if not self.shapes_known:
            self._infer_shapes(inputs, targets, scale, loss)
        with self._counting(), tensor_parallel.loss_context(self.loss_parallel):
            if self.stage is not None:
                value = self.stage.train_step(inputs, targets, scale, loss)
                return tensor_parallel.whole(value) if self.scores else None
            device = next(iter(self.trained.parameters())).device
            outputs = self.trained(inputs.to(device, non_blocking=True))
            value = loss(outputs, targets.to(outputs.device, non_blocking=True))
            (value * scale if scale != 1.0 else value).backward()
        return tensor_parallel.whole(value.detach()) if self.scores else None

    def _infer_shapes(self, inputs: Any, targets: torch.Tensor, scale: float, loss: Loss) -> None:
        """A pipeline schedule's first step first infers every stage's input and output shapes by
        running the stages once more (on meta tensors, with FSDP gathering real parameters): traffic of
        the run's start, not of a training step. So the first batch's step runs once unmetered and is
        undone (gradients dropped, buffers restored), and the metered steps are all alike."""
        assert self.stage is not None
        part = self.stage.part
        saved = [b.detach().clone() for b in part.buffers()]
        unmetered = self.meter.paused() if self.meter is not None else contextlib.nullcontext()
        with unmetered, unrecorded_routing(), tensor_parallel.loss_context(self.loss_parallel):
            self.stage.train_step(inputs, targets, scale, loss)
        for p in part.parameters():
            p.grad = None
        with torch.no_grad():
            for buffer, value in zip(part.buffers(), saved, strict=True):
                buffer.copy_(value)
        self.shapes_known = True

    def sync_grads(self) -> None:
        """Every gradient in its parameter's layout before the optimizer runs: DTensor leaves some as
        partial sums (a sequence-parallel norm's weight, from each rank's part of the sequence),
        summed here once, and some whole where the parameter is split (a row-wise embedding's), cut
        here to this rank's part (no communication) rather than at each of the optimizer's ops."""
        from torch.distributed.tensor import DTensor

        with self._counting():
            for p in self.trained.parameters():
                grad = p.grad
                if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
                    p.grad = grad.redistribute(grad.device_mesh, p.placements)
        if self.expert_sync is not None:
            self.expert_sync()

    def forward(self, inputs: Any) -> torch.Tensor | None:
        if self.shards is not None:
            device = next(iter(self.trained.parameters())).device
            outputs = self.shards.evaluate(_Whole(self.trained), inputs.to(device))
        else:
            outputs = tensor_parallel.whole(self.trained(inputs))  # split logits: gathered
        return outputs if self.evaluates else None


class _Whole(nn.Module):
    """A model whose split logits (tensor parallelism's) come out whole."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Any) -> Any:
        return tensor_parallel.whole(self.model(inputs))


def _grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    return _norm([p.grad for p in params if p.grad is not None])


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm of these gradients together where they are DTensors on different meshes
    (tensor-parallel ones on dp x tp, the rest on dp): each tensor's norm made whole (a reduction
    over its mesh), then combined here."""
    from torch.distributed.tensor import DTensor

    total: torch.Tensor | None = None
    for grad in grads:
        norm = torch.linalg.vector_norm(grad)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        square = norm.double().pow(2)
        total = square if total is None else total + square
    return torch.zeros(()) if total is None else total.sqrt().float()

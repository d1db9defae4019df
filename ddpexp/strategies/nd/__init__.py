"""nd: data, tensor and pipeline parallelism composed on one device mesh.

The degrees (strategy.dp_replicate, dp_shard, tp, pp; one of them may be -1, the rest of the world)
make one `DeviceMesh` (init_device_mesh, dims pp x dp_replicate x dp_shard x tp, see degrees.py),
built once per worker; each parallelism works on its sub-mesh. Applied in torchtitan's order:

1. pipeline split (pp > 1): this rank keeps its stage's part of the model (pipeline.py's grouping);
2. tensor parallelism (tp > 1): the model's own plan (`parallel_plan()`), parallelize_module on the
   tp mesh; sequence_parallel=true keeps the activations between blocks split along the sequence;
3. activation checkpointing: trainer.activation_checkpointing, applied before any strategy (it swaps
   the blocks' classes and keeps their names, so the plan still finds every module);
4. data parallelism (dp_replicate x dp_shard > 1): FSDP2 (fully_shard) over the data-parallel mesh,
   each of the model's shard units, then the root; with dp_replicate > 1 HSDP, the 2-D mesh:
   parameters sharded within a group of dp_shard ranks, gradients all-reduced across the groups.

Why one new strategy rather than today's strategies as presets of the degrees: each of those has its
own code path, measured tables and parity tests, which a rewrite under new degrees would all put at
risk for no gain to their users; nd is what composes. nd with dp_shard=W alone is fsdp's layout, and
with tp=1 and pp=1 it runs the same fully_shard calls.

Ranks that differ only in tp (and pp) read the same data shard (`data_layout`): the global batch splits
over dp_replicate x dp_shard. Evaluation: every rank runs the forward (it is collective), the tp rank 0
of each data shard scores it, so every eval token counts once.

Checkpoints and model.pt hold the full, unsharded state (fsdp's full-state helpers gather the
DTensors of any mesh), so a run resumes under single, under another mesh, or under any strategy.

Bytes (`comm/bytes_per_step`): FSDP's all-gathers and reduce-scatters as fsdp counts them (and HSDP's
all-reduce of each shard's gradient across the groups, counted by its size), and tensor parallelism's
collectives (kind tensor_parallel: tensor_parallel.CollectiveCounter). `communication` declares both
for ddpexp-predict, from the same plan on the meta device.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...config import StrategyConfig
from ...errors import UserError
from .. import Strategy, Wrapped, register
from ..comm import Collective, CommMeter, Overlap, Workload
from ..fsdp import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    metered_collectives,
    no_grad_sync,
    units_and_ties,
)
from . import tensor_parallel
from .degrees import Degrees, resolve

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
    # With tp > 1: activations between blocks (and the norms) split along the sequence over the tp ranks.
    sequence_parallel: bool = False
    # FSDP: free gathered parameters after each unit's forward (gathered again for backward).
    reshard_after_forward: bool = True


@register
class Nd(Strategy[NdConfig]):
    name = "nd"
    schema = NdConfig

    def degrees(self, world: int) -> Degrees:
        s = self.settings
        given = {"pp": s.pp, "dp_replicate": s.dp_replicate, "dp_shard": s.dp_shard, "tp": s.tp}
        return resolve(given, world)

    # ------------------------------------------------------------------------- launch and layout

    def default_nprocs(self, *, device_type: str, host: HostFacts, devices_per_process: int) -> int:
        """The product of the degrees; with one of them -1, the most whole multiples of the others'
        product the host's default (its GPUs; 2 on a CPU) holds, at least one."""
        s = self.settings
        given = (s.pp, s.dp_replicate, s.dp_shard, s.tp)
        if min(given) == 0 or min(given) < -1:
            return 1  # check() names the bad degree
        fixed = math.prod(g for g in given if g != -1)
        if -1 not in given:
            return fixed
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
            raise UserError(
                "pipeline stages inside strategy=nd are not built yet",
                setting="strategy.pp",
                fix="set strategy.pp=1 (strategy=pipeline runs pipeline x data parallelism)",
            )
        if self.settings.sequence_parallel and degrees.tp == 1:
            log.warning("strategy.sequence_parallel=true with tp=1 splits nothing: it changes nothing")

    def check_model(self, model: nn.Module) -> None:
        if self.settings.tp > 1:
            tensor_parallel.plan_of(
                model, tp=self.settings.tp, sequence_parallel=self.settings.sequence_parallel
            )

    # ------------------------------------------------------------------------- in each worker

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        from torch.distributed.device_mesh import init_device_mesh

        degrees = self.degrees(ctx.world_size)
        mesh = init_device_mesh(
            ctx.device.type, degrees.shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp")
        )
        at = degrees.coordinates(ctx.rank)
        model = model.to(ctx.device)
        meter = CommMeter() if measure_comm else None
        if degrees.tp > 1:
            plan = tensor_parallel.plan_of(
                model, tp=degrees.tp, sequence_parallel=self.settings.sequence_parallel
            )
            tensor_parallel.apply(model, mesh["tp"], plan)
        no_sync: Any = contextlib.nullcontext
        if degrees.dp > 1:
            from torch.distributed.fsdp import fully_shard

            dp_mesh = mesh["dp_replicate", "dp_shard"] if degrees.dp_replicate > 1 else mesh["dp_shard"]
            units, _ = units_and_ties(model)
            for unit in units:
                fully_shard(unit, mesh=dp_mesh, reshard_after_forward=self.settings.reshard_after_forward)
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=self.settings.reshard_after_forward)
            fsdp: Any = model
            no_sync = lambda: no_grad_sync(fsdp)  # noqa: E731
            if meter is not None:
                meter = _fsdp_meter(model, hsdp=degrees.dp_replicate > 1)
        runner = _Runner(model, scores=at["tp"] == 0, meter=meter if degrees.tp > 1 else None)
        return Wrapped(
            module=model,
            base=model,
            no_sync=no_sync,
            sync_grads=runner.sync_grads,
            eval_module=runner,
            comm=meter,
            collective_eval=True,
            train_step=runner.train_step if degrees.tp > 1 else None,
            grad_norm=_grad_norm,
        )

    # ------------------------------------------------------------------------- checkpoints

    def model_state(self, wrapped: Wrapped) -> dict[str, torch.Tensor]:
        return full_model_state(wrapped.base)

    def load_model_state(self, wrapped: Wrapped, state: dict[str, torch.Tensor]) -> None:
        load_full_model_state(wrapped.base, state)

    def optimizer_state(self, wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return full_optimizer_state(wrapped.base, optimizer)

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        load_full_optimizer_state(wrapped.base, optimizer, state)

    # ------------------------------------------------------------------------- cost model

    def compute_share(self, *, job: Workload) -> float:
        """Each data shard's work (1/dp of the batch) split over the tp ranks."""
        degrees = self.degrees(job.world)
        return 1.0 / (degrees.dp * degrees.tp * degrees.pp)

    def communication(self, *, job: Workload) -> list[Collective]:
        """Tensor parallelism's collectives per micro-batch (tensor_parallel.communication, from the
        model's plan and the shapes of a micro-batch's forward on the meta device), then FSDP's over
        the data-parallel ranks as fsdp.communication counts them, each parameter as this rank holds
        it after the tensor-parallel split: all-gathers of each unit's shard for the forward (and again
        for the backward with reshard_after_forward), one reduce-scatter of its gradient per step, and
        with dp_replicate > 1 one all-reduce of the reduced shard across the groups."""
        degrees = self.degrees(job.world)
        out: list[Collective] = []
        plan: dict[str, Any] = {}
        if degrees.tp > 1:
            plan = tensor_parallel.plan_of(
                job.model, tp=degrees.tp, sequence_parallel=self.settings.sequence_parallel
            )
            micro = job.global_batch // job.accumulate // degrees.dp
            out += tensor_parallel.communication(
                job.model,
                plan,
                tp=degrees.tp,
                micro_batch=micro,
                input_shape=job.input_shape or (),
                input_dtype=job.input_dtype,
                microbatches=job.accumulate,
                inter_node=job.spans_nodes(degrees.tp),
            )
        if degrees.dp > 1:
            out += self._data_parallel(
                job, degrees, tensor_parallel.local_shapes(job.model, plan, degrees.tp)
            )
        return out

    def _data_parallel(
        self, job: Workload, degrees: Degrees, shapes: dict[int, tuple[int, ...]]
    ) -> list[Collective]:
        group = degrees.dp_shard
        units, _ = units_and_ties(job.model)
        taken = {id(p) for u in units for p in u.parameters()}
        params = [list(u.parameters()) for u in units] + [
            [p for p in job.model.parameters() if id(p) not in taken]
        ]
        shards = [_shard_bytes(ps, shapes, group) for ps in params]
        shards = [b for b in shards if b]
        if not shards:
            return []
        calls, shard = len(shards), float(sum(shards))
        spans = job.nodes > 1  # a data-parallel group's ranks lie tp x ... apart: across nodes if any
        gather = Collective(
            "parameter all-gather, forward",
            "all_gather",
            group * shard * job.accumulate,
            group,
            calls * job.accumulate,
            Overlap.forward,
            counted=shard * job.accumulate if group > 1 else 0.0,
            inter_node=spans,
        )
        out = []
        if group > 1:
            out.append(gather)
            if self.settings.reshard_after_forward:
                out.append(
                    Collective(
                        "parameter all-gather again for backward (reshard_after_forward)",
                        "all_gather",
                        group * shard * job.accumulate,
                        group,
                        calls * job.accumulate,
                        Overlap.backward,
                        counted=shard * job.accumulate,
                        inter_node=spans,
                    )
                )
            out.append(
                Collective(
                    "gradient reduce-scatter",
                    "reduce_scatter",
                    group * shard,
                    group,
                    calls,
                    Overlap.backward,
                    counted=group * shard,
                    inter_node=spans,
                )
            )
        if degrees.dp_replicate > 1:
            out.append(
                Collective(
                    "each shard's gradient all-reduce across the replica groups (HSDP)",
                    "all_reduce",
                    shard,
                    degrees.dp_replicate,
                    calls,
                    Overlap.backward,
                    counted=shard,
                    inter_node=spans,
                )
            )
        return out


def _shard_bytes(params: list[nn.Parameter], shapes: dict[int, tuple[int, ...]], world: int) -> int:
    """Bytes of one rank's FSDP shard of these parameters, each of the shape this rank holds after the
    tensor-parallel split: ceil(d0/W) rows of it (FSDP2's padded chunk)."""
    total = 0
    for p in params:
        shape = shapes.get(id(p), tuple(p.shape)) or (1,)
        total += math.ceil(shape[0] / world) * math.prod(shape[1:]) * p.element_size()
    return total


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
    """The model as the engine drives it under nd: its training step (with tensor parallelism, under
    the collective counter), the gradients' last reduction, and the evaluation forward, scored on tp
    rank 0 of each data shard only."""

    def __init__(self, model: nn.Module, *, scores: bool, meter: CommMeter | None) -> None:
        super().__init__()
        self.model = model
        self.scores = scores
        self.counter = tensor_parallel.CollectiveCounter(meter) if meter is not None else None

    def _counting(self) -> contextlib.AbstractContextManager[Any]:
        return self.counter.mode if self.counter is not None else contextlib.nullcontext()

    def train_step(self, inputs: Any, targets: torch.Tensor, scale: float, loss: Loss) -> torch.Tensor | None:
        device = next(iter(self.model.parameters())).device
        with self._counting():
            outputs = self.model(inputs.to(device, non_blocking=True))
            value = loss(outputs, targets.to(outputs.device, non_blocking=True))
            (value * scale if scale != 1.0 else value).backward()
        return value.detach() if self.scores else None

    def sync_grads(self) -> None:
        """Gradients DTensor left as partial sums (a sequence-parallel norm's weight, computed from each
        rank's part of the sequence) are summed now, once, as the parameter's own layout."""
        with self._counting():
            for p in self.model.parameters():
                grad = p.grad
                if grad is not None and _partial(grad):
                    p.grad = grad.redistribute(grad.device_mesh, p.placements)  # type: ignore[attr-defined]

    def forward(self, inputs: Any) -> torch.Tensor | None:
        outputs: torch.Tensor = self.model(inputs)
        return outputs if self.scores else None


def _partial(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Partial

    return isinstance(t, DTensor) and any(isinstance(p, Partial) for p in t.placements)


def _grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The whole gradient's norm where gradients are DTensors on different meshes (tensor-parallel
    ones on dp x tp, the rest on dp): each tensor's norm made whole (a reduction over its mesh), then
    combined here."""
    from torch.distributed.tensor import DTensor

    total: torch.Tensor | None = None
    for p in params:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        square = norm.double().pow(2)
        total = square if total is None else total + square
    return torch.zeros(()) if total is None else total.sqrt().float()

"""fsdp: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer
state sharded across ranks, parameters all-gathered for each unit's forward and backward, gradients
reduce-scattered.

Shard units are the model's blocks: a shipped model declares them with `shard_units()` (or, failing
that, its `stages()`, the blocks it already declares for ddp_mp); each unit that is a submodule of the
model is wrapped with fully_shard, then the root (which takes the parameters of the rest). Any other
model is sharded as one unit, with a warning (it then all-gathers every parameter at once, which saves
no memory at peak).

- reshard_after_forward=true frees a unit's gathered parameters after its forward and gathers them
  again for backward (ZeRO-3-like); false keeps them until backward (ZeRO-2-like: more memory, one
  all-gather fewer per step).
- Mixed precision (FSDP2's MixedPrecisionPolicy): with trainer.precision=bf16 each unit's parameters
  are gathered and computed in bf16 and its gradients reduced in fp32 (`reduce_dtype`), the sharded
  master parameters, gradients and optimizer state staying fp32, and the engine does not autocast:
  torchtitan's way, with no bf16 copy of every weight alive until its backward as autocast over fp32
  parameters keeps. `mixed_precision=bf16|fp16` asks for that policy whatever trainer.precision says;
  `mixed_precision=fp32` for none (parameters gathered as stored; with bf16 training autocast casts them).
- offload=true keeps the sharded parameters, gradients and optimizer state in host memory (FSDP2's
  CPUOffloadPolicy): each unit's shard is copied to the device before its all-gather, each reduced
  gradient shard back to the host, and the optimizer steps there. On a CPU run host and device memory
  are one, so nothing moves, but the same code runs (parity, the copies counted as
  comm/bytes_per_step/offload, the states counted as mem/host_mb).

Checkpoints hold the full, unsharded state (torch.distributed.checkpoint.state_dict's full-state-dict
helpers, gathered on rank 0 and offloaded to CPU), so model.pt loads into a plain nn.Module and a run
may resume under another strategy.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import UserError
from ..memory import offloaded_params
from ..models import declared_blocks
from . import DataParallelConfig, Strategy, Wrapped, maybe_sync_bn, register, syncbn
from .comm import Collective, CommMeter, Held, Overlap, Workload, record_when_done

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ..context import RunContext
    from ..plan import HostFacts, Plan

log = logging.getLogger(__name__)


class MixedPrecision(StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"  # no policy: parameters gathered and computed as stored


class ReduceDtype(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class FsdpConfig(DataParallelConfig):
    # true: free gathered parameters after each unit's forward (ZeRO-3-like); false: keep them for the
    # backward (ZeRO-2-like).
    reshard_after_forward: bool = True
    # The dtype parameters are gathered and computed in. null: trainer.precision's (bf16 training gathers
    # bf16 and does not autocast); fp32: as stored (autocast casts them under bf16 training).
    mixed_precision: MixedPrecision | None = None
    # The dtype gradients are reduce-scattered in when parameters compute in a lower one.
    reduce_dtype: ReduceDtype = ReduceDtype.fp32
    # Sharded parameters, gradients and optimizer state in host memory, the optimizer stepping there.
    offload: bool = False


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks each wrapped with fully_shard (the model's own declaration), [] if it has none.

    Only blocks that are submodules of the model (models.declared_blocks): a container stages() builds
    for ddp_mp never runs its own forward, so FSDP would never gather its parameters (and the root,
    finding them sharded already, refuses them). Those parameters go with the root's unit instead, as
    do a block's that share a tensor with any module
    outside it (tied weights): fully_shard replaces a parameter in its own unit's modules only, so
    a tie across units would become two parameters (FSDP's DeviceMesh crashes on the second). In the
    root's unit both uses see the one gathered tensor."""
    return units_and_ties(model)[0]


def units_and_ties(model: nn.Module) -> tuple[list[nn.Module], list[str]]:
    """(shard_units(model); the names of the tied tensors that sent declared blocks to the root)."""
    blocks = [m for m in declared_blocks(model) if any(True for _ in m.parameters())]
    ties = [_tied_outside(m, model) for m in blocks]
    units = [m for m, tied in zip(blocks, ties, strict=True) if not tied]
    return units, sorted({name for tied in ties for name in tied})


def _tied_outside(unit: nn.Module, model: nn.Module) -> list[str]:
    """The model's names, outside `unit`'s paths, of tensors that `unit` holds too: a tied parameter,
    or a whole module that is a submodule of `unit` and of another part (reached by two paths, it is
    the same module object on both, so the paths tell them apart, not the modules)."""
    mine = {id(t) for t in [*unit.parameters(), *unit.buffers()]}
    paths = [
        f"{name}." if name else "" for name, m in model.named_modules(remove_duplicate=False) if m is unit
    ]
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [name for name, t in named if id(t) in mine and not any(name.startswith(p) for p in paths)]


@dataclass(frozen=True)
class Precisions:
    """The dtypes FSDP's mixed-precision policy gathers parameters and reduces gradients in; param None:
    no policy (parameters as stored, the engine's autocast, if any, casting them)."""

    param: torch.dtype | None
    reduce: torch.dtype | None

    @property
    def autocast(self) -> bool:
        """Whether the engine should autocast: not where the parameters themselves are cast."""
        return self.param is None

    def policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param, reduce_dtype=self.reduce)

    def element_sizes(self) -> tuple[int | None, int | None]:
        """Bytes an element travels in: (all-gathers, reduce-scatters); None: the parameter's own."""
        size = lambda d: None if d is None else torch.empty((), dtype=d).element_size()  # noqa: E731
        return size(self.param), size(self.reduce)


def precisions(mixed: MixedPrecision | None, reduce: ReduceDtype, precision: str) -> Precisions:
    """The policy `mixed_precision` (null: trainer.precision's, for bf16 only: fp16 training keeps its
    autocast and loss scaling over fp32 parameters) and `reduce_dtype` give under trainer.precision."""
    chosen = mixed.value if mixed is not None else "bf16" if precision in ("bf16", "fp8") else "fp32"
    if chosen == "fp32":
        return Precisions(None, None)
    return Precisions(DTYPES[chosen], DTYPES[reduce.value])


@register
class Fsdp(Strategy[FsdpConfig]):
    name = "fsdp"
    schema = FsdpConfig

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        if self.settings.mixed_precision == MixedPrecision.fp16 and plan.device_type != "cuda":
            raise UserError(
                "fp16 mixed precision needs CUDA (its gradients need loss scaling the CPU path lacks)",
                setting="strategy.mixed_precision",
                fix="use strategy.mixed_precision=bf16 on CPU",
            )
        if self.settings.offload and plan.device_type != "cuda":
            log.info("offload on a CPU run: host and device memory are one, so nothing moves")
        if plan.world_size == 1 and not self.settings.offload:
            log.warning("fsdp on one rank shards nothing: its settings change nothing but speed")

    def precisions(self, precision: str) -> Precisions:
        return precisions(self.settings.mixed_precision, self.settings.reduce_dtype, precision)

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        from torch.distributed.fsdp import fully_shard

        model = maybe_sync_bn(model, self.settings.sync_bn, ctx.device.type)
        if not self.settings.offload:
            model = model.to(ctx.device)
        kwargs: dict[str, Any] = {"reshard_after_forward": self.settings.reshard_after_forward}
        mixed = self.precisions(ctx.plan.precision)
        if mixed.param is not None:
            kwargs["mp_policy"] = mixed.policy()
        if self.settings.offload:
            kwargs["offload_policy"] = offload_policy(ctx.device)
        units, ties = units_and_ties(model)
        if ties:
            log.info("tied weights %s: the blocks holding them are sharded with the root", ", ".join(ties))
        if not units and not ties:
            log.warning(
                "%s declares no shard units (shard_units() or stages()): sharded as one unit, so every "
                "parameter is gathered at once",
                type(model).__name__,
            )
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        fsdp: Any = model
        meter = metered_collectives(model) if measure_comm else None
        return Wrapped(
            module=model,
            base=model,
            no_sync=lambda: no_grad_sync(fsdp),
            collective_eval=True,
            comm=meter,
            autocast=mixed.autocast,
        )

    def held(self, *, job: Workload) -> list[Held]:
        """Rank r holds row chunk r of every parameter, its gradient and optimizer state (`shard_of`).
        At the step's peak it also holds what FSDP gathers and reduces (`gathered_bytes`); with a
        mixed-precision policy the gathered parameters are in its dtype, and so is the forward."""
        mixed = self.precisions(job.precision)
        reshard = self.settings.reshard_after_forward
        offload = self.settings.offload
        gathered, buffers = gathered_bytes(
            unit_params(job.model), mixed, reshard=reshard, own=gathered_sizes(job)
        )
        samples = job.global_batch / job.world / job.accumulate
        out = []
        for rank in range(job.world):
            mine = [
                (p, shard_of(p.shape, job.world, rank) * p.element_size()) for p in job.model.parameters()
            ]
            trained = sum(b for p, b in mine if p.requires_grad)
            params = sum(b for _, b in mine)
            out.append(
                Held(
                    params,
                    trained,
                    trained,
                    in_step=gathered,
                    buffers=buffers + (0 if reshard or offload else params),
                    samples=samples,
                    param_dtype=mixed.param,
                    offloaded=offload,
                )
            )
        return out

    def communication(self, *, job: Workload) -> list[Collective]:
        """Per optimizer step, for every shard unit (the model's blocks, then the root with the rest):
        one all-gather of its parameters for each micro-batch's forward, again for the backward with
        reshard_after_forward (the root's too: ddpexp sets the flag explicitly, so torch's exception for
        the root does not apply), and one reduce-scatter of its gradient on the last micro-batch
        (sharded_traffic); under a mixed-precision policy the all-gathers travel in its parameter
        dtype, the reduce-scatters in its reduce dtype. With offload, the copies between host and
        device around each of them (offload_traffic)."""
        world = job.world
        gather, reduce = self.precisions(job.precision).element_sizes()
        units = unit_params(job.model)
        out: list[Collective] = []
        if self.settings.offload:  # on one rank too: its shard is the whole unit
            again = self.settings.reshard_after_forward
            out += offload_traffic(
                units, world, gathers=job.accumulate, reduces=1, again=again, reduce_size=reduce
            )
        if world < 2:
            return out
        own = gathered_sizes(job)
        out += sharded_traffic(
            unit_shards(units, world, element_size=gather, own=own),
            world,
            gathers=job.accumulate,
            reduces=1,
            again=self.settings.reshard_after_forward,
            inter_node=job.spans_nodes(world),
            reduced=unit_shards(units, world, element_size=reduce),
            per_node=min(world, job.procs_per_node),
        )
        out += float8_scale_traffic(
            len(own), [(world, job.spans_nodes(world), min(world, job.procs_per_node))]
        )
        return out + (syncbn.communication(job.model, job) if self.settings.sync_bn else [])

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


# The full, unsharded state of a model whose parameters are DTensors (FSDP's shards, tensor-parallel
# splits, or both), gathered on rank 0 in host memory, and loaded back into whatever layout the model
# has now: torch.distributed.checkpoint.state_dict's full-state-dict helpers. Collective: every rank.


def full_model_state(model: nn.Module, *, on_every_rank: bool = False) -> dict[str, torch.Tensor]:
    """On global rank 0 (the other ranks get {}), or on_every_rank (on the model's device: a pipeline
    stage's owner is not rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_every_rank)
    state: Any = get_model_state_dict(model, options=options)
    return state


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: Any = state
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, on_every_rank: bool = False
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_every_rank)
    full = get_optimizer_state_dict(model, optimizer, options=options)
    return _by_index(full, model) if full else {}


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model, optimizer, _by_name(state, model), options=StateDictOptions(full_state_dict=True)
    )


def unit_params(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters each fully_shard call in `wrap` takes: every shard unit's, then the root's (the
    rest). Kept per model while its parameters are the same ones: a planner asks for thousands of
    ranks, and finding the units (their ties) walks the model once per block."""
    current = tuple(map(id, model.parameters()))
    known = _UNITS.get(model)
    if known is not None and known[0] == current:
        return [list(ps) for ps in known[1]]
    units = [list(unit.parameters()) for unit in shard_units(model)]
    taken = {id(p) for params in units for p in params}
    found = [*units, [p for p in model.parameters() if id(p) not in taken]]
    _UNITS[model] = (current, tuple(tuple(ps) for ps in found))
    return [list(ps) for ps in found]


_UNITS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], tuple[tuple[nn.Parameter, ...], ...]]] = (
    weakref.WeakKeyDictionary()
)


def unit_shards(
    units: list[list[nn.Parameter]],
    ranks: int,
    *,
    element_size: int | None = None,
    shapes: dict[int, tuple[int, ...]] | None = None,
    own: dict[int, int] | None = None,
) -> list[int]:
    """Bytes of one rank's shard of each unit (a list of parameters, one fully_shard call) over `ranks`,
    for the units that have parameters (one without has no collectives). FSDP2 shards every parameter
    on dim 0 in ceil(d0/W) rows, padding the last ranks' chunks. `element_size`: bytes an element
    travels in (mixed precision), else the parameter's; `shapes`: a parameter's shape as this rank
    holds it, where not its own (a tensor-parallel split); `own`: the bytes an element of a parameter
    travels in where not `element_size` (float8 weights, `gathered_sizes`)."""
    sizes = (_shard_bytes(ps, ranks, element_size, shapes or {}, own or {}) for ps in units)
    return [b for b in sizes if b]


def gathered_sizes(job: Workload) -> dict[int, int]:
    """The parameters FSDP gathers in a dtype of their own, by id, with its bytes an element: under
    trainer.fp8_all_gather the float8 layers' weights, cast to float8 (1 byte) before the gather."""
    if not job.gathers_float8:
        return {}
    from .. import float8

    return dict.fromkeys(map(id, float8.weights(job.model)), 1)


def float8_scale_traffic(count: int, groups: list[tuple[int, bool, int]]) -> list[Collective]:
    """Under trainer.fp8_all_gather, after each optimizer step: the absolute maxima of the `count`
    weights FSDP gathers in float8 (gathered_sizes), one float each, all-reduced over each group
    (ranks, across nodes, ranks a node) the weights are sharded over (float8.keep_weight_scales), as
    its meter counts them."""
    return [
        Collective(
            "float8 weights' scales all-reduce (fp8_all_gather)",
            "all_reduce",
            4.0 * count,
            ranks,
            1,
            counted=4.0 * count,
            inter_node=spans,
            per_node=per_node,
        )
        for ranks, spans, per_node in groups
        if count and ranks > 1
    ]


def chunk_len(n: int, ranks: int, rank: int) -> int:
    """Length of `rank`'s chunk when `n` splits over `ranks` as torch.chunk splits it (ceil(n/W) each,
    the last ranks' shorter or empty): how FSDP2 and DTensor's Shard split a dimension."""
    size = math.ceil(n / ranks)
    return max(0, min(size, n - rank * size))


def shard_of(shape: Any, ranks: int, rank: int) -> int:
    """Elements of `rank`'s row chunk (FSDP2's shard) of a tensor of `shape` over `ranks`."""
    shape = tuple(shape) or (1,)
    return chunk_len(shape[0], ranks, rank) * math.prod(shape[1:])


def gathered_bytes(
    units: list[list[nn.Parameter]],
    mixed: Precisions,
    *,
    reshard: bool,
    shapes: dict[int, tuple[int, ...]] | None = None,
    own: dict[int, int] | None = None,
) -> tuple[int | None, int]:
    """What FSDP holds of the parameters at the step's peak, in a unit's backward, as (the parameters
    alive where more than the rank's shards: every unit gathered, without resharding, from its
    forward to its backward; None: the shards; its buffers beyond them: the units gathered for the
    one computing and the next, prefetched, where it reshards, or the shards beside the gathered
    parameters where it does not; and that unit's unsharded gradient, in the dtype it computes in,
    with the buffer its reduce-scatter sends, in the reduce dtype). Gathered parameters are in the
    policy's dtype, the float8 weights of trainer.fp8_all_gather in float8 (`own`, gathered_sizes).
    `shapes`: a parameter's shape as the rank holds it before FSDP (a tensor-parallel split), where not
    its own."""
    gather, reduce = mixed.element_sizes()
    shapes, own = shapes or {}, own or {}
    full = [ps for ps in units if ps]
    if not full:
        return None, 0
    element = full[0][0].element_size()
    gather, reduce = gather or element, reduce or element
    numel = [sum(math.prod(shapes.get(id(p), tuple(p.shape))) for p in ps) for ps in full]
    gathered = [
        sum(math.prod(shapes.get(id(p), tuple(p.shape))) * own.get(id(p), gather) for p in ps) for ps in full
    ]
    unit_grad = max(numel) * (gather + reduce)
    if reshard:
        return None, sum(sorted(gathered, reverse=True)[:2]) + unit_grad
    return sum(gathered), unit_grad


def sharded_traffic(
    shards: list[int],
    ranks: int,
    *,
    gathers: int,
    reduces: int,
    again: bool,
    inter_node: bool,
    reduced: list[int] | None = None,
    per_node: int = 1,
) -> list[Collective]:
    """FSDP's collectives over `ranks` per optimizer step for units whose shards are these bytes
    (unit_shards), counted as `metered_collectives` counts them: `gathers` all-gathers of the rank's
    shard for the forward, as many again for the backward when `again` (reshard_after_forward), and
    `reduces` reduce-scatters of the unit's whole padded gradient (W x its shard; `reduced`: the
    shards in the dtype gradients are reduced in, where not the gathered one). Forward all-gathers are
    prefetched behind the previous unit's forward, backward ones and the reduce-scatters behind the
    backward pass. `per_node`: the group's ranks on each node, where it spans nodes."""
    if not shards or ranks < 2:
        return []
    calls, shard = len(shards), float(sum(shards))
    grad = float(sum(reduced)) if reduced is not None else shard

    def all_gather(what: str, overlaps: Overlap) -> Collective:
        return Collective(
            what,
            "all_gather",
            ranks * shard * gathers,
            ranks,
            calls * gathers,
            overlaps,
            counted=shard * gathers,
            inter_node=inter_node,
            per_node=per_node,
        )

    backward = "parameter all-gather again for backward (reshard_after_forward)"
    return [
        all_gather("parameter all-gather, forward", Overlap.forward),
        *([all_gather(backward, Overlap.backward)] if again else []),
        Collective(
            "gradient reduce-scatter",
            "reduce_scatter",
            ranks * grad * reduces,
            ranks,
            calls * reduces,
            Overlap.backward,
            counted=ranks * grad * reduces,
            inter_node=inter_node,
            per_node=per_node,
        ),
    ]


def _shard_bytes(
    params: list[nn.Parameter],
    world: int,
    element_size: int | None,
    shapes: dict[int, tuple[int, ...]],
    own: dict[int, int],
) -> int:
    """Bytes of one rank's shard of these parameters: ceil(d0/W) rows of each (FSDP2's padded chunk,
    rank 0's: every rank's travels at that size)."""
    return sum(
        shard_of(shapes.get(id(p), tuple(p.shape)), world, 0)
        * own.get(id(p), element_size or p.element_size())
        for p in params
    )


def _by_index(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """torch.distributed.checkpoint names parameters by their path; a plain optimizer (and so every
    other strategy's checkpoint) numbers them in model.parameters() order. Checkpoints use the numbers."""
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }


def _by_name(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    names = [name for name, _ in model.named_parameters()]
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]
        ],
    }


@contextmanager
def no_grad_sync(model: Any) -> Iterator[None]:
    """Accumulation: keep unsharded gradients locally, reduce-scatter only on the last micro-batch."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def metered_collectives(model: nn.Module) -> CommMeter:
    """Every FSDP unit's all-gathers and reduce-scatters, run as FSDP runs them (torch's default
    implementations), timed from launch to completion and counted by the payload each rank hands in:
    its shard for an all-gather, the unit's whole (padded) gradient for a reduce-scatter, the
    counterpart of the gradient buffer a DDP all-reduce is counted by."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    meter = CommMeter()

    class MeteredAllGather(DefaultAllGather):
        def __init__(self, host_bytes: int) -> None:
            super().__init__()
            self.host_bytes = host_bytes  # what offload copies to the device before each all-gather

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
            start = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            record_when_done(
                meter, work, start, input_tensor.numel() * input_tensor.element_size(), "parameters"
            )
            if self.host_bytes:
                meter.count(self.host_bytes, "offload")
            return work

    class MeteredReduceScatter(DefaultReduceScatter):
        def __init__(self, host_elements: int) -> None:
            super().__init__()
            self.host_elements = host_elements  # of the reduced shard offload copies back to the host

        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
        ) -> Any:
            start = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            record_when_done(meter, work, start, input_tensor.numel() * input_tensor.element_size())
            if self.host_elements:
                meter.count(self.host_elements * input_tensor.element_size(), "offload")
            return work

    for module in model.modules():
        if isinstance(module, FSDPModule):
            offloaded = offloaded_params(module)
            to_device = sum(
                fp._sharded_param_data.numel() * fp._sharded_param_data.element_size() for fp in offloaded
            )
            module.set_custom_all_gather(MeteredAllGather(to_device))
            module.set_custom_reduce_scatter(
                MeteredReduceScatter(sum(math.prod(fp.sharded_size) for fp in offloaded))
            )
    return meter


def offload_policy(device: torch.device) -> Any:
    """FSDP2's CPUOffloadPolicy; host memory pinned for asynchronous copies where there is a GPU (pinning
    needs CUDA)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def offload_traffic(
    units: list[list[nn.Parameter]],
    ranks: int,
    *,
    gathers: int,
    reduces: int,
    again: bool,
    reduce_size: int | None,
    shapes: dict[int, tuple[int, ...]] | None = None,
) -> list[Collective]:
    """What offload copies between host and device per optimizer step, as `metered_collectives` counts
    it: before every all-gather (sharded_traffic's) each unit's padded shard, as stored, to the device;
    after every reduce-scatter the rank's reduced gradient shard (unpadded: W ranks' together are the
    unit's parameters once) back to the host, in the dtype gradients are reduced in. On one rank FSDP
    copies the same without calling the collectives the meter wraps: counted 0 there."""
    shapes = shapes or {}
    stored = unit_shards(units, ranks, shapes=shapes)
    if not stored:
        return []
    numel = sum(math.prod(shapes.get(id(p), tuple(p.shape))) for ps in units for p in ps)
    element = next(p for ps in units for p in ps).element_size()
    gradient = numel / ranks * (reduce_size or element) * reduces
    calls = len(stored)
    forward = float(sum(stored) * gathers)
    metered = 1.0 if ranks > 1 else 0.0

    def copy(what: str, nbytes: float, launches: int, overlaps: Overlap) -> Collective:
        return Collective(
            what, "sendrecv", nbytes, 1, launches, overlaps, counted=nbytes * metered, host=True
        )

    again_copy = "shards to the device again before each backward all-gather (offload)"
    return [
        copy(
            "shards to the device before each forward all-gather (offload)",
            forward,
            calls * gathers,
            Overlap.forward,
        ),
        *([copy(again_copy, forward, calls * gathers, Overlap.backward)] if again else []),
        copy("reduced gradient shards to the host (offload)", gradient, calls * reduces, Overlap.backward),
    ]

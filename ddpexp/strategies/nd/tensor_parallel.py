"""Tensor parallelism: applying a model's plan, metering the collectives it issues, and predicting them.

The plan is the model's own (`parallel_plan(tp=..., sequence_parallel=..., loss_parallel=...)`:
module path -> ParallelStyle, see models/gpt.py); `apply` hands it to `parallelize_module`. A tensor
shared by two modules (tied embeddings) is parallelised once per module, each time replaced by a new
parameter, so the tie is made again afterwards, to the first module's parameter (both styles must
shard it alike).

Metering: DTensor issues its collectives as functional ops (`_c10d_functional.*`), which a
TorchDispatchMode sees once it lets DTensor dispatch first (PyTorch's CommDebugMode counts them the
same way). `CollectiveCounter` counts each one's payload as the other meters count theirs (the
tensor each rank hands in: the whole activation for an all-reduce or a reduce-scatter, the rank's
part for an all-gather), as kind `tensor_parallel`, and times it from launch to the wait on its
result. FSDP's own collectives are c10d ops, not functional ones: fsdp.metered_collectives counts
those.

Prediction (`communication`): the plan's styles, each with the layouts it converts between, applied to
the shapes of each module's input and output in a forward of one micro-batch on the meta device. The
rules (`_style_traffic`) are DTensor's redistributions: Replicate -> Replicate across a ColwiseParallel
input is free forward and an all-reduce of the input's gradient backward; Partial -> Replicate after a
RowwiseParallel is an all-reduce forward; Partial -> Shard a reduce-scatter forward and an all-gather
of the gradient backward; Shard -> Replicate an all-gather forward and a reduce-scatter backward.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ...errors import UserError
from ...models import moe
from ..comm import Collective, CommMeter, Overlap

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

KIND = "tensor_parallel"


class _Traffic(NamedTuple):
    """One collective of a ParallelStyle: what it moves, the op, its full (unsplit) bytes, what it
    overlaps; `once`: sent once per optimizer step (after the last pass), not once per pass."""

    what: str
    op: str
    full: float
    overlaps: Overlap = Overlap.none
    once: bool = False


def plan_of(
    model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool = False
) -> dict[str, Any]:
    """The model's tensor-parallel plan for `tp` ranks, or a UserError for a model without one (or,
    with loss_parallel, for one whose plan cannot keep its logits split)."""
    declare: Callable[..., dict[str, Any]] | None = getattr(model, "parallel_plan", None)
    if not callable(declare):
        raise UserError(
            f"{type(model).__name__} declares no tensor-parallel plan (parallel_plan())",
            setting="strategy.tp",
            fix="set strategy.tp=1, or use a model with a plan (model=gpt, gpt_tiny, gpt_small...)",
        )
    if not loss_parallel:
        return declare(tp=tp, sequence_parallel=sequence_parallel)
    if not splits_loss(model):
        raise UserError(
            f"{type(model).__name__}.parallel_plan() takes no loss_parallel: its logits cannot stay split",
            setting="strategy.loss_parallel",
            fix="set strategy.loss_parallel=false, or give parallel_plan a loss_parallel keyword that "
            "leaves the head's output a DTensor split by class (models/gpt.py does)",
        )
    return declare(tp=tp, sequence_parallel=sequence_parallel, loss_parallel=True)


def splits_loss(model: nn.Module) -> bool:
    """Whether the model's plan can leave its logits split for a loss_parallel cross-entropy."""
    declare = getattr(model, "parallel_plan", None)
    return callable(declare) and "loss_parallel" in inspect.signature(declare).parameters


def loss_context(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Where the loss and its backward run: under loss_parallel() when the plan leaves the logits split
    (a cross-entropy on them then reduces over the tp ranks instead of gathering them)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def whole(t: Any) -> Any:
    """A DTensor made an ordinary tensor: the local value of a replicated one (the loss under
    loss_parallel), all of a split one (logits for evaluation: a collective, every tp rank calls it)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    if all(isinstance(p, Replicate) for p in t.placements):
        return t.to_local()
    return t.full_tensor()


def apply(model: nn.Module, mesh: DeviceMesh, plan: dict[str, Any]) -> None:
    """parallelize_module(model, mesh, plan), keeping tied parameters tied."""
    from torch.distributed.tensor.parallel import parallelize_module

    names = _tied_names(model)
    parallelize_module(model, mesh, plan)
    for first, *others in names:
        owner, _, leaf = first.rpartition(".")
        shared = getattr(model.get_submodule(owner), leaf)
        for name in others:
            module, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module), attr, shared)


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


# The functional collectives DTensor issues, by name: each one's payload is its first argument.
_FUNCTIONAL = frozenset(
    {
        "all_reduce",
        "all_reduce_",
        "all_reduce_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "broadcast",
        "broadcast_",
    }
)


def _payload(first: Any) -> int:
    tensors = first if isinstance(first, list | tuple) else [first]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class CollectiveCounter:
    """A TorchDispatchMode over a training step: every functional collective's payload into `meter`,
    and on the steps it times, launch to wait. Counted as kind tensor_parallel, or as `kinds` names
    the process group it runs on (context parallelism's ring: kind context_parallel)."""

    def __init__(self, meter: CommMeter, kinds: dict[str, str] | None = None) -> None:
        self.meter = meter
        self.kinds = kinds or {}
        self.mode = _mode_class()(self)
        self.launched: dict[int, float] = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """One training step under the mode. A launch whose wait the step does not see (waited outside
        the mode) is forgotten with the step: kept, a later tensor at the same address paired with it
        and timed a wait of many steps."""
        self.launched.clear()
        try:
            with self.mode:
                yield
        finally:
            self.launched.clear()

    def seen(self, name: str, args: tuple[Any, ...], out: Any, start: float) -> None:
        if name == "wait_tensor":
            begun = self.launched.pop(id(args[0]), None)
            if begun is not None and self.meter.timing:
                self.meter.interval(begun, time.perf_counter())
            return
        group = next((a for a in reversed(args) if isinstance(a, str)), None)
        self.meter.count(_payload(args[0]), self.kinds.get(group or "", KIND))
        if self.meter.timing:
            for t in out if isinstance(out, list | tuple) else [out]:
                self.launched[id(t)] = start


def _mode_class() -> type:
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __init__(self, counter: CollectiveCounter) -> None:
            super().__init__()
            self.counter = counter

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            if DTensor in types:
                # Let DTensor dispatch first: the collectives it issues inside an op (loss_parallel's
                # all-reduces) then come back through this mode on plain tensors (CommDebugMode's way).
                return NotImplemented
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            if func.namespace == "_c10d_functional":
                name = func._opname
                if name in _FUNCTIONAL or name == "wait_tensor":
                    self.counter.seen(name, args, out, start)
            return out

    return Mode


# ----------------------------------------------------------------------------------------- prediction


def communication(
    model: nn.Module,
    plan: dict[str, Any],
    *,
    tp: int,
    micro_batch: int,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    microbatches: int,
    inter_node: bool,
    param_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    float8: frozenset[str] = frozenset(),
    float8_weights_gathered: bool = False,
) -> list[Collective]:
    """What the plan sends per optimizer step of `microbatches` forward/backward passes of
    `micro_batch` samples each, over `tp` ranks (see the module docstring); `model` on meta.
    `param_dtype`: the dtype FSDP's mixed-precision policy computes in (every parameter cast to it,
    so every activation is in it); `autocast_dtype`: the engine's autocast's (the linear layers'
    products in it); None: as stored. `float8`: the paths of the float8 linear layers (precision fp8),
    whose split tensors' scales are all-reduced (`_float8_scales`); `float8_weights_gathered`: their
    weights arrive cast, with their scales, from FSDP's float8 all-gather."""
    shapes = _module_shapes(model, plan, micro_batch, input_shape, input_dtype, param_dtype, autocast_dtype)
    totals: dict[tuple[str, str, Overlap], list[float]] = {}
    for path, style in plan.items():
        inputs, output, shape = shapes[path]
        given = _arrives_as_dtensor(plan, path)
        module = model.get_submodule(path)
        if moe.is_tensor_parallel_style(style):
            traffic = _moe_traffic(style, inputs[0], output, module, shape)
        else:
            traffic = _style_traffic(style, inputs, output, module, given, param_dtype)
        if path in float8:
            traffic += _float8_scales(style, float8_weights_gathered)
        if _keeps_output_split(style):
            traffic += _loss_parallel_traffic(math.prod(shape[:-1]))
        for t in traffic:
            entry = totals.setdefault((t.what, t.op, t.overlaps), [0.0, 0.0, 0.0])
            counted = t.full / tp if t.op == "all_gather" else t.full  # commbench sizes it by its output
            times = 1 if t.once else microbatches
            entry[0] += t.full * times
            entry[1] += counted * times
            entry[2] += times
    return [
        Collective(what, op, b, tp, calls, overlaps, counted=c, inter_node=inter_node, kind=KIND)
        for (what, op, overlaps), (b, c, calls) in totals.items()
    ]


def _module_shapes(
    model: nn.Module,
    plan: dict[str, Any],
    batch: int,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    param_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, tuple[list[int], int, tuple[int, ...]]]:
    """For each planned module: the byte sizes of its tensor inputs (as they arrive) and of its
    output, and the output's shape, in one forward of `batch` samples on the meta device. Its
    parameters cast to `param_dtype` (FSDP's mixed precision), or each linear layer computing in
    `autocast_dtype` (autocast's rule for matrix products: inputs and weights cast, the output in
    it; every other op as its inputs are), where given."""
    seen: dict[str, tuple[list[int], int, tuple[int, ...]]] = {}
    arrived: dict[str, list[int]] = {}
    handles = []
    for path in plan:

        def before(module: nn.Module, args: Any, path: str = path) -> None:
            arrived.setdefault(path, [_payload(a) for a in args if isinstance(a, torch.Tensor)])

        def hook(module: nn.Module, args: Any, out: Any, path: str = path) -> None:
            first = out[0] if isinstance(out, tuple | list) else out
            seen.setdefault(path, (arrived[path], _payload(out), tuple(first.shape)))

        module = model.get_submodule(path)
        handles.append(module.register_forward_pre_hook(before, prepend=True))
        handles.append(module.register_forward_hook(hook))
    cast: dict[str, torch.Tensor] = {}
    if param_dtype is not None:
        cast = {n: p.to(param_dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    elif autocast_dtype is not None:

        def lower(module: nn.Module, args: Any) -> Any:
            return tuple(a.to(autocast_dtype) if _floating(a) else a for a in args)

        for prefix, module in model.named_modules():
            if isinstance(module, nn.Linear | moe.GroupedExperts):
                handles.append(module.register_forward_pre_hook(lower))
                for name, p in module.named_parameters(prefix=prefix):
                    cast[name] = p.to(autocast_dtype)
    try:
        x = torch.zeros((batch, *input_shape), dtype=dtype, device="meta")
        with torch.no_grad():
            torch.func.functional_call(model, cast, (x,), tie_weights=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def local_shapes(model: nn.Module, plan: dict[str, Any], tp: int) -> dict[int, tuple[int, ...]]:
    """The shape each parameter the plan splits has on one rank (by id; the largest, rank 0's);
    parameters it does not split are absent."""
    out: dict[int, tuple[int, ...]] = {}
    dims = split_dims(model, plan)
    for p in model.parameters():
        dim = dims.get(id(p))
        if dim is not None:
            shape = list(p.shape)
            shape[dim] = -(-shape[dim] // tp)
            out[id(p)] = tuple(shape)
    return out


def split_dims(model: nn.Module, plan: dict[str, Any]) -> dict[int, int]:
    """The dimension the plan splits each parameter on (by id): a column-wise Linear's weight and bias
    on dim 0 (an Embedding's weight on dim 1), a row-wise Linear's weight on dim 1 (its bias whole), a
    row-wise Embedding's weight on dim 0, a MoE layer's experts on their hidden units. Parameters it
    does not split are absent."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: dict[int, int] = {}
    for path, style in plan.items():
        module = model.get_submodule(path)
        if moe.is_tensor_parallel_style(style):  # each expert's hidden units
            assert isinstance(module, moe.MoE)
            for name, dim in moe.GroupedExperts.HIDDEN.items():
                weight = getattr(module.experts, name)
                if weight is not None:
                    out[id(weight)] = dim
            continue
        embedding = isinstance(module, nn.Embedding)
        bias = getattr(module, "bias", None)
        if isinstance(style, ColwiseParallel):
            out[id(module.weight)] = 1 if embedding else 0
            if isinstance(bias, torch.Tensor):
                out[id(bias)] = 0
        elif isinstance(style, RowwiseParallel):
            out[id(module.weight)] = 0 if embedding else 1
    return out


def _arrives_as_dtensor(plan: dict[str, Any], path: str) -> bool:
    """Whether the module at `path` is called with DTensors: an enclosing module's PrepareModuleInput
    hands them on as DTensors, whose gradients then travel back as they are (Partial) to be reduced
    once, at that module's input, rather than at each inner module's."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        outer = plan.get(".".join(parts[:end]))
        if isinstance(outer, PrepareModuleInput) and not outer.use_local_output:
            return True
    return False


def _float8_scales(style: Any, weights_gathered: bool) -> list[_Traffic]:
    """A float8 linear layer split by tensor parallelism casts tensors that each rank holds a part of,
    and a dynamic scale is the whole tensor's: each part's absolute maximum is all-reduced, a float64
    (torchao's amax_to_scale on a DTensor). Per pass: the weight (forward, and again for the input's
    gradient in the backward), unless FSDP's float8 all-gather brought it cast; and the operand split
    on the dimension the product sums over twice (column-wise: the output's gradient, for the input's
    gradient and for the weight's; row-wise: the input, forward and again for the weight's gradient)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, ColwiseParallel | RowwiseParallel):
        return []
    casts = 2 if weights_gathered else 4
    return [_Traffic("float8 scales of split tensors (a float64 each)", "all_reduce", 8.0)] * casts


def _style_traffic(
    style: Any,
    inputs: list[int],
    output: int,
    module: nn.Module,
    arrives_as_dtensor: bool,
    param_dtype: torch.dtype | None = None,
) -> list[_Traffic]:
    """The collectives of one ParallelStyle on a module whose tensor inputs and output are these sizes
    (whole, unsplit tensors); its parameters' gradients in `param_dtype` where given."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out: list[_Traffic] = []
    if isinstance(style, ColwiseParallel | PrepareModuleInput):
        layouts = zip(style.input_layouts or (), style.desired_input_layouts or (), inputs, strict=False)
        for given, want, size in layouts:
            if given is None or want is None:
                continue
            if isinstance(given, Shard) and isinstance(want, Replicate):
                out += [
                    _Traffic("input all-gather (sequence parallel), forward", "all_gather", size),
                    _Traffic("input gradient reduce-scatter (sequence parallel)", "reduce_scatter", size),
                ]
            elif isinstance(style, ColwiseParallel) and _input_has_grad(module) and not arrives_as_dtensor:
                out.append(_Traffic("input gradient all-reduce (column-wise)", "all_reduce", size))
    if isinstance(style, ColwiseParallel) and isinstance(style.output_layouts[0], Replicate):
        out.append(_Traffic("output all-gather (column-wise)", "all_gather", output))
    if isinstance(style, RowwiseParallel):
        layout = style.output_layouts[0]
        if isinstance(layout, Replicate):
            out.append(_Traffic("output all-reduce (row-wise), forward", "all_reduce", output))
        elif isinstance(layout, Shard):
            out += [
                _Traffic("output reduce-scatter (row-wise, sequence parallel)", "reduce_scatter", output),
                _Traffic("output gradient all-gather (sequence parallel)", "all_gather", output),
            ]
    if isinstance(style, SequenceParallel):
        params = sum(
            p.numel() * (p.element_size() if param_dtype is None else param_dtype.itemsize)
            for p in module.parameters()
        )
        if params:  # the norms' weights are replicated: their gradients summed once, after the last pass
            what = "sequence-parallel norms' weight gradient all-reduce, once per step"
            out.append(_Traffic(what, "all_reduce", params, once=True))
    return out


def _moe_traffic(
    style: Any, given: int, output: int, layer: nn.Module, shape: tuple[int, ...]
) -> list[_Traffic]:
    """A MoE layer's (models/moe.py's MoETensorParallel) on an input and output of these sizes (whole)
    and this shape (B, L, dim): each forward, the experts' outputs for every choice the capacity keeps
    summed over the tp ranks; each backward, the routed tokens' gradient summed likewise. With
    sequence parallelism the input is gathered forward and the output's gradient backward (the
    output is split by slicing, which sends nothing)."""
    assert isinstance(layer, moe.MoE)
    length = shape[1]
    routed = moe.routed_per_sequence(layer.cfg, length) / length  # choices per token
    out = [
        _Traffic(
            "experts' outputs all-reduce (expert tensor parallel), forward", "all_reduce", output * routed
        ),
        _Traffic("routed tokens' gradient all-reduce (expert tensor parallel)", "all_reduce", given * routed),
    ]
    if style.sequence_parallel:
        out += [
            _Traffic("input all-gather (sequence parallel), forward", "all_gather", given),
            _Traffic("output gradient all-gather (sequence parallel)", "all_gather", output),
        ]
    return out


def _keeps_output_split(style: Any) -> bool:
    """A column-wise style that hands its output on split (as a DTensor): the head under loss_parallel."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return (
        isinstance(style, ColwiseParallel)
        and not style.use_local_output
        and isinstance(style.output_layouts[0], Shard)
    )


def _loss_parallel_traffic(tokens: int) -> list[_Traffic]:
    """The cross-entropy under loss_parallel on logits split by class, for `tokens` rows: three
    all-reduces of one float32 per row in the forward (the rows' maxima, their sums of exponentials,
    the target's log-probability from the rank that holds it; torch's parallel/loss.py), none in the
    backward, which works on each rank's columns."""
    what = "loss parallel: cross-entropy's max, sum-exp and target all-reduces, forward"
    return [_Traffic(what, "all_reduce", tokens * 4)] * 3


def _input_has_grad(module: nn.Module) -> bool:
    """Whether a module's input carries a gradient back (not an embedding's token ids)."""
    return not isinstance(module, nn.Embedding)

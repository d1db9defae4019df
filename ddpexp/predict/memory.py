"""Memory per rank, predicted from the config alone: no data read, no weights allocated.

The model is built on fake tensors (torch's FakeTensorMode: real shapes and dtypes, no storage), the
strategy says what each rank holds and computes (`Strategy.held`), and from that:

  params, grads   the bytes it holds (its shards), as mem/params_mb and mem/grads_mb count them
  optim_state     the bytes of the parameters whose optimizer state it keeps, times the optimizer's
                  state tensors per parameter (SGD: its momentum buffer, none without momentum; AdamW:
                  two moments), as mem/optim_state_mb counts them
  activations     one micro-batch's forward and backward of what the rank computes, run on fake
                  tensors under ActivationMeter (the same count of saved tensors mem/activations_mb
                  makes in a run, so what this predicts is the shapes, the split over ranks and
                  stages and the schedule, not the counting), times the micro-batches its pipeline
                  schedule keeps in flight. Under tensor parallelism on the model split as the rank
                  splits it, DTensors in a fake process group.
  copies          further copies of the parameters the strategy keeps (local SGD's, DiLoCo's), not
                  measured by a run
  transient       what the same fake forward and backward holds beyond its saved activations at its
                  peak, early in the backward: outputs still referenced (a transformer's logits) and
                  the backward's temporaries (the gradients of those logits), counted by
                  ddpexp.memory.LiveBytes. Not a category a run measures; it is in `peak`, which
                  CUDA's max allocated (mem/peak_mb on a GPU) measures

Why fake tensors for activations rather than a formula per layer type: the shipped models mix
convolutions, pooling, BatchNorm, attention and tied embeddings, activation checkpointing changes what
is kept, and a user's own model has layers no formula lists; running the model's own forward on fake
tensors costs milliseconds and knows all of them.

`model_states` prices model states at any bytes per parameter (the ZeRO paper's mixed-precision Adam:
2 + 2 + 12), for models too large to build even on fake tensors' bookkeeping.

    python -m ddpexp.predict.memory strategy=fsdp dist.nprocs=4 model=gpt_small data=python_stdlib task=lm

prints the prediction for the job those overrides make (pre-flight's plan: its world size and global
batch), one line per rank. What it leaves out: buffers that live only inside a step outside the
model's own forward and backward (the unit FSDP gathers, communication buckets, the optimizer step's),
the allocator's caching, and the framework's own memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..memory import ActivationMeter, LiveBytes
from ..strategies.comm import Held, sequence_part
from .ops import Work

MB = 2**20


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element of each model state."""

    params: float
    grads: float
    optimizer: float


# The ZeRO paper's mixed-precision Adam (Rajbhandari et al. 2020, section 3.1): fp16 parameters and
# gradients, and in the optimizer an fp32 master copy with Adam's two moments (K = 12).
MIXED_ADAM = StateBytes(params=2, grads=2, optimizer=12)


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds of each model state between steps, and of all of them at the step's peak."""

    params: float
    grads: float
    optimizer: float
    in_step: float


def model_states(held: Held, per_parameter: StateBytes, element_size: int) -> ModelStates:
    """The model states of a rank that holds `held` (bytes at `element_size` per element), each state
    priced at `per_parameter` bytes per element."""

    def priced(stored: float, each: float) -> float:
        return stored / element_size * each

    params = priced(held.params, per_parameter.params)
    grads = priced(held.grads, per_parameter.grads)
    optimizer = priced(held.optimized, per_parameter.optimizer)
    alive = held.params if held.in_step is None else held.in_step
    return ModelStates(params, grads, optimizer, priced(alive, per_parameter.params) + grads + optimizer)


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes of one rank, by category."""

    rank: int
    params: float
    grads: float
    optim_state: float
    activations: float
    copies: float
    # The parameters alive on the device at the step's peak (more than `params` where FSDP keeps them
    # gathered; offloaded: only those gathered)
    in_step: float
    transient: float = 0.0
    work: Work | None = None  # one micro-batch's ops (predict(trace=True))
    buffers: float = 0.0  # the strategy's, inside a step (FSDP's gathered units, reduce-scatter buffers)
    samples: float = 0.0  # in one micro-batch's forward
    slots: float = 1.0  # micro-batch slots its critical path takes per micro-batch (a pipeline's bubble)
    offloaded: bool = False  # params, grads and optim_state in host memory (FSDP's offload)

    @property
    def host(self) -> float:
        """What it keeps in host memory: its parameters' shards, their gradients and optimizer state
        where they are offloaded."""
        return self.params + self.grads + self.optim_state if self.offloaded else 0.0

    @property
    def peak(self) -> float:
        """Everything at once on the device at the step's peak: the states (the parameters gathered
        beyond the shards, where offloaded), the activations, the backward's temporaries and the
        copies."""
        states = self.in_step + (0.0 if self.offloaded else self.grads + self.optim_state)
        return states + self.activations + self.transient + self.copies + self.buffers

    def mb(self) -> dict[str, float]:
        """In the units and names of a run's memory_per_rank."""
        return {
            "mem/params_mb": self.params / MB,
            "mem/grads_mb": self.grads / MB,
            "mem/optim_state_mb": self.optim_state / MB,
            "mem/activations_mb": self.activations / MB,
            "mem/host_mb": self.host / MB,
        }


def predict(
    cfg: Any,
    *,
    world: int,
    global_batch: int,
    strategy: Any = None,
    trace: bool = False,
    extrapolate: bool = False,
    nodes: int = 1,
    cache: dict[Any, Run] | None = None,
    model: nn.Module | None = None,
) -> list[RankMemory]:
    """Bytes per rank of the run `cfg` (a composed config, or a run's config.yaml) at `world` ranks and
    `global_batch` samples per optimizer step; `strategy`: a resolved strategy instead of cfg's.
    `trace`: each rank's ops too (`RankMemory.work`). `extrapolate`: a model of identical blocks
    (model.n_layer) whose ranks each run it whole is run with 2 and 3 blocks, and every count
    extended along the line through the two (exact where each block adds the same: the saved
    activations, each op; tests/test_memory_model.py checks it against the whole model's run).
    `cache`: runs kept across calls (a planner predicting many layouts of one job), by what decides
    them: the model, its checkpointing and precision, and each rank's part, split, batch and dtype.
    `model`: the model on the meta device to take what each rank holds from (runs then build their
    own), where the caller has built it already."""
    from omegaconf import OmegaConf

    from .. import strategies
    from ..data import build_source
    from ..optim import optimizer_states
    from ..strategies.comm import Workload

    info = build_source(cfg.data).info()
    strategy = strategy or strategies.resolve(cfg.strategy)
    states = optimizer_states(cfg.optim)
    runner = _Runner(cfg, info, trace=trace)
    on_meta = model is not None
    if model is None:
        model = runner.build()
    job = Workload.of(cfg, info, model, world=world, global_batch=global_batch, nodes=nodes)
    held = strategy.held(job=job)
    # Split copies run as rank 0 of a fake group: a rank's place on the mesh changes only which chunk of
    # an uneven split it holds.
    if any(h.split is not None for h in held):
        _fake_process_group(world)
    blocks = _blocks(cfg) if extrapolate and all(h.chain is None for h in held) else None
    runs: dict[Any, Run] = {} if cache is None else cache
    common = (
        OmegaConf.to_yaml(cfg.model),
        str(cfg.trainer.activation_checkpointing),
        job.precision,
        str(cfg.task.get("name") if hasattr(cfg.task, "get") else cfg.task),
        job.input_shape,
        blocks,
        trace,
    )

    def run_of(rank: int, h: Held, extra: int | None) -> Run:
        key = (common, runner.key(h))
        if key not in runs:
            if blocks is None:
                runs[key] = runner.run(strategy, job, rank, h, None if on_meta else model, extra=extra)
            else:
                two, three = (runner.run(strategy, job, rank, h, None, layers=k) for k in (2, 3))
                runs[key] = two.extended(three, blocks)
        return runs[key]

    out = []
    for rank, h in enumerate(held):
        # A rank running several pipeline stages holds each stage's activations in flight at its peak,
        # and computes all of them a micro-batch.
        each = [(run_of(rank, h, None), h)] + [(run_of(rank, e, i), e) for i, e in enumerate(h.extra)]
        run = each[0][0]
        work = run.work
        if len(each) > 1 and all(r.work is not None for r, _ in each):
            work = Work(tuple(part for r, _ in each if r.work is not None for part in r.work.parts))
        out.append(
            RankMemory(
                rank,
                float(h.params),
                float(h.grads),
                float(h.optimized * states),
                _activations([r for r, _ in each], h),
                float(h.copies),
                float(h.in_step if h.in_step is not None else 0 if h.offloaded else h.params),
                max(r.transient for r, _ in each),
                work,
                float(h.buffers),
                float(h.samples),
                float(h.slots),
                h.offloaded,
            )
        )
    return out


def _activations(runs: list[Run], h: Held) -> float:
    """What a rank's stages hold for their backwards at its peak: each stage's micro-batch times those
    in flight on it and what split backwards keep of those done, at the point of the schedule where they
    weigh most (Held.timeline)."""
    # One backward runs at a time: what it adds while it runs (a recomputation) counts once.
    running = max(r.saved - r.between for r in runs)
    if h.timeline is None:
        return running + sum(r.between * x.in_flight for r, x in zip(runs, [h, *h.extra], strict=True))
    return running + max(
        sum(r.between * live + r.kept * done for r, (live, done) in zip(runs, point, strict=True))
        for point in h.timeline
    )


def _blocks(cfg: Any) -> int | None:
    """The model's block count where it has one (model.n_layer) worth extrapolating from 2 and 3."""
    layers = cfg.model.get("n_layer") if hasattr(cfg.model, "get") else None
    return int(layers) if isinstance(layers, int) and layers > 3 else None


@dataclass(frozen=True)
class Run:
    """What one micro-batch's forward and backward of a rank holds (`saved` for the backward, and
    `transient` beyond that at its peak) and computes (`work`)."""

    saved: float
    transient: float
    work: Work | None = None
    # Of `saved`, what stays held once the weights' gradients are computed, where the backward is split
    # into the inputs' and the weights' (Held.split_backward): it goes with the schedule's step.
    kept: float = 0.0
    # What is held between the forward and the backward (`saved` less what the backward itself adds
    # while it runs: a checkpointed block's recomputation); None: `saved`.
    stored: float | None = None

    @property
    def between(self) -> float:
        return self.saved if self.stored is None else self.stored

    def extended(self, three: Run, blocks: int) -> Run:
        """This run (of two blocks) and `three` (of three) extended to `blocks` along their line: the
        third block is one of the middle, as every block but the first and the last is."""
        a, b = float(3 - blocks), float(blocks - 2)
        two = three
        work = None
        if self.work is not None and two.work is not None:
            work = Work(
                tuple((t, w * a) for t, w in self.work.parts) + tuple((t, w * b) for t, w in two.work.parts)
            )
        return Run(
            max(0.0, a * self.saved + b * two.saved),
            max(0.0, a * self.transient + b * two.transient),
            work,
            max(0.0, a * self.kept + b * two.kept),
            max(0.0, a * self.between + b * two.between),
        )


class _Runner:
    """Builds the model on fake tensors and runs a rank's micro-batch on it; what a chain of stages
    hands on is computed once per part (`_inputs`), and ranks whose own part has the same structure
    (a pipeline's middle stages) are run once."""

    def __init__(self, cfg: Any, info: Any, *, trace: bool) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from .. import tasks
        from ..config import Precision
        from ..engine import AUTOCAST

        self.cfg, self.info, self.trace = cfg, info, trace
        self.task = tasks.build(cfg.task)
        self.meter = ActivationMeter()  # the one checkpointed blocks report their recomputations to
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.autocast_dtype = AUTOCAST[Precision.of(cfg.trainer.precision)]
        self._inputs: dict[tuple[Any, ...], torch.Tensor] = {}
        self._models: dict[tuple[Any, ...], tuple[nn.Module, list[Held]]] = {}
        self._by_structure: dict[tuple[Any, ...], Run] = {}

    def build(self, *, layers: int | None = None, dtype: torch.dtype | None = None) -> nn.Module:
        from omegaconf import OmegaConf

        from .. import activation_checkpointing, float8, models
        from ..config import ActivationCheckpointing, Precision

        spec: Any = self.cfg.model if layers is None else OmegaConf.merge(self.cfg.model, {"n_layer": layers})
        before = torch.get_default_dtype()
        try:
            if dtype is not None:  # FSDP's policy computes with parameters of this dtype
                torch.set_default_dtype(dtype)
            with self.mode:
                model = models.build(spec, self.info)
        finally:
            torch.set_default_dtype(before)
        if Precision.of(self.cfg.trainer.precision) == Precision.fp8:
            with self.mode:
                float8.convert(model, recipe=str(self.cfg.trainer.get("fp8_recipe", "tensorwise")))
        activation_checkpointing.apply(
            model, ActivationCheckpointing(self.cfg.trainer.activation_checkpointing), meter=self.meter
        )
        return model

    def key(self, h: Held) -> tuple[Any, ...]:
        """What decides a rank's run besides the model: its parts (their structure), split, batch,
        loss and dtype."""
        chain = None if h.chain is None else tuple(_structure(part) for part in h.chain)
        split = None if h.split is None else (h.split_key if h.split_key is not None else id(h.split))
        return (
            chain,
            h.samples,
            h.loss,
            split,
            bool(h.loss_context),
            h.param_dtype,
            h.split_backward,
            h.sequence_split,
        )

    def run(
        self,
        strategy: Any,
        job: Any,
        rank: int,
        h: Held,
        model: nn.Module | None,
        *,
        layers: int | None = None,
        extra: int | None = None,
    ) -> Run:
        """Rank `rank`'s micro-batch: on `model` where it runs the model as built and stored, else on a
        copy built for it (of `layers` blocks; split as the rank splits it; in its compute dtype);
        `extra`: of the rank's further stage of that number (Held.extra)."""
        chain = h.chain
        if model is None or h.split is not None or h.param_dtype is not None:
            split = None if h.split is None else (h.split_key if h.split_key is not None else id(h.split))
            built = (layers, h.param_dtype, split)
            if built not in self._models:  # one copy of each kind, whichever ranks run it
                copy = self.build(layers=layers, dtype=h.param_dtype)
                if h.split is not None:
                    h.split(copy)
                self._models[built] = (copy, strategy.held(job=dataclasses.replace(job, model=copy)))
            model, held = self._models[built]
            mine = held[rank] if extra is None else held[rank].extra[extra]
            chain = mine.chain
        parts = (model,) if chain is None else chain
        if not parts or round(h.samples) < 1:
            return Run(0.0, 0.0, Work(()) if self.trace else None)
        x = self._input(parts[:-1], round(h.samples), h.param_dtype, h.sequence_split)
        same = (
            _structure(parts[-1]),
            tuple(x.shape),
            x.dtype,
            h.samples,
            h.loss,
            h.split is None,
            h.param_dtype,
            h.split_backward,
        )
        if chain is not None and same in self._by_structure:
            return self._by_structure[same]
        run = self._stage(parts[-1], x, h) if chain is not None else self._activations(parts[-1], x, h)
        if chain is not None:
            self._by_structure[same] = run
        return run

    def _stage(self, own: nn.Module, x: torch.Tensor, h: Held) -> Run:
        """A pipeline stage's micro-batch. A stage of many identical blocks (a run of 4 or more alike
        children, each handing on a tensor of the shape it took) is run with 2 and with 3 of them and
        extended to all, as `predict(extrapolate=True)` extends a whole model."""
        kids = list(own.children()) if isinstance(own, nn.Sequential) else []
        start, length = _longest_alike(kids)
        if length < 4:
            return self._activations(own, x, h)
        prefix, suffix = kids[:start], kids[start + length :]
        two, three = (
            self._activations(nn.Sequential(*prefix, *kids[start : start + k], *suffix), x, h) for k in (2, 3)
        )
        return two.extended(three, length)

    def _autocast(self, h: Held) -> Any:
        if self.autocast_dtype is None or h.param_dtype is not None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.autocast_dtype)

    def _input(
        self, before: tuple[nn.Module, ...], batch: int, dtype: torch.dtype | None, split: int = 1
    ) -> torch.Tensor:
        """What the parts before a rank's own hand it for a micro-batch of `batch` samples (the model's
        input where there are none; `split`: 1/split of each sample's sequence), each part run once
        whichever stage's chain it is in."""
        shape = sequence_part(tuple(self.info.input_shape), split)
        with self.mode:
            if self.info.vocab_size is not None:
                x = torch.zeros((batch, *shape), dtype=torch.long)
            else:
                x = torch.zeros((batch, *shape))
        for i, part in enumerate(before):
            key = (tuple(map(id, before[: i + 1])), batch, dtype, split)
            if key not in self._inputs:
                with torch.no_grad(), self._autocast(Held(0, 0, 0, param_dtype=dtype)):
                    self._inputs[key] = _handed_on(part, x)
            x = self._inputs[key]
        if before:
            x = x.detach().requires_grad_(x.is_floating_point())
        return x

    def _activations(self, own: nn.Module, x: torch.Tensor, h: Held) -> Run:
        """Peak bytes held for the backward in one micro-batch's forward and backward of `own` from
        input `x` (`meter`'s count), what that forward and backward holds beyond them at its own peak
        (LiveBytes: activations and temporaries, not the model's tensors nor the gradients of its
        parameters, which are their own categories), and with `trace` its ops."""
        from .ops import OpTracer

        batch = x.shape[0]
        tracer = OpTracer(h.sequence_split) if self.trace else None

        def phase(name: str) -> contextlib.AbstractContextManager[Any]:
            return tracer.phase(name) if tracer is not None else contextlib.nullcontext()

        traced = tracer if tracer is not None else contextlib.nullcontext()
        with traced, self.meter.measure(own), LiveBytes(own) as live:
            context = h.loss_context() if h.loss and h.loss_context else contextlib.nullcontext()
            with context:
                with self._autocast(h), phase("forward"):
                    out = own(x)
                with phase("forward"):
                    # The targets made here are freed with the call, as they were measured to be.
                    split = h.sequence_split
                    loss = self.task.loss(out, _targets(self.info, out, batch, split)) if h.loss else None
                stored = float(self.meter.held_bytes)
                with phase("backward"):
                    kept = 0.0
                    if h.split_backward:
                        kept = _split_backward(own, x, out, loss, self.meter)
                    elif loss is not None:
                        loss.backward()
                    else:
                        out.backward(torch.ones_like(out))
        saved = float(self.meter.peak_bytes or 0)
        work = Work(((tracer.trace, 1.0),)) if tracer is not None else None
        return Run(saved, max(0.0, live.peak - saved), work, kept, min(stored, saved))


def _split_backward(
    own: nn.Module, x: torch.Tensor, out: torch.Tensor, loss: torch.Tensor | None, meter: ActivationMeter
) -> float:
    """A zero-bubble schedule's backward, as torch.distributed.pipelining runs it: the inputs'
    gradients (keeping the graph for the weights'), then the weights'; what the meter still counts
    held after the weights' is what the stage keeps until its step ends."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    outputs, grads = ([loss], None) if loss is not None else ([out], [torch.ones_like(out)])
    _, groups = stage_backward_input(outputs, grads, [x], own.parameters())
    stage_backward_weight(own.parameters(), groups)
    return float(meter.held_bytes)


def _handed_on(part: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `part` hands on from `x`, on fake tensors: only shapes and dtypes matter, so of consecutive
    alike children of a Sequential that keep the shape they are given only the first is run."""
    if not isinstance(part, nn.Sequential):
        return part(x)
    before: tuple[Any, ...] | None = None
    for child in part:
        shape = _structure(child)
        if shape == before and x is not None:
            continue  # as the child before: the same shape out as in
        out = child(x)
        kept = isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype
        before = shape if kept else None
        x = out
    return x


def _longest_alike(kids: list[nn.Module]) -> tuple[int, int]:
    """(start, length) of the longest run of consecutive modules of one structure."""
    best, start = (0, 0), 0
    shapes = [_structure(k) for k in kids]
    for i in range(1, len(kids) + 1):
        if i == len(kids) or shapes[i] != shapes[start]:
            if i - start > best[1]:
                best = (start, i - start)
            start = i
    return best


def _structure(part: nn.Module) -> tuple[Any, ...]:
    """What makes two parts compute alike: their modules' types and parameters' shapes and dtypes
    (kept on the module: a planner asks for thousands of ranks' parts)."""
    known = part.__dict__.get("_ddpexp_structure")
    if known is None:
        known = part.__dict__["_ddpexp_structure"] = _structure_of(part)
    return known


def _structure_of(part: nn.Module) -> tuple[Any, ...]:
    return tuple(
        (type(m).__name__, tuple((tuple(p.shape), p.dtype) for p in m.parameters(recurse=False)))
        for m in part.modules()
    )


_fake_world: int | None = None  # the world size of the fake process group this process keeps


def _fake_process_group(world: int) -> None:
    """A process group of at least `world` ranks, this process rank 0, whose collectives do nothing
    (torch's fake backend, which torchtitan's memory estimation uses too): enough for DTensor on fake
    tensors, a mesh of `world` ranks taking the first of them. Kept for the rest of the process, and
    made large once: DTensor caches what it plans by device mesh, and a mesh of a destroyed group
    found there again fails; a larger size than it holds replaces it, those caches cleared."""
    global _fake_world
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if _fake_world is not None and _fake_world >= world and dist.is_initialized():
        return
    if dist.is_initialized():
        if _fake_world is None:
            raise RuntimeError("memory is predicted outside a distributed run (a process group is in force)")
        dist.destroy_process_group()
    if _fake_world is not None:  # replaced, or destroyed by a run in this process since
        _clear_dtensor_caches()
    size = max(world, FAKE_WORLD)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    _fake_world = size


FAKE_WORLD = 1 << 16  # ranks of the fake process group: more than any cluster planned


def fresh_fake_process_group() -> None:
    """Start the next prediction on a new fake process group, DTensor's caches cleared: a caller that
    predicts many layouts (the planner) calls it first, so that nothing done in this process since
    the last one (its groups destroyed, a run's own process group) is found again."""
    global _fake_world
    import torch.distributed as dist

    if _fake_world is not None and dist.is_initialized():
        dist.destroy_process_group()
    if _fake_world is not None:
        _clear_dtensor_caches()
    _fake_world = None


def _clear_dtensor_caches() -> None:
    """DTensor's caches of plans, keyed by device mesh: meshes of equal shape compare equal, so a plan
    cached under an earlier process group would run on that one's groups, gone with it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's copy of the same
    clear_redistribute_planner_cache()
    _gen_transform_infos.cache_clear()


def _targets(info: Any, out: torch.Tensor, batch: int, split: int = 1) -> torch.Tensor:
    if info.targets == "token":
        return torch.zeros((batch, *sequence_part(tuple(info.input_shape), split)), dtype=torch.long)
    if info.targets == "value":
        return torch.zeros(out.shape)
    return torch.zeros(batch, dtype=torch.long)


def predict_run(run: Any) -> list[RankMemory]:
    """The prediction for a run's own config, world size and global batch (a `MeasuredRun`)."""
    if run.config is None:
        from ..errors import UserError

        raise UserError(
            "memory is predicted from a run's config.yaml, and this run has none",
            setting="RUN_DIR",
            fix="give the run directory itself (it holds config.yaml)",
        )
    return predict(
        run.config,
        world=int(run.facts.get("world_size") or 1),
        global_batch=int(run.facts.get("global_batch_size") or 1),
    )


def table(ranks: list[RankMemory]) -> str:
    """One line per rank, MB per category and the peak (the parameters as they are at the step's peak,
    everything else, the backward's temporaries and the strategy's buffers)."""
    head = [
        "rank",
        "params",
        "grads",
        "optimizer",
        "activations",
        "temporaries",
        "copies",
        "buffers",
        "peak MB",
    ]
    lines = []
    for r in ranks:
        cells = [r.params, r.grads, r.optim_state, r.activations, r.transient, r.copies, r.buffers, r.peak]
        lines.append([str(r.rank), *(f"{c / MB:,.3f}" for c in cells)])
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    return "\n".join(
        "  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)) for line in [head, *lines]
    )


USAGE = """usage: python -m ddpexp.predict.memory [KEY=VALUE ...]

Memory per rank (parameters, gradients, optimizer state, activations, peak) predicted for the job the
overrides make, as `python -m ddpexp` takes them, without running it: e.g.
  python -m ddpexp.predict.memory model=llama3_1_8b task=lm data=synthetic_tokens strategy=fsdp dist.nprocs=8
A model of your own: model._target_=mymodule.Net, from the directory that holds mymodule.py."""


def main(argv: list[str] | None = None) -> int:
    """`python -m ddpexp.predict.memory [overrides]`: the prediction for the job the overrides make."""
    import sys

    from .. import composition, validate
    from ..errors import UserError
    from ..plan import HostFacts
    from ..preflight import replaced_settings

    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in overrides):
        print(USAGE)
        return 0
    try:
        with composition.composer() as compose:
            # model._target_=my.Net replaces the option's builder: its settings go, as ddpexp drops them
            cfg = compose([*overrides, *replaced_settings([overrides], compose)])
        p = validate.plan(cfg, HostFacts.probe())
        ranks = predict(cfg, world=p.world_size, global_batch=p.global_batch)
    except UserError as exc:
        print(f"ddpexp.predict.memory: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(
        f"{p.strategy} at {p.world_size} rank(s), global batch {p.global_batch}: memory per rank predicted "
        "(activations: one micro-batch's, times those a pipeline keeps in flight)"
    )
    print(table(ranks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

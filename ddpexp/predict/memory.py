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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..memory import ActivationMeter, LiveBytes
from ..strategies.comm import Held

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


def optimizer_states(optim_cfg: Any) -> int:
    """State tensors per parameter, each the parameter's size: SGD's momentum buffer (none without
    momentum), AdamW's two moments."""
    if str(optim_cfg.name) == "sgd":
        return 1 if optim_cfg.momentum else 0
    return 2


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes of one rank, by category."""

    rank: int
    params: float
    grads: float
    optim_state: float
    activations: float
    copies: float
    in_step: float  # the parameters alive at the step's peak (more than `params` where FSDP keeps them)
    transient: float = 0.0

    @property
    def peak(self) -> float:
        """Everything at once at the step's peak: the states, the activations, the backward's
        temporaries and the copies."""
        return self.in_step + self.grads + self.optim_state + self.activations + self.transient + self.copies

    def mb(self) -> dict[str, float]:
        """In the units and names of a run's memory_per_rank."""
        return {
            "mem/params_mb": self.params / MB,
            "mem/grads_mb": self.grads / MB,
            "mem/optim_state_mb": self.optim_state / MB,
            "mem/activations_mb": self.activations / MB,
        }


def predict(cfg: Any, *, world: int, global_batch: int, strategy: Any = None) -> list[RankMemory]:
    """Bytes per rank of the run `cfg` (a composed config, or a run's config.yaml) at `world` ranks and
    `global_batch` samples per optimizer step; `strategy`: a resolved strategy instead of cfg's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .. import activation_checkpointing, models, strategies, tasks
    from ..config import ActivationCheckpointing, Precision
    from ..data import build_source
    from ..engine import AUTOCAST
    from ..strategies.comm import Workload

    info = build_source(cfg.data).info()
    strategy = strategy or strategies.resolve(cfg.strategy)
    task = tasks.build(cfg.task)
    states = optimizer_states(cfg.optim)
    meter = ActivationMeter()  # the one checkpointed blocks report their recomputations to
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    dtype = AUTOCAST[Precision.of(cfg.trainer.precision)]
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else contextlib.nullcontext

    def build() -> nn.Module:
        with mode:
            model = models.build(cfg.model, info)
        activation_checkpointing.apply(
            model, ActivationCheckpointing(cfg.trainer.activation_checkpointing), meter=meter
        )
        return model

    model = build()
    job = Workload(
        model=model,
        devices=world,
        world=world,
        nodes=1,
        global_batch=global_batch,
        accumulate=int(cfg.trainer.accumulate),
        input_shape=tuple(info.input_shape),
        input_dtype=torch.long if info.vocab_size is not None else torch.float32,
    )
    held = strategy.held(job=job)
    runs: dict[tuple[Any, ...], tuple[float, float]] = {}
    out = []
    # Split copies run as rank 0 of a fake group: a rank's place on the mesh changes only which chunk of
    # an uneven split it holds.
    if any(h.split is not None for h in held):
        _fake_process_group(world)
    for rank, h in enumerate(held):
        key = (None if h.chain is None else tuple(map(id, h.chain)), h.samples, h.loss, h.split is None)
        if key not in runs:
            if h.split is None:
                runs[key] = _activations(model, h.chain, info, task, (mode, autocast), meter, h)
            else:  # on a copy split as the rank splits it
                split = build()
                h.split(split)
                chain = strategy.held(job=dataclasses.replace(job, model=split))[rank].chain
                runs[key] = _activations(split, chain, info, task, (mode, autocast), meter, h)
        out.append(
            RankMemory(
                rank,
                float(h.params),
                float(h.grads),
                float(h.optimized * states),
                runs[key][0] * h.in_flight,
                float(h.copies),
                float(h.params if h.in_step is None else h.in_step),
                runs[key][1],
            )
        )
    return out


_fake_world: int | None = None  # the world size of the fake process group this process keeps


def _fake_process_group(world: int) -> None:
    """A process group of `world` ranks, this process rank 0, whose collectives do nothing (torch's
    fake backend, which torchtitan's memory estimation uses too): enough for DTensor on fake tensors.
    Kept for the rest of the process: DTensor caches what it plans by device mesh, and a mesh of a
    destroyed group would be found there again; a new size replaces it, those caches cleared."""
    global _fake_world
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if _fake_world == world:
        return
    if dist.is_initialized():
        if _fake_world is None:
            raise RuntimeError("memory is predicted outside a distributed run (a process group is in force)")
        dist.destroy_process_group()
        _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    _fake_world = world


def _clear_dtensor_caches() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    clear_redistribute_planner_cache()


def _activations(
    model: nn.Module,
    chain: tuple[nn.Module, ...] | None,
    info: Any,
    task: Any,
    contexts: tuple[Any, Callable[[], Any]],
    meter: ActivationMeter,
    held: Held,
) -> tuple[float, float]:
    """Peak bytes held for the backward in one micro-batch's forward and backward of `chain` (parts of
    `model`, run in turn, the last one the rank's own; None: the whole model), on fake tensors
    (`meter`'s count), and what that forward and backward holds beyond them at its own peak
    (LiveBytes: activations and temporaries, not the model's tensors nor the gradients of its
    parameters, which are their own categories); `contexts`: the fake tensor mode, and the run's
    autocast."""
    mode, autocast = contexts
    parts = (model,) if chain is None else chain
    batch = round(held.samples)
    if not parts or batch < 1:
        return 0.0, 0.0
    with mode:
        if info.vocab_size is not None:
            x = torch.zeros((batch, *info.input_shape), dtype=torch.long)
        else:
            x = torch.zeros((batch, *info.input_shape))
        with torch.no_grad(), autocast():
            for part in parts[:-1]:
                x = part(x)
        if len(parts) > 1:
            x = x.detach().requires_grad_(x.is_floating_point())
        own = parts[-1]
        with meter.measure(own), LiveBytes(own) as live:
            with autocast():
                out = own(x)
            if held.loss:
                with held.loss_context() if held.loss_context else contextlib.nullcontext():
                    task.loss(out, _targets(info, out, batch)).backward()
            else:
                out.backward(torch.ones_like(out))
    saved = float(meter.peak_bytes or 0)
    return saved, max(0.0, live.peak - saved)


def _targets(info: Any, out: torch.Tensor, batch: int) -> torch.Tensor:
    if info.targets == "token":
        return torch.zeros((batch, *info.input_shape), dtype=torch.long)
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
    everything else, and the backward's temporaries)."""
    head = ["rank", "params", "grads", "optimizer", "activations", "temporaries", "copies", "peak MB"]
    lines = []
    for r in ranks:
        cells = [r.params, r.grads, r.optim_state, r.activations, r.transient, r.copies, r.peak]
        lines.append([str(r.rank), *(f"{c / MB:,.3f}" for c in cells)])
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    return "\n".join(
        "  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)) for line in [head, *lines]
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m ddpexp.predict.memory [overrides]`: the prediction for the job the overrides make."""
    import sys

    from .. import composition, validate
    from ..errors import UserError
    from ..plan import HostFacts

    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        with composition.composer() as compose:
            cfg = compose(overrides)
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

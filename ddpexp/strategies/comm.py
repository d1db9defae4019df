"""Measuring gradient communication: how long the reductions keep the wire busy, and how many bytes.

DDP (and ddp_mp, zero) wrap their communication hook (DDP's standard averaging all-reduce, or the
compression hook strategy.comm_hook chose) in `timed_hook`, which records, per bucket, the host time
from the hook's call to the reduction's completion callback, and the bytes of the tensors that hook
all-reduces for the bucket (the payload each rank contributes, not a ring's 2(W-1)/W wire traffic), so
compression shows as fewer bytes. naive_allreduce times its own all-reduce calls. fsdp wraps the
all-gathers and reduce-scatters of its units (`fsdp.metered_collectives`). DDP's broadcast of the
buffers before each forward and ZeroRedundancyOptimizer's broadcast of the updated parameters after each
step are synchronous, and `timed_call` times them where DDP and ZeRO issue them. Overlapping
intervals (buckets in flight together) are merged, so the busy time is wall-clock time during which at
least one reduction was running; with DDP much of it overlaps the backward pass. On CUDA the completion
callback is when the host learns of completion, so the times are host-observed.

Bytes are counted on every step. Time is measured on a sample of steps (trainer.time_comm_every_steps:
one optimizer step in k, the first of each epoch among them; the engine says when a step starts), and
the busy time of the epoch is estimated from it: busy time of the timed steps x steps / timed steps.
Timing a DDP bucket costs a Python completion callback (and, on CUDA, a host synchronisation where a
strategy times its own all-reduce); sampling keeps that off the other k-1 steps, whose collectives
run untimed. DDP's hook itself, being Python, still runs on every step: on a CPU that is most of the
meter's cost (scripts/comm_meter_cost.py measures it). A collective that runs on some steps only
(local SGD's and DiLoCo's, every H steps) is timed every time instead (`record_unsampled`), since a
sample of one step in k would miss it or catch it by chance; it is rare enough to cost nothing.

`Collective`, `Workload` and `Held` (at the end) are what strategies describe their communication and
memory with for the cost model (`Strategy.communication`, `Strategy.held`, ddpexp.predict):
`Collective.counted` is what this module's meters count for it, so a prediction compares one for one
with a measurement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from ..commbench import Op

# What the bytes were: gradients (DDP buckets, reduce-scatters, pushes to a server), parameters
# (all-gathers, pulls from a server, ZeRO's broadcasts of the updated shards), synchronized BatchNorm's
# statistics, buffers (DDP's broadcast of rank 0's BatchNorm statistics before each forward),
# tensor_parallel (what tensor parallelism sends: layers' inputs and outputs and their gradients, and
# the sequence-parallel norms' weight gradients), and activations (a pipeline stage's outputs to the
# next stage and their gradients back: counted, not timed, since the schedule sends them
# asynchronously; the waits for them are in pipe/bubble_frac), and offload (FSDP's copies between host
# and device memory under strategy.offload: each shard to the device before its all-gather, each reduced
# gradient shard back: counted, not timed), and context_parallel (the keys and values context
# parallelism's ring attention gathers, and their gradients it rotates), and expert parallelism's
# all-to-alls: expert_dispatch (tokens to their experts' ranks with their counts, and in the backward
# the outputs' gradients the same way) and expert_combine (the outputs back, and the tokens' gradients).
KINDS = (
    "gradients",
    "parameters",
    "sync_bn",
    "buffers",
    "tensor_parallel",
    "activations",
    "offload",
    "context_parallel",
    "expert_dispatch",
    "expert_combine",
)


class CommMeter:
    """Bytes by kind and busy intervals of one rank's collectives, since the last `take`.

    `timing` says whether the current step is one the meter times. A strategy that times a collective
    synchronously calls `record`, which honours it; one that times asynchronously (a completion
    callback) checks `timing` when it launches, counts the bytes with `count` then, and adds the
    interval with `interval` on completion, whenever that is."""

    def __init__(self) -> None:
        self.timing = True  # until the engine says steps begin: time everything
        self._steps = self._timed = 0
        self._intervals: list[tuple[float, float]] = []
        self._unsampled: list[tuple[float, float]] = []  # record_unsampled's, timed on every step
        self._windows: list[tuple[float, float]] = []  # the timed steps', begin to end
        self._window_start: float | None = None
        self._bytes = dict.fromkeys(KINDS, 0)
        self._paused = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Count and time nothing inside: communication that is not a training step's (a pipeline
        schedule's one-off inference of its stages' shapes)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def begin_step(self, every: int = 1) -> None:
        """An optimizer step starts: time it if it is one in `every` (the first after `take` is)."""
        self.timing = self._steps % every == 0
        self._steps += 1
        self._timed += self.timing
        self._window_start = time.perf_counter() if self.timing else None

    def end_step(self) -> None:
        """The step's collectives are done (its optimizer step ran): time nothing until the next."""
        if self.timing and self._window_start is not None:
            self._windows.append((self._window_start, time.perf_counter()))
        self.timing = False
        self._window_start = None

    def count(self, nbytes: int, kind: str = "gradients") -> None:
        if not self._paused:
            self._bytes[kind] += nbytes

    def interval(self, start: float, end: float) -> None:
        if not self._paused:
            self._intervals.append((start, end))

    def record(self, start: float, end: float, nbytes: int, kind: str = "gradients") -> None:
        """A collective that ran from `start` to `end` (perf_counter), synchronously: its bytes always,
        its interval when this step is timed."""
        self.count(nbytes, kind)
        if self.timing:
            self.interval(start, end)

    def record_unsampled(self, start: float, end: float, nbytes: int, kind: str = "gradients") -> None:
        """A synchronous collective that runs on some steps only (every H-th: local SGD, DiLoCo). A
        sample of one step in k would miss it or catch it by chance, so it is timed every time it runs
        and its time is added to the busy time as it is, not scaled."""
        self.count(nbytes, kind)
        if not self._paused:
            self._unsampled.append((start, end))

    def take(self) -> tuple[float, dict[str, int]]:
        """(busy seconds, bytes by kind) since the last call: the busy time is the timed steps'
        scaled to every step (exact when every step was timed), plus the unsampled collectives'."""
        busy, nbytes, _ = self.take_with_share(math.inf)
        return busy, nbytes

    def take_with_share(self, elapsed: float) -> tuple[float, dict[str, int], float]:
        """take's, and the share of the `elapsed` seconds with a collective of this rank running: of
        the timed steps' own wall time, the part some collective covered (a fraction of like with
        like, whichever steps were timed and however their collectives overlap or finish on other
        threads), with the unsampled collectives' time beside it. At most 1 by construction."""
        timed = _merged(self._intervals)
        busy = timed * self._steps / self._timed if self._timed else timed
        unsampled = _merged(self._unsampled)
        busy += unsampled
        window = sum(end - start for start, end in self._windows)
        sampled = (
            _within(self._intervals, self._windows) / window if window > 0 else min(timed / elapsed, 1.0)
        )
        outside = min(unsampled / elapsed, 1.0) if elapsed > 0 else 0.0
        share = outside + (1 - outside) * sampled
        nbytes = self._bytes
        self._intervals, self._unsampled, self._bytes = [], [], dict.fromkeys(KINDS, 0)
        self._windows, self._window_start = [], None
        self._steps = self._timed = 0
        self.timing = True
        return busy, nbytes, share


def _within(intervals: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """Seconds of the windows during which at least one of the intervals ran."""
    return sum(
        _merged([(max(a, start), min(b, end)) for a, b in intervals if a < end and b > start])
        for start, end in windows
    )


def _merged(intervals: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of the intervals ran."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy


def record_when_done(meter: CommMeter, work: Any, start: float, nbytes: int, kind: str = "gradients") -> None:
    """Record a collective launched at `start` when it completes: now if it ran synchronously (no
    Work), else from its future's completion callback, which only a timed step pays for."""
    if work is None:
        meter.record(start, time.perf_counter(), nbytes, kind)
        return
    meter.count(nbytes, kind)
    if not meter.timing:
        return

    def done(f: torch.futures.Future[Any]) -> None:
        meter.interval(start, time.perf_counter())

    work.get_future().then(done)


def timed_call(meter: CommMeter, inner: Callable[..., Any], nbytes: Callable[[], int], kind: str) -> Any:
    """`inner` (a synchronous collective, e.g. a bound method that broadcasts), its bytes counted with
    `nbytes()` on every call and its time recorded on the steps the meter times."""

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        meter.record(start, time.perf_counter(), nbytes(), kind)
        return out

    return call


# A function of a DDP GradBucket: the bytes of the tensors a hook all-reduces for it.
SentBytes = Callable[[Any], int]


def timed_hook(meter: CommMeter, inner: Any, sent_bytes: SentBytes) -> Any:
    """A DDP communication hook: `inner(state, bucket)` (any DDP hook: the default all-reduce, a
    compression hook, PowerSGD), its bytes counted with `sent_bytes(bucket)` on every step, timed on the
    steps the meter times."""

    # No annotations here: DDP inspects them and accepts only the real types (or none at all).
    def hook(state, bucket):
        meter.count(sent_bytes(bucket))  # before `inner`: PowerSGD advances its iteration inside it
        if not meter.timing:
            return inner(state, bucket)
        start = time.perf_counter()
        fut = inner(state, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            meter.interval(start, time.perf_counter())
            return f.value()

        return fut.then(done)

    return hook


def buffer_bytes(dtype: torch.dtype | None = None) -> SentBytes:
    """The whole bucket, in its own dtype (the default all-reduce) or cast to `dtype` (fp16/bf16
    compression: 2 bytes per gradient element instead of 4)."""

    def sent(bucket: Any) -> int:
        buffer = bucket.buffer()
        size = buffer.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size()
        return int(buffer.numel() * size)

    return sent


def powersgd_bytes(state: Any) -> SentBytes:
    """What torch's powerSGD_hook sends for a bucket, read from its PowerSGDState. Before
    `start_powerSGD_iter` (counted in optimizer steps: state.iter) it all-reduces the whole bucket.
    After: every gradient is viewed as an n x m matrix (n = its first dimension, m = the rest; a 1-D
    bias is n x 1); with r = min(n, m, matrix_approximation_rank) it is compressed when
    (n + m) * r * min_compression_rate < n * m, and then sends P (n x r) and Q (m x r), i.e.
    (n + m) * r elements; every other gradient (biases, small matrices) is all-reduced in full. Bytes
    = those elements x the gradients' element size. Nothing else is counted (no error-feedback or
    warm-start memory: those stay local)."""

    def sent(bucket: Any) -> int:
        buffer = bucket.buffer()
        if state.iter < state.start_powerSGD_iter:
            return int(buffer.numel() * buffer.element_size())
        shapes = [tuple(g.shape) for g in bucket.gradients()]
        elements = powersgd_elements(shapes, state.matrix_approximation_rank, state.min_compression_rate)
        return elements * buffer.element_size()

    return sent


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float) -> int:
    """Elements PowerSGD sends per step for gradients of these shapes (see powersgd_bytes)."""
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        numel = math.prod(shape)
        m = numel // n if n else 0
        r = min(n, m, rank)
        compressed = (n + m) * r
        total += compressed if compressed * min_compression_rate < numel else numel
    return total


# ----------------------------------------------------------------------------------------- cost model
# What a strategy sends per optimizer step, described for the cost model (ddpexp.predict, which turns
# it into time with an interconnect's latency and bandwidth). Each strategy module says what it sends in
# its `communication` method, next to the code that sends it.

# The operations, named and sized as ddpexp.commbench (and nccl-tests) name and size them: its `Op` is
# the one definition (ddpexp.commbench's __init__ is pure Python: no torch, nothing of ddpexp).
COLLECTIVE_OPS: tuple[str, ...] = tuple(op.value for op in Op)


class Overlap(StrEnum):
    """What a communication can hide behind: nothing (it runs between compute), the forward pass (FSDP's
    prefetched all-gathers) or the backward pass (DDP's bucketed all-reduces, FSDP's reduce-scatters)."""

    none = "none"
    forward = "forward"
    backward = "backward"


# The share of a step's compute each pass takes: the backward about twice the forward's for dense
# layers (the gradients of the inputs and of the weights). What a communication overlapping a pass
# can hide behind, or follows.
PASS_SHARE = {Overlap.forward: 1 / 3, Overlap.backward: 2 / 3}


@dataclass(frozen=True)
class Collective:
    """One kind of communication a strategy does in every optimizer step.

    `bytes` is the whole step's traffic of this kind, all `calls` together, sized as commbench sizes
    one operation (nccl-tests' convention): all_reduce and broadcast the buffer; all_gather the gathered
    output (W x each rank's shard); reduce_scatter the input each rank reduces; sendrecv what crosses
    the busiest link (a ring: what each rank sends; a parameter server: every message, through rank 0).
    `ranks` take part (a sendrecv's cost does not depend on it). `calls` are separate launches, each
    paying the latency. `counted` is what `comm/bytes_per_step` counts for it (the bytes each rank's
    meter records, averaged over the ranks; 0 where ddpexp does not meter it), so that a prediction and
    a measurement compare one for one. `inter_node`: its slowest link runs between machines.
    """

    what: str
    op: str
    bytes: float
    ranks: int
    calls: float = 1  # per step on average: 1/H for a collective issued every H steps
    overlaps: Overlap = Overlap.none
    counted: float = 0.0
    inter_node: bool = False
    timed: bool = True  # False: the meter counts its bytes but not its time (comm/time_per_step_s)
    # Where it spans nodes: its ranks on each node, which share the node's network adapters (a ring
    # crossing nodes on k rails moves k times one adapter's bytes).
    per_node: int = 1
    # A copy between the device's memory and its host's (offload), over the device's host link (PCIe)
    # rather than the fabric: op sendrecv, `bytes` what crosses it.
    host: bool = False
    # The meter's kind it is counted under (KINDS), where a check tells kinds apart; None: not told.
    kind: str | None = None

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ValueError(f"unknown collective {self.op!r}: one of {', '.join(COLLECTIVE_OPS)}")


@dataclass(frozen=True)
class Workload:
    """The job a strategy's cost model describes: the model (on the meta device: shapes, no weights)
    and the size of the run it is asked about."""

    model: nn.Module
    devices: int  # in all, every process's
    world: int  # processes (ranks)
    nodes: int
    global_batch: int
    accumulate: int = 1  # micro-batches per optimizer step
    device_type: str = "cpu"
    input_shape: tuple[int, ...] | None = None  # one sample (DataInfo.input_shape)
    input_dtype: torch.dtype = torch.float32  # token ids: torch.long
    precision: str = "fp32"  # trainer.precision: fp32, bf16, fp16
    # trainer.activation_checkpointing: under full, each block's forward runs again in its backward,
    # and sends again what its forward sends (context parallelism's gathers).
    activation_checkpointing: str = "none"
    fp8_all_gather: bool = False  # trainer.fp8_all_gather: FSDP gathers the float8 layers' weights in float8

    @classmethod
    def of(
        cls, cfg: Any, info: Any, model: nn.Module, *, world: int, global_batch: int, nodes: int = 1
    ) -> Workload:
        """The job a composed config (or a run's config.yaml) describes, for its data's `info`, on
        `model` (on the meta device), at `world` ranks on `nodes` machines and `global_batch`."""
        from ..config import Precision

        return cls(
            model=model,
            devices=world,
            world=world,
            nodes=nodes,
            global_batch=global_batch,
            accumulate=int(cfg.trainer.accumulate),
            input_shape=tuple(info.input_shape),
            input_dtype=torch.long if info.vocab_size is not None else torch.float32,
            precision=Precision.of(cfg.trainer.precision).name,
            activation_checkpointing=str(cfg.trainer.activation_checkpointing),
            fp8_all_gather=bool(cfg.trainer.get("fp8_all_gather", False)),
        )

    @property
    def gathers_float8(self) -> bool:
        """Whether FSDP gathers the float8 layers' weights in float8 (fp8_all_gather under fp8)."""
        return self.fp8_all_gather and self.precision == "fp8"

    @property
    def procs_per_node(self) -> int:
        return max(self.world // max(self.nodes, 1), 1)

    def spans_nodes(self, ranks: int) -> bool:
        """Whether `ranks` consecutive ranks sit on more than one machine."""
        return self.nodes > 1 and ranks > self.procs_per_node


@dataclass(frozen=True)
class Held:
    """What one rank holds of the model's states between steps and what it computes in a step: what
    ddpexp.predict.memory predicts its memory from. Bytes as the parameters are stored; the optimizer's
    state is priced from `optimized` by the optimizer (SGD's momentum, Adam's two moments)."""

    params: int  # mem/params_mb: the parameters (its shards) it holds
    grads: int  # mem/grads_mb: their gradients after a step's backward
    optimized: int  # the parameters whose optimizer state it keeps (ZeRO: its partition)
    # Parameters alive at a step's peak where more than `params` (FSDP without resharding keeps each
    # unit it gathered from the forward to the backward); None: `params`.
    in_step: int | None = None
    copies: int = 0  # further copies of parameters it keeps outside mem/* (local SGD's average)
    # What it holds only inside a step, at the step's peak, outside the model's forward and backward
    # (FSDP's gathered units and reduce-scatter buffers, `fsdp.gathered_bytes`).
    buffers: int = 0
    # What it runs forward: parts run in turn from the model's input, the last one its own (a pipeline
    # stage's input comes from the stages before); None: the whole model; (): nothing.
    chain: tuple[nn.Module, ...] | None = None
    samples: float = 0.0  # samples in one micro-batch's forward
    in_flight: int = 1  # micro-batches whose activations are held at once (a pipeline schedule's)
    loss: bool = True  # whether it computes the loss on its outputs
    # How its copy of the model is split before it runs, where its activations are not the whole
    # model's (tensor parallelism: parallelize_module on a device mesh, which the prediction makes in
    # a fake process group of the job's world size); None: as built.
    split: Callable[[nn.Module], None] | None = None
    split_key: Any = None  # what tells splits apart: ranks whose keys are equal split alike
    # Where its loss and the loss's backward run, if not plainly (tensor parallelism's loss_parallel).
    loss_context: Callable[[], AbstractContextManager[Any]] | None = None
    # The dtype its parameters are computed in where the strategy casts them itself (FSDP's
    # mixed-precision policy), with no autocast; None: as stored, under the run's autocast.
    param_dtype: torch.dtype | None = None
    # Micro-batch slots its critical path takes per micro-batch it runs: a pipeline's bubble, (m + p - 1)
    # / m for m micro-batches over p stages; 1 where nothing waits.
    slots: float = 1.0
    # The further pipeline stages it runs (several stages per rank), each with its own chain, in-flight
    # micro-batches and loss; their parameters, gradients and optimizer state are counted in this one's.
    extra: tuple[Held, ...] = ()
    # With extra stages: (micro-batches in flight, micro-batches whose split backward is done) on each
    # of its stages ([self, *extra]) after each computation of its step (pipeline.stage.in_flight); its
    # peak is the point whose activations weigh most (None: each stage's in_flight at once).
    timeline: tuple[tuple[tuple[int, int], ...], ...] | None = None
    # Whether its backward is split into the inputs' and the weights' gradients (the zero-bubble
    # schedules): each stage keeps part of a micro-batch's activations until the step ends, and its
    # timeline counts (in flight, done) per stage.
    split_backward: bool = False
    # Whether its parameters, gradients and optimizer state live in host memory (FSDP's offload), the
    # device holding only what a step gathers and computes.
    offloaded: bool = False
    # Ranks each sample's sequence is split over (context parallelism): it runs 1/N of every sample's
    # tokens.
    sequence_split: int = 1

    @classmethod
    def replica(cls, model: nn.Module, samples: float, **changes: Any) -> Held:
        """A whole copy of the model, every trained parameter with its gradient and optimizer state."""
        trained = parameter_bytes(model)
        base = {"params": all_parameter_bytes(model), "grads": trained, "optimized": trained}
        return cls(**{**base, "samples": samples, **changes})


def sequence_part(shape: tuple[int, ...], split: int) -> tuple[int, ...]:
    """One sample's shape (sequence first) as a rank holds it when its sequence is split over `split`
    ranks (Held.sequence_split)."""
    return shape if split == 1 or not shape else (shape[0] // split, *shape[1:])


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors` together."""
    return sum(t.numel() * t.element_size() for t in tensors)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the trained parameters (what a gradient all-reduce carries, uncompressed)."""
    return tensor_bytes(p for p in model.parameters() if p.requires_grad)


def all_parameter_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, frozen ones too (what ZeRO is given, and broadcasts)."""
    return tensor_bytes(model.parameters())


def buffer_bytes_of(model: nn.Module) -> int:
    """Bytes of the model's buffers (BatchNorm statistics)."""
    return tensor_bytes(model.buffers())

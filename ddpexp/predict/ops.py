"""What one micro-batch's forward and backward computes, op by op, recorded on fake tensors: each op's
kind, FLOPs and bytes moved (`Trace`), which `ddpexp.predict.device` turns into time on a device.

The trace is recorded while ddpexp.predict.memory runs the model on fake tensors (the same run that
counts its activations), so it sees what a run executes: every matmul at its shape and dtype (a
tensor-parallel rank's local shard of it), attention, the element-wise ops of norms, activations,
residuals, casts and the loss, the backward's ops and what activation checkpointing recomputes.

  matmul     mm, addmm, bmm, baddbmm, convolutions: 2 M N K FLOPs (torch.utils.flop_counter's
             formulas), and (M, N, K) for the device's efficiency at that shape
  attention  scaled_dot_product_attention's kernels, forward and backward (torch's formulas: the
             backward recomputes the scores, 2.5 times the forward's FLOPs), half of it under a
             causal mask, which a flash kernel skips; under context parallelism a rank's queries
             meet every rank's keys around the ring: cp times its own part's
  memory     every other op that makes or writes a tensor: bytes read and written, the time the
             device's memory takes to move them
  views and metadata (view, transpose, detach, device queries) move nothing and are left out.

`fused` models torch.compile: connected element-wise ops of one pass become one kernel that reads what
enters it from outside and writes what leaves it, the tensors in between never reaching memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})
CONVOLUTIONS = frozenset({"convolution", "_convolution", "convolution_backward"})
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
# Ops that read no tensor data however they are dispatched.
METADATA = frozenset({"device", "size", "stride", "numel", "dim", "sym_size", "sym_stride", "sym_numel"})


@dataclass(frozen=True)
class Op:
    """One op of a trace. `reads` and `writes`: (storage, bytes) of the tensors it reads and makes or
    writes, for fusion; `shape`: a matmul's (batch, M, N, K)."""

    kind: str  # matmul | attention | memory
    name: str
    phase: str  # forward | backward
    flops: float = 0.0
    bytes: float = 0.0
    element_size: int = 4  # of a matmul's or attention's inputs (what its peak is for)
    shape: tuple[int, int, int, int] | None = None
    reads: tuple[tuple[int, int], ...] = ()
    writes: tuple[tuple[int, int], ...] = ()
    ring: int = 1  # attention: the context-parallel ranks whose keys it meets (1: its own only)


@dataclass
class Trace:
    """The ops of one micro-batch's forward and backward on one rank, in order."""

    ops: list[Op] = field(default_factory=list)

    def flops(self, kind: str | None = None) -> float:
        return sum(op.flops for op in self.ops if kind is None or op.kind == kind)

    def fused(self) -> list[Op]:
        """The ops as torch.compile would run them: matmuls and attention as they are; memory ops of one
        pass joined into one kernel where one reads what another made and nothing between them forbids
        it (an op of the kernel cannot wait on a matmul that waits on the kernel: a block's residual add
        stays apart from the next block's), each kernel reading the bytes that enter it and writing
        those that leave it (read by an op outside it, or by none: kept for later, as the backward's
        saved tensors are). Kept once computed."""
        if self._fused is None:
            self._fused = _fuse(self.ops)
        return self._fused

    _fused: list[Op] | None = field(default=None, repr=False, compare=False)


def _fuse(ops: list[Op]) -> list[Op]:
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    maker: dict[int, int] = {}  # storage -> the op that last wrote it
    needs: dict[int, set[int]] = {}  # storage -> the memory ops it was made from (transitively)
    for i, op in enumerate(ops):
        inputs = [key for key, _ in op.reads if key in maker]
        if op.kind == "memory":
            parent[i] = i
            for key in inputs:
                j = maker[key]
                if ops[j].kind != "memory" or ops[j].phase != op.phase:
                    continue
                group = root(j)
                # Legal only if no other input waits, through something outside, on that group.
                others = [k for k in inputs if root_of(maker[k], parent, root) != group]
                if all(group not in {root(x) for x in needs.get(k, ())} for k in others):
                    parent[root(i)] = group
        made_from: set[int] = set().union(*(needs.get(k, set()) for k in inputs)) if inputs else set()
        if op.kind == "memory":
            made_from = made_from | {i}
        for key, _ in op.writes:
            maker[key] = i
            needs[key] = made_from
    groups: dict[int, list[int]] = {}
    for i in parent:
        groups.setdefault(root(i), []).append(i)
    readers: dict[int, set[int]] = {}  # storage -> the groups (or -1: a matmul) that read it
    group_of = {i: root(i) for i in parent}
    for i, op in enumerate(ops):
        for key, _ in op.reads:
            readers.setdefault(key, set()).add(group_of.get(i, -1))
    out: list[Op] = []
    done: set[int] = set()
    for i, op in enumerate(ops):
        if op.kind != "memory":
            out.append(op)
            continue
        g = group_of[i]
        if g in done:
            continue
        done.add(g)
        members = groups[g]
        made = {key for j in members for key, _ in ops[j].writes}
        read_in = {key: b for j in members for key, b in ops[j].reads if key not in made}
        written = {
            key: b
            for j in members
            for key, b in ops[j].writes
            if readers.get(key, set()) - {g} or not readers.get(key)
        }
        moved = sum(read_in.values()) + sum(written.values())
        out.append(Op("memory", f"fused({len(members)})", op.phase, bytes=moved))
    return out


def root_of(i: int, parent: dict[int, int], root: Any) -> int:
    """`i`'s group where it is a memory op, else -1 - i (an op of no group)."""
    return root(i) if i in parent else -1 - i


@dataclass(frozen=True)
class Work:
    """One micro-batch's ops on a rank: a trace, or traces weighted (a model of identical blocks
    extended from runs of 2 and 3 blocks: (3 - L) x the first + (L - 2) x the second)."""

    parts: tuple[tuple[Trace, float], ...]

    def flops(self, kind: str | None = None) -> float:
        return sum(w * t.flops(kind) for t, w in self.parts)


def _local(t: Any) -> Any:
    """What holds `t`'s elements: a DTensor's local shard; a float8 tensor's (torchao's
    Float8TrainingTensor, trainer.precision=fp8) 1-byte data, whatever dtype it presents."""
    local = getattr(t, "_local_tensor", None)
    t = t if local is None else local
    data = getattr(t, "_data", None)
    return data if isinstance(data, torch.Tensor) and hasattr(t, "_scale") else t


def _key(t: torch.Tensor) -> int | None:
    t = _local(t)
    if t.is_meta:
        return None
    try:
        return int(t.untyped_storage()._cdata)
    except (NotImplementedError, RuntimeError):
        return None


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an op moves for `t`: its elements, no more than its storage (a broadcast reads less)."""
    t = _local(t)
    size = t.numel() * t.element_size()
    try:
        return min(size, t.untyped_storage().nbytes()) if size else 0
    except (NotImplementedError, RuntimeError):
        return size


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else default
    return default


class OpTracer(TorchDispatchMode):
    """Records each op dispatched inside (`trace`), in the pass set by `phase()`. `ring`: the ranks a
    context-parallel ring spreads each sequence over, where the traced run holds one rank's part: its
    attention meets every rank's keys, `ring` times the part's."""

    def __init__(self, ring: int = 1) -> None:
        super().__init__()
        self.trace = Trace()
        self.ring = ring
        self._phase = "forward"
        # A storage's address can be reused once it is freed: each storage an op makes gets an id of
        # its own, so that a later tensor at the same address is never taken for an earlier one.
        self._ids: dict[int, int] = {}
        self._next = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = self._op(func, args, kwargs, out)
        if op is not None:
            self.trace.ops.append(op)
        return out

    def _op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Op | None:
        name = func.__name__.split(".")[0]
        if name in METADATA or getattr(func, "is_view", False):
            return None
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        given = {_key(t) for t in inputs}
        made = [t for t in outputs if _key(t) not in given]
        mutated = func._schema.is_mutable
        if not made and not mutated:
            return None  # a view under another name (_unsafe_view, alias): nothing moved
        for t in made:
            if (k := _key(t)) is not None:
                self._next += 1
                self._ids[k] = self._next
        reads = tuple((self._id(k), _nbytes(t)) for t in inputs if (k := _key(t)) is not None)
        writes = tuple((self._id(k), _nbytes(t)) for t in (made or outputs) if (k := _key(t)) is not None)
        moved = float(sum(b for _, b in reads) + sum(b for _, b in writes))
        if name in MATMULS or name in CONVOLUTIONS:
            return self._matmul(func, name, inputs, outputs, moved, reads, writes)
        if any(part in name for part in ATTENTION):
            return self._attention(func, name, args, kwargs, inputs, moved, reads, writes)
        return Op("memory", name, self._phase, bytes=moved, reads=reads, writes=writes)

    def _id(self, key: int) -> int:
        if key not in self._ids:
            self._next += 1
            self._ids[key] = self._next
        return self._ids[key]

    def _matmul(
        self,
        func: Any,
        name: str,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        moved: float,
        reads: tuple[tuple[int, int], ...],
        writes: tuple[tuple[int, int], ...],
    ) -> Op:
        from torch.utils.flop_counter import flop_registry

        local_in = [_local(t) for t in inputs]
        shape: tuple[int, int, int, int] | None = None
        if name in ("mm", "addmm", "_scaled_mm"):
            a, b = (local_in[1], local_in[2]) if name == "addmm" else (local_in[0], local_in[1])
            shape = (1, a.shape[0], b.shape[1], a.shape[1])
        elif name in ("bmm", "baddbmm"):
            a, b = (local_in[1], local_in[2]) if name == "baddbmm" else (local_in[0], local_in[1])
            shape = (a.shape[0], a.shape[1], b.shape[2], a.shape[2])
        if shape is not None:
            flops = 2.0 * math.prod(shape)
        else:
            count = flop_registry.get(func._overloadpacket)
            shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in local_in]
            out_shape = tuple(_local(outputs[0]).shape) if outputs else None
            try:
                flops = float(count(*shapes, out_shape=out_shape)) if count else 0.0
            except Exception:  # a formula that wants the op's other arguments: counted as memory
                return Op("memory", name, self._phase, bytes=moved, reads=reads, writes=writes)
        element = min((t.element_size() for t in local_in if t.is_floating_point()), default=4)
        return Op("matmul", name, self._phase, flops, moved, element, shape, reads, writes)

    def _attention(
        self,
        func: Any,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
        moved: float,
        reads: tuple[tuple[int, int], ...],
        writes: tuple[tuple[int, int], ...],
    ) -> Op:
        from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

        q, k, v = (
            tuple(_local(_argument(func, args, kwargs, n, None)).shape) for n in ("query", "key", "value")
        )
        backward = "backward" in name
        if backward:
            grad = tuple(_local(_argument(func, args, kwargs, "grad_out", inputs[0])).shape)
            flops = float(sdpa_backward_flop_count(grad, q, k, v))
        else:
            flops = float(sdpa_flop_count(q, k, v))
        causal = bool(_argument(func, args, kwargs, "is_causal", False))
        if causal:
            flops /= 2  # a flash kernel skips the masked half of the scores
        # Ring attention: this part's queries against all the keys, causal half skipped (load-balanced).
        flops *= self.ring
        element = _local(inputs[0]).element_size()
        return Op("attention", name, self._phase, flops, moved, element, None, reads, writes, self.ring)

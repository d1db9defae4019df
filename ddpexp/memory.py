"""Bytes on this rank, by category, counted from the tensors themselves (the local shard of a sharded
tensor), so they mean the same on CPU and GPU and show what sharding and checkpointing save:

  params      the model's parameters as this rank holds them between steps (FSDP: its shard)
  grads       their gradients after the backward of a step (FSDP: the reduce-scattered shard)
  optim_state the optimizer's state tensors on this rank (ZeRO: its shard; SGD: momentum buffers)
  activations the peak, within one micro-batch's forward and backward, of the tensors held for the
              backward (ActivationMeter): what activation checkpointing cuts
  host        of params, grads and optim_state, what the strategy keeps in host memory (FSDP's
              offload: the parameters whose FSDP unit offloads them, their gradients and state)

Measured once per run (and per resumed run), on the second optimizer step this process runs (the first
where it runs one only): activations on its first micro-batch, the rest after its optimizer step,
before the gradients are released. Not the first step: a pipeline's also sets its stages up, and its
first stage then holds one more micro-batch's activations than at any later step. Memory that exists
only for a moment inside a step (gathered FSDP parameters, temporaries, communication buffers) is not
in these numbers; mem/peak_mb (CUDA max allocated, or RSS on CPU) covers it.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MB = 2**20


class Peak:
    """This process's peak memory on `device` from the moment it is made: CUDA's max allocated, or on a
    CPU the resident set's high-water mark. Both are counters of the process, so a second run in the
    same process (ddpexp.run in a loop, a notebook) would report the first's peak: they start over here
    (on Linux the high-water mark resets through /proc/self/clear_refs; where it cannot, the process's
    max RSS is what is left)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            # Before CUDA's first use there is nothing to reset, and resetting raises.
            if torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats(device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / MB
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024  # kB
        except OSError:
            pass
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _local(t: Any) -> Any:
    """A DTensor's local shard, or the tensor itself (read directly: to_local() would add an autograd
    node, and this runs inside autograd's saved-tensor hooks)."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def local_bytes(t: Any) -> int:
    """Bytes of this rank's part of `t` (a DTensor's local shard, or the tensor itself)."""
    if t is None:
        return 0
    t = _local(t)
    return int(t.numel() * t.element_size())


def _state_tensors(optimizer: torch.optim.Optimizer, params: Iterable[Any] | None = None) -> Iterable[Any]:
    """The optimizer's state tensors on this rank; `params`: of those parameters only."""
    # ZeroRedundancyOptimizer keeps this rank's shard in the optimizer it wraps (`optim`).
    inner = getattr(optimizer, "optim", None)
    source = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    states = source.state.values() if params is None else (source.state.get(p, {}) for p in params)
    for state in states:
        yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def resident_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    # A parameter on the meta device is held by another rank (a pipeline's other stages).
    params = [p for p in model.parameters() if not p.is_meta]
    offloaded = _offloaded(model)
    host = [p for p in params if id(p) in offloaded]
    held = sum(local_bytes(p) + local_bytes(p.grad) for p in host)
    held += sum(local_bytes(t) for t in _state_tensors(optimizer, host))
    return {
        "mem/params_mb": sum(local_bytes(p) for p in params) / MB,
        "mem/grads_mb": sum(local_bytes(p.grad) for p in params) / MB,
        "mem/optim_state_mb": sum(local_bytes(t) for t in _state_tensors(optimizer)) / MB,
        "mem/host_mb": held / MB,
    }


def offloaded_params(module: Any) -> list[Any]:
    """The parameters of an FSDP module's own unit (torch's FSDPParam) that FSDP keeps in host memory
    (its CPUOffloadPolicy), read from FSDP's state."""
    group = module._get_fsdp_state()._fsdp_param_group
    return [] if group is None else [fp for fp in group.fsdp_params if fp.offload_to_cpu]


def _offloaded(model: torch.nn.Module) -> set[int]:
    """Ids of the model's parameters FSDP keeps in host memory."""
    from torch.distributed.fsdp import FSDPModule

    modules = (m for m in model.modules() if isinstance(m, FSDPModule))
    return {id(fp.sharded_param) for m in modules for fp in offloaded_params(m)}


class ActivationMeter:
    """The peak bytes of activations held for the backward pass in one forward and backward (one
    micro-batch; a pipeline stage: one schedule step), `peak_bytes` after `measure()`.

    Counted from the tensors autograd saves (torch.autograd.graph.saved_tensors_hooks sees each as it
    is saved and is told when autograd lets it go), each storage once however many tensors view it,
    the model's own tensors left out (parameters are mem/params_mb; buffers such as BatchNorm's
    running statistics are saved by reference and live between steps). That includes what activation
    checkpointing keeps: the input it holds for each block and the outputs selective checkpointing
    caches. What it recomputes in the backward is held by torch.utils.checkpoint itself, unseen by
    the hooks, so while a block recomputes (`recomputing()`, which ddpexp.activation_checkpointing
    enters) the storages its ops make are watched, and those still alive at its end (held for the
    block's backward) count until they are freed. Measuring changes no value: the hooks hand back the
    very tensors they were given.
    """

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self.measuring = False
        self._held: dict[tuple[str, int], list[int]] = {}  # storage -> [bytes, holders]
        self._own: set[tuple[str, int]] = set()  # the storages of the model's own tensors
        self._live = 0
        self._peak = 0
        self._round = 0  # of measure(): what an earlier one counted is never released from a later

    @property
    def held_bytes(self) -> int:
        """What is counted as held right now (0 once a measured step's backward is done)."""
        return self._live

    @contextmanager
    def measure(self, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Measure what is inside (a forward and its backward); `model`'s tensors are not counted."""
        own = [*model.parameters(), *model.buffers()] if model is not None else []
        self._own = {key for t in own if (key := _key(_local(t))) is not None}
        self._held, self._live, self._peak, self.measuring = {}, 0, 0, True
        self._round += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self.measuring = False
        self.peak_bytes = self._peak

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Around a checkpointed block's recomputation: its tensors that outlive it count as held."""
        if not self.measuring:
            yield
            return
        made = _StoragesMade()
        with made:
            yield
        for key, storage in made.alive():
            if key not in self._own:
                self._hold(key, storage.nbytes())
                weakref.finalize(storage, self._release, key, self._round)

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        key = _key(t)
        if key is None or key in self._own:
            return t
        self._hold(key, _local(t).untyped_storage().nbytes())
        return _Saved(t, self, key, self._round)

    def _hold(self, key: tuple[str, int], nbytes: int) -> None:
        entry = self._held.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            self._live += entry[0]
            self._peak = max(self._peak, self._live)
        entry[1] += 1

    def _release(self, key: tuple[str, int], round_: int) -> None:
        entry = self._held.get(key)
        if entry is None or round_ != self._round:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._live -= entry[0]
            del self._held[key]


class _Saved:
    """A saved tensor as autograd holds it while measuring: released from the count when autograd
    drops it (after its backward, or with the graph)."""

    __slots__ = ("key", "meter", "round", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: tuple[str, int], round_: int):
        self.tensor, self.meter, self.key, self.round = tensor, meter, key, round_

    def __del__(self) -> None:
        self.meter._release(self.key, self.round)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def _key(t: torch.Tensor) -> tuple[str, int] | None:
    """The identity of `t`'s storage (a DTensor's: its local shard's); None for a tensor with none of
    its own (meta, another wrapper subclass). A fake tensor's (ddpexp.predict.memory runs models on
    them) has no data pointer: its storage object's identity stands in."""
    t = _local(t)
    if t.is_meta:
        return None
    try:
        storage = t.untyped_storage()
        if storage.device.type == "meta":
            return "fake", storage._cdata
        return str(storage.device), storage.data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


class _StoragesMade(TorchDispatchMode):
    """The storages the ops inside make for their results (not views or in-place results of their
    inputs), by weak reference."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[tuple[str, int], weakref.ref[torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key, t in _made_by(args, kwargs, out):
            known = self._made.get(key)
            if known is None or known() is None:  # a freed storage's address (or fake identity) reused
                self._made[key] = weakref.ref(t.untyped_storage())
        return out

    def alive(self) -> list[tuple[tuple[str, int], torch.UntypedStorage]]:
        found = ((key, ref()) for key, ref in self._made.items())
        return [(key, s) for key, s in found if s is not None and s.nbytes() > 0]


class LiveBytes(TorchDispatchMode):
    """The peak, while it is entered, of the bytes of the storages the ops inside made (their results,
    not views or in-place results of their inputs) that are alive at once, the gradients of `model`'s
    parameters left out (a category of their own; which results become one is known only when it is
    accumulated, so the peak is summed from the events once it exits): `peak`. Works on fake tensors,
    where nothing else counts bytes."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.peak = 0
        self._events: list[int] = []  # bytes made (+) and freed (-), in order
        self._counted: dict[tuple[str, int], list[Any]] = {}  # storage -> [weak ref, bytes, event]
        self._params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        self._hooks: list[Any] = []

    def __enter__(self) -> LiveBytes:
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad) for p in self._params]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)
        self.peak = max(itertools.accumulate(self._events), default=0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key, t in _made_by(args, kwargs, out):
            known = self._counted.get(key)
            if known is not None and known[0]() is not None:
                continue
            storage = _local(t).untyped_storage()
            nbytes = storage.nbytes()
            self._counted[key] = [weakref.ref(storage), nbytes, len(self._events)]
            self._events.append(nbytes)
            weakref.finalize(storage, self._free, key, nbytes)
        return out

    def _free(self, key: tuple[str, int], nbytes: int) -> None:
        entry = self._counted.get(key)
        if entry is not None and entry[0]() is None:
            del self._counted[key]
            if entry[1]:
                self._events.append(-nbytes)

    def _grad(self, param: torch.Tensor) -> None:
        key = _key(param.grad) if param.grad is not None else None
        entry = self._counted.get(key) if key is not None else None
        if entry is not None and entry[1]:
            self._events[entry[2]] = 0  # as if never made here
            entry[1] = 0


def _made_by(args: Any, kwargs: Any, out: Any) -> Iterator[tuple[tuple[str, int], torch.Tensor]]:
    """An op's results whose storages it made (not views or in-place results of its inputs)."""
    given = {_key(t) for t in _tensors((args, kwargs))}
    for t in _tensors(out):
        key = _key(t)
        if key is not None and key not in given:
            yield key, t


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]

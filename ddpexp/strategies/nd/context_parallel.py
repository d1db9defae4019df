"""Context parallelism (strategy.cp): each rank of a cp group holds 1/cp of every sequence.

torch's `context_parallel` (torch.distributed.tensor.experimental) does the work: it cuts the token
ids, the targets and the positions along the sequence with its head-tail load balancing (each rank
gets chunk i and chunk 2 cp - 1 - i of 2 cp, so the causal mask leaves every rank the same work) and
turns the model's `scaled_dot_product_attention` into ring attention: each rank's queries meet every
rank's keys and values, merged by their log-sum-exp. The model learns where its tokens sit from its
own `sequence_positions()` (RoPE's angles, learned position rows): models/gpt.py.

On CPU, SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, which torch 2.14's ring does not map
(it knows the CUDA kernels only); `_route_cpu_attention` maps that kernel and its backward to the same
ring templates: they return (out, logsumexp) as the CUDA flash kernel does.

Gradients: every cp rank's loss is the mean over its part of the sequences, each part alike in size;
FSDP shards over dp_shard x cp and averages over it, which makes their mean the mean over the
whole sequences.

Traffic (kind context_parallel), per attention call, from each rank's keys and values K (B x kv heads
x L/cp x head_dim, in the compute dtype): forward, one all-gather of K and V (torch's default rotation);
backward, one all-gather of them again (and once more in a forward that full activation checkpointing
runs again) and cp rotations of their gradients, accumulated in fp32 (each an all-to-all that hands
the whole buffer to the next rank: a send and a receive). Metered by tensor_parallel.CollectiveCounter,
which tells this traffic by the cp group it runs on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...errors import UserError
from ..comm import Collective

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

KIND = "context_parallel"


def check(model: nn.Module, *, cp: int, length: int | None) -> None:
    """One line with the fix for a model or a sequence length that cp ranks cannot split (cp -1, the
    rest of the world: the model only)."""
    if cp == 1:
        return
    if not callable(getattr(model, "sequence_positions", None)):
        raise UserError(
            f"{type(model).__name__} cannot be told which positions a rank's tokens hold "
            "(sequence_positions()), so context parallelism cannot split its sequences",
            setting="strategy.cp",
            fix="set strategy.cp=1, or use a transformer that can (model=gpt, gpt_tiny, gpt_small, llama...)",
        )
    if length is not None and cp > 1 and length % (2 * cp):
        fits = [d for d in range(1, length + 1) if length % (2 * d) == 0 and d > 1]
        fix = f"a data.block_size that is a multiple of {2 * cp}"
        if fits:
            fix += f", or strategy.cp in {fits[:6]}"
        raise UserError(
            f"context parallelism cuts each sequence into 2 x cp = {2 * cp} equal chunks (head-tail load "
            f"balancing), and {length} tokens do not divide",
            setting="strategy.cp",
            fix=f"use {fix}",
        )


class SequenceShards:
    """This rank's part of each sequence, on the cp ranks of `mesh`, for `model` (which declares
    sequence_positions)."""

    def __init__(self, mesh: DeviceMesh, model: nn.Module) -> None:
        _route_cpu_attention()
        self.mesh = mesh
        self.model = model

    @contextlib.contextmanager
    def training(self, inputs: torch.Tensor, targets: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
        """Within: this rank's part of `inputs` and `targets` (B, L), and attention as a ring. The
        forward and the backward both run inside (the backward rotates the keys' gradients)."""
        with self._sharded(inputs, targets) as (ids, labels):
            yield ids, labels

    def evaluate(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """The logits of the whole sequences: each rank's part computed, then gathered (a collective:
        every cp rank calls it), so evaluation scores every token as single does. None where `model`
        gives none (a pipeline stage before the last: so do the other ranks of its cp group)."""
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        with self._sharded(inputs) as (ids,):
            out = model(ids)
        if out is None:
            return None
        return context_parallel_unshard(self.mesh, [out.contiguous()], [1])[0]

    @contextlib.contextmanager
    def _sharded(self, *given: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
        from torch.distributed.tensor.experimental import context_parallel

        device = given[0].device
        length = given[0].shape[1]
        check(self.model, cp=self.mesh.size(), length=length)
        # Copies: torch cuts its buffers in place, and the loader's tensors are not ours to change.
        buffers = [t.clone() for t in given] + [torch.arange(length, device=device)]
        dims = [1] * len(given) + [0]
        positions: Any = self.model.sequence_positions  # checked: the model declares it
        with (
            context_parallel(
                self.mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=set(buffers)
            ),
            positions(buffers[-1]),
        ):
            yield tuple(buffers[:-1])


@functools.cache
def _route_cpu_attention() -> None:
    """torch's ring attention for the CPU flash kernel and its backward (module docstring), installed
    once beside torch's own handlers, which its dispatcher puts in place for each context_parallel."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention

    aten = torch.ops.aten
    forward_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def local(
        op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, list[Any], dict[str, Any]]:
        info = DTensor._op_dispatcher.unwrap_to_op_info(op, args, kwargs)
        return info.compute_mesh, list(info.local_args), dict(info.local_kwargs)

    def wrap(mesh: Any, tensors: Any) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)

    def forward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
        mesh, given, named = local(op, args, kwargs)
        query, key, value, *rest = given
        dropout_p = rest[0] if rest else named.pop("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else named.pop("is_causal", False)
        if named.get("attn_mask") is not None:
            raise NotImplementedError("context parallelism takes causal attention without a mask")
        out = _attention._templated_ring_attention(
            mesh.get_group(),
            2,
            forward_op,
            query,
            key,
            value,
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=named.get("scale"),
        )
        return wrap(mesh, out[:2])

    def backward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
        mesh, given, named = local(op, args, kwargs)
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = given[:8]
        grads = _attention._templated_ring_attention_backward(
            mesh.get_group(),
            2,
            backward_op,
            grad_out=grad_out,
            grad_out_name="grad_out",
            query=query,
            key=key,
            value=value,
            out=out,
            logsumexp=logsumexp,
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=named.get("scale"),
        )
        return wrap(mesh, grads[:3])

    handlers: dict[Any, Any] = _attention.custom_ops
    handlers[forward_op] = forward
    handlers[backward_op] = backward


# ----------------------------------------------------------------------------------------- prediction


def communication(
    model: nn.Module,
    *,
    cp: int,
    tp: int,
    micro_batch: float,
    length: int,
    element_size: int,
    passes: int,
    recomputed: bool,
    inter_node: bool,
) -> list[Collective]:
    """The ring's traffic per optimizer step of `passes` forward and backward passes of `micro_batch`
    samples of `length` tokens (module docstring): keys and values of each attention layer, their
    heads split over `tp` ranks, in `element_size` bytes; `recomputed`: every layer's forward runs
    again in the backward (full activation checkpointing) and gathers again. The selective modes keep
    attention's output, so its forward is not run again."""
    layers = [m for m in model.modules() if _is_attention(m)]
    if cp == 1 or not layers:
        return []
    kv = sum(2 * _out_features(m.wk) for m in layers) / tp  # keys and values, each rank's heads
    local = micro_batch * length / cp * kv  # elements of K and V each rank holds, all layers
    gathers = (3 if recomputed else 2) * passes  # per layer: forward, (its recomputation,) backward
    gathered = local * element_size * gathers
    rotated = local * 4 * passes * cp  # the gradients, in fp32: cp rotations a backward
    return [
        Collective(
            "each attention layer's keys and values, gathered around the cp ranks (forward and backward)",
            "all_gather",
            gathered * cp,
            cp,
            len(layers) * gathers,
            counted=gathered,
            inter_node=inter_node,
            kind=KIND,
        ),
        Collective(
            "each attention layer's key and value gradients, passed on around the cp ring (backward)",
            "sendrecv",
            rotated,
            cp,
            len(layers) * passes * cp,
            counted=rotated,
            inter_node=inter_node,
            kind=KIND,
        ),
    ]


def _out_features(linear: Any) -> int:
    return int(linear.out_features)


def _is_attention(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in ("wq", "wk", "wv", "wo"))

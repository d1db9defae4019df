"""Expert parallelism (strategy.ep): a mixture of experts' experts spread over ep ranks.

The ep ranks are consecutive ranks of a dp_shard group (torchtitan borrows EP from the data-parallel
ranks the same way): dp_shard splits into dp_shard / ep groups of ep ranks, and rank i of an ep group
holds experts [i E/ep, (i+1) E/ep) of every MoE layer, its stacked weights a DTensor split by expert
(Shard(0)) over the ep group. Each rank routes its own tokens, then per MoE layer:

1. dispatch: an all-to-all of the tokens per expert counts (E integers), then of the tokens
   themselves, each to the rank holding its expert;
2. the rank's experts run on what it received, grouped by expert;
3. combine: the outputs go back by the reverse all-to-all, and the router's weights sum them where the
   tokens live.

The backward runs the two all-to-alls in reverse (a dispatch's gradient travels as a combine does, and
the other way round). Both are counted by the meter as kinds `expert_dispatch` (the forward's dispatch
and its gradient in the backward, with the counts) and `expert_combine`, by the bytes each rank
contributes, its own part included, as the meter counts every collective.

With tensor parallelism each expert's hidden units are split over the tp ranks too (models/moe.py's
MoETensorParallel): the stacks are DTensors on ep x tp, split by expert and by hidden unit; each tp
rank routes the same tokens, so the ep ranks at each tp place exchange them among themselves.

The other parameters are FSDP's over the data-parallel ranks as without EP. The experts are left out
of FSDP (`ignored_params`) and are not sharded further: the dp_shard / ep x dp_replicate ranks at the
same place of their ep groups hold the same experts and all-reduce their gradients (Megatron-Core's
expert data parallelism; torchtitan shards them over those ranks with FSDP instead, which holds less
and sends more). Each expert's gradient then holds every rank's tokens' contributions and is divided
by the data-parallel size, as FSDP averages the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import UserError
from ...models.moe import MoE, routed_per_sequence, routing_layers
from ..comm import Collective, CommMeter

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DISPATCH, COMBINE = "expert_dispatch", "expert_combine"


def check(*, ep: int, dp_shard: int) -> None:
    """The degree against the mesh, before launch."""
    if ep < 1:
        raise UserError(
            f"must be a positive degree, got {ep}", setting="strategy.ep", fix="set strategy.ep>=1"
        )
    if ep > 1 and dp_shard % ep:
        divisors = [d for d in range(1, dp_shard + 1) if dp_shard % d == 0]
        raise UserError(
            f"expert parallelism over {ep} ranks does not divide a dp_shard group of {dp_shard} ranks",
            setting="strategy.ep",
            fix=f"set strategy.ep to a divisor of {dp_shard} ({', '.join(map(str, divisors))}), "
            f"or make dp_shard a multiple of {ep} (strategy.dp_shard, dist.nprocs)",
        )


def check_model(model: nn.Module, ep: int, cp: int) -> None:
    """A model with experts that divide over the ep ranks; a mixture of experts with whole sequences."""
    layers = routing_layers(model)
    if layers and cp > 1:
        raise UserError(
            "context parallelism splits every sequence, and a mixture of experts balances its load over "
            "whole sequences (its auxiliary loss is sequence-wise)",
            setting="strategy.cp",
            fix="set strategy.cp=1 with this model (strategy.ep, dp_shard and pp spread it)",
        )
    if ep == 1:
        return
    if not layers:
        raise UserError(
            f"expert parallelism spreads a mixture of experts' experts, and {type(model).__name__} has none",
            setting="strategy.ep",
            fix="set strategy.ep=1, or use a mixture of experts (model=gpt_moe_small)",
        )
    experts = layers[0].cfg.experts
    if experts % ep:
        raise UserError(
            f"{experts} experts per layer do not split over strategy.ep={ep} ranks",
            setting="strategy.ep",
            fix=f"use an ep that divides {experts}, or model.moe.experts a multiple of {ep}",
        )


def expert_params(module: nn.Module) -> set[nn.Parameter]:
    return {p for layer in routing_layers(module) for p in layer.experts.parameters()}


def split(part: nn.Module, mesh: DeviceMesh) -> None:
    """Each rank of `mesh`'s ep groups keeps its share of the experts of `part`'s MoE layers. Experts
    tensor parallelism split already (DTensors on its tp mesh) are split over ep x tp, by expert and
    by hidden unit."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    for layer in routing_layers(part):
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                whole = param.data.full_tensor()  # type: ignore[attr-defined]  # .data of a DTensor is one
                shard = distribute_tensor(whole, mesh["ep", "tp"], [Shard(0), *param.placements])
            else:
                shard = distribute_tensor(param.data, mesh["ep"], [Shard(0)])
            layer.experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))


def route(model: nn.Module, mesh: DeviceMesh, meter: CommMeter | None) -> None:
    """The model's MoE layers send their tokens to the ranks of `mesh` holding their experts."""
    for layer in routing_layers(model):
        layer.run_experts = _dispatcher(layer, mesh.get_group(), mesh.size(), meter)


def predicted_split(ep: int) -> Callable[[nn.Module], None]:
    """For the memory model: a copy of the model whose MoE layers run as one rank of `ep` runs them,
    every rank sending and receiving the same share (balanced routing), the exchanges local copies."""

    def split(model: nn.Module) -> None:
        for layer in routing_layers(model):
            layer.run_experts = _dispatcher(layer, None, ep, None)

    return split


def _dispatcher(
    layer: MoE, group: Any, ep: int, meter: CommMeter | None
) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    """group None: the memory model's, on tensors without values (predicted_split)."""
    local = layer.cfg.experts // ep

    def run(tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if group is None:
            to_ranks = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]
            from_ranks, per_expert = to_ranks, [sum(counts[e::local]) for e in range(local)]
            order = torch.arange(sum(from_ranks), device=tokens.device)
        else:
            send = torch.tensor(counts, dtype=torch.int64).view(ep, local)  # to each rank, per its expert
            received = torch.empty_like(send)
            nbytes = send.numel() * send.element_size()
            _timed(meter, DISPATCH, nbytes, lambda: dist.all_to_all_single(received, send, group=group))
            to_ranks, from_ranks = send.sum(1).tolist(), received.sum(1).tolist()
            per_expert = received.sum(0).tolist()
            order = _by_expert(received)  # arrivals come by source rank, then expert: regrouped by expert
        arrived = _AllToAll.apply(tokens, from_ranks, to_ranks, group, meter, DISPATCH, COMBINE)
        out = layer.experts(arrived[order], per_expert)
        back = torch.empty_like(out).index_copy(0, order, out)
        return _AllToAll.apply(back, to_ranks, from_ranks, group, meter, COMBINE, DISPATCH)

    return run


def _by_expert(received: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups rows laid out by (source rank, expert) as (expert, source rank)."""
    counts = received.flatten()
    starts = counts.cumsum(0) - counts
    ranks, experts = received.shape
    pieces = [
        torch.arange(int(starts[r * experts + e]), int(starts[r * experts + e] + counts[r * experts + e]))
        for e in range(experts)
        for r in range(ranks)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def _timed(meter: CommMeter | None, kind: str, nbytes: int, call: Callable[[], Any]) -> None:
    start = time.perf_counter()
    call()
    if meter is not None:
        meter.record(start, time.perf_counter(), nbytes, kind)


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows (`to_ranks[i]` of them to rank i, `from_ranks[i]` from it), and its reverse
    for the gradient; each direction counted under its kind."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        from_ranks: list[int],
        to_ranks: list[int],
        group: Any,
        meter: CommMeter | None,
        kind: str,
        back_kind: str,
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.meter, ctx.kind = (from_ranks, to_ranks), group, meter, back_kind
        return _exchange(x.contiguous(), from_ranks, to_ranks, group, meter, kind)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from_ranks, to_ranks = ctx.splits
        out = _exchange(grad.contiguous(), to_ranks, from_ranks, ctx.group, ctx.meter, ctx.kind)
        return out, None, None, None, None, None, None


def _exchange(
    x: torch.Tensor,
    from_ranks: list[int],
    to_ranks: list[int],
    group: Any,
    meter: CommMeter | None,
    kind: str,
) -> torch.Tensor:
    out = x.new_empty((sum(from_ranks), *x.shape[1:]))
    if group is None:  # the memory model's (predicted_split): what arrives is as large as what left
        return out.copy_(x)
    _timed(
        meter,
        kind,
        x.numel() * x.element_size(),
        lambda: dist.all_to_all_single(out, x, from_ranks, to_ranks, group=group),
    )
    return out


def sync_expert_grads(part: nn.Module, replicas: Any, dp: int, meter: CommMeter | None) -> Callable[[], None]:
    """The step's last reduction of the experts' gradients: summed over the ranks holding the same
    experts (`replicas`, None: none), divided by the data-parallel size."""
    params = [p for layer in routing_layers(part) for p in layer.experts.parameters()]  # every rank's order

    def sync() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if replicas is not None:
            flat = torch.cat([g.reshape(-1) for g in local])
            _timed(
                meter,
                "gradients",
                flat.numel() * flat.element_size(),
                lambda: dist.all_reduce(flat, group=replicas),
            )
            offset = 0
            for g in local:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        for g in local:
            g.div_(dp)

    return sync


def communication(
    model: nn.Module,
    *,
    ep: int,
    micro_batch: float,
    length: int,
    passes: int,
    token_size: int,
    output_size: int,
    inter_node: bool,
    per_node: int,
) -> list[Collective]:
    """Per optimizer step, each rank's all-to-alls with balanced routing (every expert the same share
    of the choices, so a capacity factor >= 1 drops nothing): per MoE layer and forward, the counts
    (E int64) and the routed rows (micro_batch x length x top_k, fewer where the capacity keeps fewer)
    of `token_size` bytes per channel to the experts, of `output_size` back; the backward sends each
    again the other way. Sized as commbench sizes an all-to-all (each rank's whole buffer), which is
    also what the meter counts, so with dropless routing prediction equals measurement whatever the
    balance: every rank sends all its own choices, and receives on average as many."""
    layers = routing_layers(model)
    if ep == 1 or not layers:
        return []
    cfg = layers[0].cfg
    dim = layers[0].router.in_features
    rows = micro_batch * routed_per_sequence(cfg, length)
    calls = len(layers) * passes
    counts = cfg.experts * 8 * calls
    dispatched = rows * dim * (token_size + output_size) * calls
    return [
        Collective(
            "expert dispatch: tokens per expert, the tokens to their experts' ranks, the outputs' gradients",
            "all_to_all",
            float(dispatched + counts),
            ep,
            3 * calls,
            counted=float(dispatched + counts),
            inter_node=inter_node,
            per_node=per_node,
            kind=DISPATCH,
        ),
        Collective(
            "expert combine: the experts' outputs back, the tokens' gradients back",
            "all_to_all",
            float(dispatched),
            ep,
            2 * calls,
            counted=float(dispatched),
            inter_node=inter_node,
            per_node=per_node,
            kind=COMBINE,
        ),
    ]


def expert_reduction(
    experts: set[nn.Parameter], *, ep: int, tp: int, replicas: int, inter_node: bool, per_node: int
) -> Collective:
    """The experts' gradients, this rank's 1/ep of them (of their hidden units 1/tp), all-reduced once
    a step in one flat buffer over the `replicas` ranks holding the same experts (`sync_expert_grads`)."""
    nbytes = float(sum(p.numel() // (ep * tp) * p.element_size() for p in experts))
    return Collective(
        "the experts' gradients, all-reduced over the ranks holding the same experts",
        "all_reduce",
        nbytes,
        replicas,
        1,
        counted=nbytes,
        inter_node=inter_node,
        per_node=per_node,
        kind="gradients",
    )

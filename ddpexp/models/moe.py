"""Mixture-of-experts feed-forward layers for the transformer (`model.moe`).

Each token's router scores every expert (a linear layer, no bias, scores in float32: softmax as in
Mixtral and Qwen3, or sigmoid as in DeepSeek-V3); the token goes to its `top_k` best experts, and their
outputs are summed weighted by the chosen scores (renormalised to sum to 1 over the chosen experts when
`norm_topk`). Shared experts (DeepSeek's) are one dense feed-forward of `shared_experts x ffn_dim`
hidden units every token goes through. An expert is the block's own feed-forward form (SwiGLU or GELU)
with `ffn_dim` hidden units; the experts' weights are stacked, (experts, out, in) each, so expert
parallelism splits them by their first dimension.

Load balancing: DeepSeek-V3's sequence-wise auxiliary loss (its paper's eq. 17-20), for either score:
per sequence of length L, f_i = E / (K L) x the tokens routed to expert i and P_i = the mean over the
sequence of expert i's score normalised over the experts; the loss is coef x sum_i f_i P_i, averaged
over the sequences of the global batch. A mean over sequences is the same on any split of the global
batch over ranks and micro-batches, so every strategy trains the same model as `single` (a batch-wise
loss would not be). It reaches the gradients without passing through the task's loss, as
Megatron-Core adds its auxiliary losses: the layer's output carries it into the backward, which adds
its gradient (scaled by the sequences this forward holds over those of one rank's optimizer step,
`balance_over`). The reported training loss is the task's alone; `moe/aux_loss` is logged beside it.

Capacity (`capacity_factor`, null: dropless): per sequence, each expert takes at most
ceil(capacity_factor x L x K / E) of the tokens routed to it, the earliest positions first; a dropped
choice contributes nothing (the token keeps its residual and its other choices). Per sequence again,
so the rule does not depend on how the batch is split.

Tensor parallelism (`MoETensorParallel`, the style a model's plan gives a MoE layer): the router stays
whole on every tp rank, which route the same tokens alike; each expert's hidden units split over the
tp ranks (w1 and w3 by rows, w2 by columns: Megatron-Core's expert tensor parallelism), so each rank's
experts give a part of every routed token's output. The routed tokens enter the experts through an
identity whose backward sums their gradient over the tp ranks, and the experts' outputs leave through
a sum over the tp ranks (Megatron's f and g, around the experts wherever expert parallelism runs them:
on this rank's own choices, so their sizes do not depend on the balance). With sequence parallelism
the layer gathers the sequence at its input and hands back its part of the output.

Every layer counts, while training, the choices each expert received and the choices dropped
(`RoutingCounts`); the engine reads them once per epoch (`moe/load_max_over_mean`, `moe/dropped_frac`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

SCORES = ("softmax", "sigmoid")
_recording = [True]  # off within unrecorded_routing()


@contextlib.contextmanager
def unrecorded_routing() -> Iterator[None]:
    """Forwards within are not the training's (a pipeline's shape inference on uninitialised inputs):
    MoE layers leave their routing counts as they are."""
    before, _recording[0] = _recording[0], False
    try:
        yield
    finally:
        _recording[0] = before


@dataclass(frozen=True)
class MoEConfig:
    experts: int
    top_k: int
    ffn_dim: int  # hidden units of one expert
    shared_experts: int = 0
    every: int = 1  # layer i >= first_dense is a MoE layer when (i - first_dense) % every == 0
    first_dense: int = 0  # the first layers keep the dense feed-forward (DeepSeek's first_k_dense)
    score: str = "softmax"
    norm_topk: bool = True
    aux_loss_coef: float = 0.01
    capacity_factor: float | None = None

    def routed(self, layer: int) -> bool:
        return layer >= self.first_dense and (layer - self.first_dense) % self.every == 0


def moe_config(settings: dict[str, Any] | None, *, n_layer: int, mlp_hidden: int) -> MoEConfig | None:
    """model.moe's settings checked (one line each, naming the setting), or None for a dense model."""
    if settings is None:
        return None
    known = set(MoEConfig.__dataclass_fields__)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise UserError(
            f"unknown setting {unknown[0]!r}",
            setting=f"model.moe.{unknown[0]}",
            fix=f"use one of {', '.join(sorted(known))}",
        )
    given = dict(settings)
    if given.get("ffn_dim") is None:
        given["ffn_dim"] = mlp_hidden
    missing = [k for k in ("experts", "top_k") if given.get(k) is None]
    if missing:
        raise UserError(
            f"a mixture of experts needs model.moe.{missing[0]}",
            setting=f"model.moe.{missing[0]}",
            fix="set model.moe.experts and model.moe.top_k (e.g. 8 and 2), or model.moe=null: dense",
        )
    cfg = MoEConfig(**given)
    for name in ("experts", "top_k", "ffn_dim", "every"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise UserError(
                f"must be a positive integer, got {value!r}",
                setting=f"model.moe.{name}",
                fix=f"set model.moe.{name}>=1",
            )
    if cfg.top_k > cfg.experts:
        raise UserError(
            f"top_k {cfg.top_k} chooses more experts than the {cfg.experts} there are",
            setting="model.moe.top_k",
            fix=f"set model.moe.top_k<={cfg.experts}, or model.moe.experts>={cfg.top_k}",
        )
    if cfg.score not in SCORES:
        raise UserError(
            f"unknown score {cfg.score!r}", setting="model.moe.score", fix=f"use one of {', '.join(SCORES)}"
        )
    if cfg.shared_experts < 0 or cfg.first_dense < 0:
        name = "shared_experts" if cfg.shared_experts < 0 else "first_dense"
        raise UserError("cannot be negative", setting=f"model.moe.{name}", fix=f"set model.moe.{name}>=0")
    if not (math.isfinite(cfg.aux_loss_coef) and cfg.aux_loss_coef >= 0):
        raise UserError(
            f"must be a finite number >= 0, got {cfg.aux_loss_coef}",
            setting="model.moe.aux_loss_coef",
            fix="set model.moe.aux_loss_coef=0.01 (0: no load-balancing loss)",
        )
    if cfg.capacity_factor is not None and not (
        math.isfinite(cfg.capacity_factor) and cfg.capacity_factor > 0
    ):
        raise UserError(
            f"must be a finite number > 0, got {cfg.capacity_factor}",
            setting="model.moe.capacity_factor",
            fix="set model.moe.capacity_factor=1.25, or null for dropless routing",
        )
    if not any(cfg.routed(i) for i in range(n_layer)):
        raise UserError(
            f"model.moe.first_dense={cfg.first_dense} leaves none of the {n_layer} layers routed",
            setting="model.moe.first_dense",
            fix=f"set model.moe.first_dense<{n_layer}, or model.moe=null for a dense model",
        )
    return cfg


def capacity(cfg: MoEConfig, capacity_factor: float, length: int) -> int:
    """The choices each expert takes of a sequence of `length` tokens: ceil(cf x L x K / E)."""
    return math.ceil(capacity_factor * length * cfg.top_k / cfg.experts)


def routed_per_sequence(cfg: MoEConfig, length: int) -> int:
    """The choices a sequence of `length` tokens sends to the experts with balanced routing: all
    length x top_k dropless, no more than the experts' capacities with a capacity factor."""
    choices = length * cfg.top_k
    if cfg.capacity_factor is None:
        return choices
    return min(choices, cfg.experts * capacity(cfg, cfg.capacity_factor, length))


class GroupedExperts(nn.Module):
    """The experts' weights, stacked: w1 and w3 (experts, ffn_dim, dim), w2 (experts, dim, ffn_dim).
    `forward(x, counts)`: x holds the tokens sorted by expert, counts[e] of them for the e-th expert
    this module holds (expert parallelism leaves a rank a slice of them: `first` is its first)."""

    # the dimension of each stack that holds the hidden units (tensor parallelism splits it)
    HIDDEN: ClassVar[dict[str, int]] = {"w1": 1, "w2": 2, "w3": 1}

    def __init__(self, experts: int, dim: int, ffn_dim: int, *, swiglu: bool) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(experts, ffn_dim, dim)) if swiglu else None

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        assert w1 is not None and w2 is not None
        if w1.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            # bf16 tokens (FSDP's parameter dtype) meet experts FSDP does not hold (expert parallelism's)
            w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
            w3 = None if w3 is None else w3.to(x.dtype)
        outs = []
        for e, part in enumerate(x.split(counts)):
            h = part @ w1[e].t()
            h = F.silu(h) * (part @ w3[e].t()) if w3 is not None else F.gelu(h, approximate="tanh")
            outs.append(h @ w2[e].t())
        return torch.cat(outs)


def _shapes_only(t: torch.Tensor) -> bool:
    """A tensor without values (meta, or a fake tensor): routing is taken as balanced, nothing counted."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def _local(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded weight's local part (expert parallelism makes the stacks DTensors split by expert)."""
    return weight.to_local() if weight is not None and hasattr(weight, "to_local") else weight


class _AuxGradient(torch.autograd.Function):
    """Returns x; in the backward, also gives `aux` the gradient 1, so the auxiliary loss's gradient
    joins the task loss's without the task's loss ever holding it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def _summed(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x summed over `group`'s ranks, as a functional collective (which the tensor-parallel meter counts)."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x.contiguous(), "sum", group.group_name))


class _ToSplitExperts(torch.autograd.Function):
    """Megatron's f: the routed tokens as they are; their gradient, each tp rank's part (its hidden
    units'), summed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _summed(grad, ctx.group), None


class _FromSplitExperts(torch.autograd.Function):
    """Megatron's g: the experts' outputs, each tp rank's part, summed; the gradient (the same on every
    tp rank) as it is."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Any) -> torch.Tensor:
        return _summed(y, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def tensor_parallel_style(*, sequence_parallel: bool) -> Any:
    """The ParallelStyle of a MoE layer in a model's tensor-parallel plan (see the module docstring);
    its shared experts take the dense feed-forward's column- and row-wise styles beside it."""
    return _style_class()(sequence_parallel)


def is_tensor_parallel_style(style: Any) -> bool:
    return isinstance(style, _style_class())


@functools.cache
def _style_class() -> type:
    """Made on first use: torch.distributed.tensor takes most of a second to import."""
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class MoETensorParallel(ParallelStyle):
        def __init__(self, sequence_parallel: bool) -> None:
            self.sequence_parallel = sequence_parallel

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

            assert isinstance(module, MoE), module
            experts = module.experts
            for name, dim in GroupedExperts.HIDDEN.items():
                weight = getattr(experts, name)
                if weight is not None and not isinstance(weight, DTensor):
                    split = distribute_tensor(weight.data, device_mesh, [Shard(dim)])
                    experts.register_parameter(name, nn.Parameter(split, requires_grad=weight.requires_grad))
            module.tensor_parallel = device_mesh.get_group()
            if self.sequence_parallel:

                def gather(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                    x = args[0]
                    if isinstance(x, DTensor):
                        x = x.redistribute(device_mesh, [Replicate()]).to_local()
                    return (x, *args[1:])

                def split_back(_: nn.Module, args: Any, out: torch.Tensor) -> Any:
                    whole = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
                    return whole.redistribute(device_mesh, [Shard(1)]).to_local()

                module.register_forward_pre_hook(gather)
                module.register_forward_hook(split_back)
            return module

    return MoETensorParallel


class RoutingCounts:
    """What one MoE layer routed while training, on its device, read once per epoch (`take`): choices
    per expert, choices dropped, and the auxiliary loss summed over forwards with its sequence count.
    Plain tensors, not buffers: DDP would overwrite buffers with rank 0's."""

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.values: torch.Tensor | None = None  # experts counts, dropped, aux sum, sequences

    def add(self, per_expert: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor, sequences: int) -> None:
        row = torch.cat(
            [
                per_expert.double(),
                dropped.double().reshape(1),
                aux.detach().double().reshape(1),
                per_expert.new_tensor([sequences], dtype=torch.float64),
            ]
        )
        self.values = row if self.values is None else self.values + row

    def take(self, device: torch.device) -> torch.Tensor:
        out = self.values if self.values is not None else torch.zeros(self.experts + 3, dtype=torch.float64)
        self.values = None
        return out.to(device)


class MoE(nn.Module):
    """The feed-forward of a MoE block: (B, L, dim) -> (B, L, dim)."""

    def __init__(
        self, dim: int, cfg: MoEConfig, *, swiglu: bool, dense: Callable[[int], nn.Module], index: int
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = index  # among the model's MoE layers: the row of its routing counts
        self.router = nn.Linear(dim, cfg.experts, bias=False)
        self.experts = GroupedExperts(cfg.experts, dim, cfg.ffn_dim, swiglu=swiglu)
        self.shared = dense(cfg.shared_experts * cfg.ffn_dim) if cfg.shared_experts else None
        self.counts = RoutingCounts(cfg.experts)
        self.balance_over = 1  # sequences one rank's optimizer step holds (set by the run: balance_over)
        # Expert parallelism sets this: (tokens sorted by expert, counts per expert) -> their outputs,
        # run where the experts are; None: here.
        self.run_experts: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None
        # MoETensorParallel sets this: the process group the experts' hidden units split over.
        self.tensor_parallel: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        tokens = x.reshape(-1, dim)
        cfg = self.cfg
        logits = self.router(tokens).float()
        scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
        chosen_scores, chosen = scores.topk(cfg.top_k, dim=-1)  # (N, K)
        weights = chosen_scores / chosen_scores.sum(-1, keepdim=True) if cfg.norm_topk else chosen_scores
        kept = self._capacity(chosen.view(batch, length * cfg.top_k), length)  # (N*K,) bool or None
        routed = self._dispatch(tokens, chosen.reshape(-1), weights.reshape(-1), kept)
        out = routed if self.shared is None else routed + self.shared(tokens)
        out = out.view(batch, length, dim)
        if self.training and torch.is_grad_enabled():
            aux = self._balance_loss(scores, chosen, batch, length)
            # not a checkpoint's recomputation, nor a forward without values
            if _recording[0] and torch._C._current_graph_task_id() == -1 and not _shapes_only(x):
                self._count(chosen, kept, aux, batch)
            if cfg.aux_loss_coef > 0:
                out = _AuxGradient.apply(out, aux * (cfg.aux_loss_coef * batch / self.balance_over))
        return out

    def _capacity(self, chosen: torch.Tensor, length: int) -> torch.Tensor | None:
        """Which choices (token-major, then k) fit their expert's per-sequence capacity; None: all."""
        cf = self.cfg.capacity_factor
        if cf is None or _shapes_only(chosen):
            return None
        onehot = F.one_hot(chosen, self.cfg.experts)  # (B, L*K, E)
        place = (onehot.cumsum(1) * onehot).sum(-1)  # 1-based place in its expert's queue
        return (place <= capacity(self.cfg, cf, length)).reshape(-1)

    def _dispatch(
        self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor | None
    ) -> torch.Tensor:
        experts, k = self.cfg.experts, self.cfg.top_k
        choice = torch.arange(chosen.numel(), device=chosen.device)
        if _shapes_only(tokens):  # pre-flight's meta device, the memory model's fake tensors: balanced
            n = chosen.numel()
            counts = [n // experts + (e < n % experts) for e in range(experts)]
        else:
            if kept is not None:
                choice, chosen = choice[kept], chosen[kept]
            choice = choice[chosen.argsort(stable=True)]
            counts = torch.bincount(chosen, minlength=experts).tolist()
        run = self.experts if self.run_experts is None else self.run_experts
        routed = tokens[choice // k]
        if self.tensor_parallel is not None:
            routed = _ToSplitExperts.apply(routed, self.tensor_parallel)
        y = run(routed, counts)
        if self.tensor_parallel is not None:
            y = _FromSplitExperts.apply(y, self.tensor_parallel)
        y = y * weights[choice].to(y.dtype)[:, None]
        return torch.zeros(tokens.shape, dtype=y.dtype, device=y.device).index_add_(0, choice // k, y)

    def _balance_loss(
        self, scores: torch.Tensor, chosen: torch.Tensor, batch: int, length: int
    ) -> torch.Tensor:
        """Mean over this forward's sequences of sum_i f_i P_i (DeepSeek-V3's sequence-wise form)."""
        experts, k = self.cfg.experts, self.cfg.top_k
        per_seq = F.one_hot(chosen.view(batch, -1), experts).sum(1).to(scores.dtype)  # (B, E)
        f = per_seq * experts / (k * length)
        normalised = scores / scores.sum(-1, keepdim=True)
        p = normalised.view(batch, length, experts).mean(1)
        return (f * p).sum(-1).mean()

    @torch.no_grad()
    def _count(self, chosen: torch.Tensor, kept: torch.Tensor | None, aux: torch.Tensor, batch: int) -> None:
        flat = chosen.reshape(-1)
        received = flat if kept is None else flat[kept]
        per_expert = torch.bincount(received, minlength=self.cfg.experts)
        dropped = torch.tensor(flat.numel() - received.numel(), device=flat.device)
        self.counts.add(per_expert, dropped, aux * batch, batch)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def active_params(self) -> int:
        """Parameters one token multiplies: the router, its top_k experts and the shared ones."""
        per_expert = sum(p[0].numel() for p in self.experts.parameters())
        return self.num_params() - (self.cfg.experts - self.cfg.top_k) * per_expert


def routing_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def balance_over(model: nn.Module, sequences: int) -> None:
    """Tell the model's MoE layers how many sequences one rank's optimizer step holds (the global batch
    over the data-parallel ranks): the auxiliary loss's gradient is scaled by it."""
    for layer in routing_layers(model):
        layer.balance_over = max(1, sequences)


def routing_summary(rows: torch.Tensor) -> dict[str, float]:
    """The epoch's routing metrics from every MoE layer's counts summed over ranks, (layers, E + 3):
    the worst layer's busiest expert over the mean (1: balanced), the share of choices dropped by the
    capacity, and the auxiliary loss averaged over sequences and layers (before its coefficient)."""
    counts, dropped, aux, sequences = rows[:, :-3], rows[:, -3], rows[:, -2], rows[:, -1]
    received = counts.sum(1)
    if float(received.sum()) == 0:
        return {}
    mean = received / counts.shape[1]
    ratio = torch.where(mean > 0, counts.max(1).values / mean.clamp_min(1e-12), torch.zeros_like(mean))
    choices = received + dropped
    return {
        "moe/load_max_over_mean": float(ratio.max()),
        "moe/dropped_frac": float(dropped.sum() / choices.sum().clamp_min(1)),
        "moe/aux_loss": float((aux / sequences.clamp_min(1)).mean()),
    }

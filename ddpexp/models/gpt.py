"""A decoder-only transformer (`model=gpt` and its named sizes), in the two forms people train:

- GPT-2: learned position embeddings, LayerNorm, GELU MLP (GPT-2's tanh approximation), biases.
- Llama: rotary position embeddings, RMSNorm, SwiGLU MLP, no biases, grouped-query attention
  (`n_kv_head` < `n_head`).

Pre-norm residual blocks; attention through `scaled_dot_product_attention(is_causal=True)`; no dropout;
the output head may share the token embedding's tensor (`tie_embeddings`). Token ids (B, L), L <=
block_size, give logits (B, L, vocab_size).

Module names (for tensor-parallel plans and weight files): `tok_embeddings`, `pos_embeddings`
(learned positions only), `blocks.N.{attention_norm, attention, ffn_norm, feed_forward}`, `norm`,
`output`. `attention` holds the projections `wq`, `wk`, `wv`, `wo`; `feed_forward` holds `w1` (dim ->
ffn_dim: GELU's input, SwiGLU's gate), `w3` (dim -> ffn_dim, SwiGLU's other input; GELU has none) and
`w2` (ffn_dim -> dim). Heads are found by reshaping with -1, so a plan that splits wq/wk/wv by output
columns leaves each rank its own heads.

Splits: `stages()` = embeddings, each block, final norm + head (ddp_mp and pipeline group them);
`shard_units()` = the blocks (fsdp); `parallel_plan()` = how tensor parallelism splits each module
(strategy=nd); `sequence_positions()` = the positions of the tokens a rank holds when context
parallelism splits each sequence (strategy=nd's cp). `adapt_state_dict` reads GPT-2 files under Hugging
Face's and nanoGPT's names (weights.py calls it); `flops_per_token` is the MFU numerator.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError, require_positive
from .moe import GroupedExperts, MoE, MoEConfig, moe_config, tensor_parallel_style

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    ffn_dim: int
    block_size: int
    norm: str
    pos_embedding: str
    mlp: str
    bias: bool
    tie_embeddings: bool
    norm_eps: float
    rope_theta: float
    init_std: float
    head_dim: int
    qk_norm: bool = False
    moe: MoEConfig | None = None


class Positions:
    """The positions of the tokens this rank's forward runs on, where they are not 0..L-1 (context
    parallelism hands each rank non-contiguous parts of every sequence); None: 0..L-1. One object
    shared by the model's modules (not a buffer: nothing to save, shard or move), read in the
    backward's recomputation too, which may run on another thread."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def of(self, length: int, device: torch.device) -> torch.Tensor:
        if self.value is None:
            return torch.arange(length, device=device)
        return self.value.to(device)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, positions: Positions) -> None:
        super().__init__()
        self.positions = positions
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_head * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_head * cfg.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_head * cfg.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=cfg.bias)
        self.rope_theta = cfg.rope_theta if cfg.pos_embedding == "rope" else None
        self.grouped = cfg.n_kv_head != cfg.n_head
        # Qwen3's: each head's queries and keys RMS-normalised over head_dim before the rotation.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.wq(x).view(batch, length, -1, self.head_dim)
        k = self.wk(x).view(batch, length, -1, self.head_dim)
        v = self.wv(x).view(batch, length, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            cos, sin = rope_angles(
                self.positions.of(length, x.device), self.head_dim, self.rope_theta, x.device
            )
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=self.grouped
        )
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


def rope_angles(
    positions: int | torch.Tensor, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """cos and sin of position x frequency, (length, 1, head_dim / 2), at `positions` (an int L: 0..L-1):
    frequency i is theta^(-2i/head_dim). Computed per call rather than kept as a buffer, so no tensor is
    shared between blocks (each block may be another stage, shard unit or device)."""
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    freqs = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(device=device, dtype=torch.float32), freqs)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, heads, head_dim) with each adjacent pair of channels (2i, 2i+1) rotated by its angle
    (the original Llama layout; Hugging Face's checkpoints pair channel i with i + head_dim/2)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class FeedForward(nn.Module):
    """GELU: w2(gelu(w1 x)). SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: GPTConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = cfg.ffn_dim if hidden is None else hidden
        self.w1 = nn.Linear(cfg.dim, hidden, bias=cfg.bias)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=cfg.bias) if cfg.mlp == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _mlp_plan(at: str, mlp: FeedForward, output: Any) -> dict[str, Any]:
    """A feed-forward's tensor-parallel styles: w1 and w3 split by output columns, w2 by input rows,
    its output summed into `output`'s layout."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {f"{at}.w1": ColwiseParallel(), f"{at}.w2": RowwiseParallel(output_layouts=output)}
    if mlp.w3 is not None:
        plan[f"{at}.w3"] = ColwiseParallel()
    return plan


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)


class Block(nn.Module):
    """`feed_forward` is a FeedForward, or a MoE in the layers model.moe routes (`moe_index`: its
    place among them)."""

    def __init__(
        self, cfg: GPTConfig, positions: Positions | None = None, moe_index: int | None = None
    ) -> None:
        super().__init__()
        self.attention_norm = _norm(cfg)
        self.attention = Attention(cfg, Positions() if positions is None else positions)
        self.ffn_norm = _norm(cfg)
        self.feed_forward: nn.Module
        if cfg.moe is not None and moe_index is not None:
            self.feed_forward = MoE(
                cfg.dim,
                cfg.moe,
                swiglu=cfg.mlp == "swiglu",
                dense=lambda hidden: FeedForward(cfg, hidden),
                index=moe_index,
            )
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Embeddings(nn.Module):
    """The first stage: token ids (B, L) -> vectors (B, L, dim), plus learned positions if any."""

    def __init__(
        self, tok_embeddings: nn.Embedding, pos_embeddings: nn.Embedding | None, positions: Positions
    ) -> None:
        super().__init__()
        self.tok_embeddings = tok_embeddings
        self.pos_embeddings = pos_embeddings
        self.positions = positions

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(self.positions.of(ids.shape[1], ids.device))
        return x


class Head(nn.Module):
    """The last stage: final norm, then logits over the vocabulary."""

    def __init__(self, norm: nn.Module, output: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.output = output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        learned = cfg.pos_embedding == "learned"
        self.pos_embeddings = nn.Embedding(cfg.block_size, cfg.dim) if learned else None
        self._positions = Positions()
        routed = [i for i in range(cfg.n_layer) if cfg.moe is not None and cfg.moe.routed(i)]
        self.blocks = nn.ModuleList(
            Block(cfg, self._positions, routed.index(i) if i in routed else None) for i in range(cfg.n_layer)
        )
        self.norm = _norm(cfg)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # The first and last stages, over modules registered above (a tuple: not registered twice, so
        # the state_dict keeps the names above). forward runs them too: one code path for every split.
        embed = Embeddings(self.tok_embeddings, self.pos_embeddings, self._positions)
        self._ends = (embed, Head(self.norm, self.output))

    def _init_weights(self) -> None:
        """GPT-2's: N(0, init_std) for every matrix and embedding, zero biases, and the two projections
        that add to the residual stream in each block scaled by 1/sqrt(2 n_layer)."""
        std = self.config.init_std
        residual = std / math.sqrt(2 * self.config.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, GroupedExperts):
                for name, weight in module.named_parameters():
                    nn.init.normal_(weight, mean=0.0, std=residual if name == "w2" else std)
        for block in self.blocks:
            assert isinstance(block, Block)
            projections: list[nn.Module] = [block.attention.wo]
            ffn = block.feed_forward
            if isinstance(ffn, FeedForward):
                projections.append(ffn.w2)
            elif isinstance(ffn, MoE) and isinstance(ffn.shared, FeedForward):
                projections.append(ffn.shared.w2)
            for projection in projections:
                assert isinstance(projection, nn.Linear)
                nn.init.normal_(projection.weight, mean=0.0, std=residual)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embed, head = self._ends
        x = embed(ids)
        for block in self.blocks:
            x = block(x)
        return head(x)

    def stages(self) -> list[nn.Module]:
        embed, head = self._ends
        return [embed, *self.blocks, head]

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)

    @contextlib.contextmanager
    def sequence_positions(self, positions: torch.Tensor) -> Iterator[None]:
        """Within: the token ids given to the model (and to any of its stages) are the tokens at
        `positions` (L,) of each sequence, not 0..L-1: what context parallelism hands each rank. The
        causal mask is the attention's business (context parallelism's ring orders it)."""
        before, self._positions.value = self._positions.value, positions
        try:
            yield
        finally:
            self._positions.value = before

    def parallel_plan(
        self, *, tp: int, sequence_parallel: bool, loss_parallel: bool = False
    ) -> dict[str, Any]:
        """The tensor-parallel plan over `tp` ranks: module path -> ParallelStyle, for
        `parallelize_module` (Megatron's split, as PyTorch's TP tutorial and torchtitan apply it to
        Llama). Per block, the q/k/v projections and the MLP's w1/w3 split by output columns (each
        rank its own heads and hidden units), wo and w2 by input rows, so a block costs one
        all-reduce of its output after attention and one after the MLP. The embeddings split by
        vocabulary / position rows, the head by vocabulary columns, its logits gathered whole for
        the task's loss (unless loss_parallel).

        sequence_parallel: between those regions the activations stay split along the sequence
        (dim 1), so the norms run on 1/tp of the tokens; each all-reduce becomes a reduce-scatter,
        and an all-gather brings the sequence back before attention and the MLP.

        loss_parallel: the head's logits stay split by vocabulary (a DTensor), for a cross-entropy
        computed under `loss_parallel()`: no rank ever holds the whole (tokens x vocabulary) logits.

        A size that does not split over `tp` ranks raises UserError naming it."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        self._check_tp(tp, sequence_parallel)
        between = Shard(1) if sequence_parallel else Replicate()  # activations outside attention/MLP
        plan: dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
            "output": ColwiseParallel(
                input_layouts=between,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        }
        if self.pos_embeddings is not None:
            positions = Shard(0) if sequence_parallel else Replicate()  # its output is (L, dim)
            plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=positions)
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        for i, block in enumerate(self.blocks):
            assert isinstance(block, Block)
            at = f"blocks.{i}"
            plan |= {
                f"{at}.attention.wq": ColwiseParallel(),
                f"{at}.attention.wk": ColwiseParallel(),
                f"{at}.attention.wv": ColwiseParallel(),
                f"{at}.attention.wo": RowwiseParallel(output_layouts=between),
            }
            ffn = block.feed_forward
            if isinstance(ffn, MoE):
                # the router whole, each expert's hidden units split (moe.py); the shared experts as a
                # dense MLP inside it, their output whole (the layer hands its output back as it came)
                plan[f"{at}.feed_forward"] = tensor_parallel_style(sequence_parallel=sequence_parallel)
                if isinstance(ffn.shared, FeedForward):
                    plan |= _mlp_plan(f"{at}.feed_forward.shared", ffn.shared, Replicate())
            else:
                assert isinstance(ffn, FeedForward)
                plan |= _mlp_plan(f"{at}.feed_forward", ffn, between)
            if sequence_parallel:
                gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                plan |= {
                    f"{at}.attention_norm": SequenceParallel(),
                    f"{at}.attention": gather,
                    f"{at}.ffn_norm": SequenceParallel(),
                }
                if not isinstance(ffn, MoE):  # a MoE layer's own style gathers its input
                    plan[f"{at}.feed_forward"] = gather
        return plan

    def _check_tp(self, tp: int, sequence_parallel: bool) -> None:
        cfg = self.config
        if cfg.qk_norm:
            raise UserError(
                "tensor parallelism has no plan for per-head query/key norms yet",
                setting="model.qk_norm",
                fix="use strategy.tp=1 with this model, or model.qk_norm=false",
            )
        sizes = [
            ("model.n_head", cfg.n_head, "heads"),
            ("model.n_kv_head", cfg.n_kv_head, "key/value heads"),
            ("model.ffn_dim", cfg.ffn_dim, "MLP hidden units"),
            ("model.vocab_size", cfg.vocab_size, "vocabulary entries"),
        ]
        if cfg.moe is not None:
            sizes.append(("model.moe.ffn_dim", cfg.moe.ffn_dim, "hidden units of each expert"))
        if sequence_parallel:
            sizes.append(("model.block_size", cfg.block_size, "positions of the context"))
        for setting, size, what in sizes:
            if size % tp:
                raise UserError(
                    f"tensor parallelism over {tp} ranks splits the {size} {what}, which do not divide",
                    setting=setting,
                    fix=f"use a {setting} that is a multiple of strategy.tp={tp}, or a tp that divides "
                    f"{size}: {_nearest([d for d in _divisors(size) if d > 1] or [1], tp)}",
                )

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, a tied tensor once. non_embedding: those that multiply activations, i.e. all but
        the token and position embedding tables, the output head counted even when it is the token
        embedding's tensor (nanoGPT's get_num_params; torchtitan's count for untied models)."""
        total = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return total
        tables = self.tok_embeddings.weight.numel()
        if self.pos_embeddings is not None:
            tables += self.pos_embeddings.weight.numel()
        head = self.output.weight.numel() if self.config.tie_embeddings else 0
        return total - tables + head

    def active_params(self, non_embedding: bool = False) -> int:
        """num_params as one token sees them: a MoE layer's experts counted for the top_k a token goes
        to (with the router and shared experts), not all of them. A dense model: num_params."""
        idle = sum(m.num_params() - m.active_params() for m in self.modules() if isinstance(m, MoE))
        return self.num_params(non_embedding) - idle

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward and backward) per token at context length seq_len: 6 N + 12 n_layer
        heads head_dim seq_len, the estimate of the PaLM paper's appendix B that nanoGPT's estimate_mfu
        and torchtitan use. N = active_params(non_embedding=True): 2 FLOPs per parameter and token
        forward, 4 backward, counting a MoE layer's experts a token reaches only (as torchtitan counts
        MoE FLOPs), so MFU is honest for MoE. The second term is attention's two matmuls (scores Q K^T
        and their product with V), counted over the whole seq_len x seq_len square (no saving for the
        causal mask)."""
        cfg = self.config
        width = cfg.n_head * cfg.head_dim
        return 6.0 * self.active_params(non_embedding=True) + 12.0 * cfg.n_layer * width * seq_len

    def adapt_state_dict(
        self, weights: Mapping[str, torch.Tensor], *, strict: bool
    ) -> dict[str, torch.Tensor]:
        """A file's tensors under this model's names (weights.py fits them): a GPT-2 state_dict with
        Hugging Face's or nanoGPT's names is translated, any other returned as it is. Strict loading
        refuses embedding tables sized for another vocabulary or context, naming the setting to change."""
        mine = from_gpt2(weights) if is_gpt2(weights) else dict(weights)
        if strict:
            for key, setting in (
                ("tok_embeddings.weight", "vocab_size"),
                ("pos_embeddings.weight", "block_size"),
            ):
                self._check_rows(mine, key, setting)
        return mine

    def _check_rows(self, weights: Mapping[str, torch.Tensor], key: str, setting: str) -> None:
        theirs = weights.get(key)
        ours = getattr(self.config, setting)
        if (
            theirs is None
            or theirs.dim() != 2
            or (key == "pos_embeddings.weight" and self.pos_embeddings is None)
        ):
            return
        if theirs.shape[0] != ours:
            what = "vocabulary" if setting == "vocab_size" else "context"
            raise UserError(
                f"the weights are for a {what} of {theirs.shape[0]}, the model has {ours}",
                setting=f"model.{setting}",
                fix=f"set model.{setting}={theirs.shape[0]} (it may exceed the data's), or "
                "model.weights_strict=false to leave the embeddings at their initial values",
            )


# ------------------------------------------------------------------------------ GPT-2 weight files

# Hugging Face's GPT2LMHeadModel (and nanoGPT) names, under an optional "transformer." prefix; Conv1D
# layers store (in, out) matrices, nanoGPT's nn.Linear ones (out, in).
GPT2_TOP = {
    "wte.weight": "tok_embeddings.weight",
    "wpe.weight": "pos_embeddings.weight",
    "ln_f.weight": "norm.weight",
    "ln_f.bias": "norm.bias",
}
GPT2_BLOCK = {
    "ln_1": "attention_norm",
    "ln_2": "ffn_norm",
    "attn.c_proj": "attention.wo",
    "mlp.c_fc": "feed_forward.w1",
    "mlp.c_proj": "feed_forward.w2",
}
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
GPT2_MASKS = ("attn.bias", "attn.masked_bias")  # Hugging Face's causal-mask buffers, not weights


def is_gpt2(weights: Mapping[str, torch.Tensor]) -> bool:
    return any(
        key.removeprefix("transformer.") in ("wte.weight", "h.0.attn.c_attn.weight") for key in weights
    )


def from_gpt2(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPT-2 state_dict under GPT's names: the fused q/k/v projection split in three, Conv1D matrices
    transposed to nn.Linear's (out, in), and the head taken from wte where the file has no lm_head
    (GPT-2 ties them)."""
    plain = {key.removeprefix("transformer."): value for key, value in weights.items()}
    fused = plain.get("h.0.attn.c_attn.weight")
    conv1d = fused is None or fused.shape[1] == 3 * fused.shape[0]
    out: dict[str, torch.Tensor] = {}
    for key, value in plain.items():
        parts = key.split(".")
        if key in GPT2_TOP:
            out[GPT2_TOP[key]] = value
        elif key == "lm_head.weight":
            out["output.weight"] = value
        elif parts[0] == "h" and len(parts) >= 4:
            if ".".join(parts[2:]) in GPT2_MASKS:
                continue
            index, layer, leaf = parts[1], ".".join(parts[2:-1]), parts[-1]
            if conv1d and layer in GPT2_CONV1D and leaf == "weight":
                value = value.t()
            if layer == "attn.c_attn":
                for name, chunk in zip(("wq", "wk", "wv"), value.chunk(3, dim=0), strict=True):
                    out[f"blocks.{index}.attention.{name}.{leaf}"] = chunk.contiguous()
            else:
                out[f"blocks.{index}.{GPT2_BLOCK.get(layer, layer)}.{leaf}"] = value.contiguous()
        else:
            out[key] = value  # not GPT-2's: fit() names it as unexpected
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ------------------------------------------------------------------------------ the build function


def gpt(
    *,
    vocab_size: int,
    input_shape: list[int],
    n_layer: int = 6,
    n_head: int = 8,
    n_kv_head: int | None = None,
    dim: int = 256,
    ffn_dim: int | None = None,
    block_size: int | None = None,
    norm: str = "layernorm",
    pos_embedding: str = "learned",
    mlp: str = "gelu",
    bias: bool = True,
    tie_embeddings: bool = False,
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    init_std: float = 0.02,
    head_dim: int | None = None,
    qk_norm: bool = False,
    moe: dict[str, Any] | None = None,
) -> GPT:
    """The model for `vocab_size` (the data's, or a larger one set in model.vocab_size) and samples of
    input_shape = (L,) token ids. n_kv_head null: n_head. ffn_dim null: 4 dim (gelu), or Llama's 8/3
    dim rounded up to a multiple of 256 (swiglu). block_size null: the data's L. Every setting is
    checked here, so pre-flight's build on the meta device refuses a bad one before anything starts.
    head_dim null: dim / n_head (Qwen3 sets it apart). moe null: a dense model; else model.moe's
    settings (moe.py)."""
    _check_names(norm=norm, pos_embedding=pos_embedding, mlp=mlp)
    if len(input_shape) != 1:
        raise UserError(
            f"reads a sequence of token ids per sample, but the data's samples are {tuple(input_shape)}",
            setting="model",
            fix="use a dataset of token ids with this model",
        )
    length = input_shape[0]
    block_size = length if block_size is None else block_size
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    sizes = dict(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, dim=dim, block_size=block_size)
    require_positive(
        {f"model.{k}": v for k, v in sizes.items()}, {"model.ffn_dim": ffn_dim, "model.head_dim": head_dim}
    )
    _check_heads(dim=dim, n_head=n_head, n_kv_head=n_kv_head, rope=pos_embedding == "rope", head_dim=head_dim)
    if length > block_size:
        raise UserError(
            f"the data's samples are {length} tokens, longer than the model's context of {block_size}",
            setting="model.block_size",
            fix=f"set model.block_size={length} (or null: the data's length), or make the data's samples "
            f"at most {block_size} tokens",
        )
    if ffn_dim is None:
        ffn_dim = 4 * dim if mlp == "gelu" else 256 * math.ceil(8 * dim / 3 / 256)
    routing = moe_config(moe, n_layer=n_layer, mlp_hidden=ffn_dim)
    cfg = GPTConfig(
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        dim=dim,
        ffn_dim=ffn_dim,
        block_size=block_size,
        norm=norm,
        pos_embedding=pos_embedding,
        mlp=mlp,
        bias=bias,
        tie_embeddings=tie_embeddings,
        norm_eps=norm_eps,
        rope_theta=rope_theta,
        init_std=init_std,
        head_dim=dim // n_head if head_dim is None else head_dim,
        qk_norm=qk_norm,
        moe=routing,
    )
    return GPT(cfg)


def _check_names(**chosen: str) -> None:
    for setting, known in (("norm", NORMS), ("pos_embedding", POSITIONS), ("mlp", MLPS)):
        if chosen[setting] not in known:
            raise UserError(
                f"unknown {setting} {chosen[setting]!r}",
                setting=f"model.{setting}",
                fix=f"use one of {', '.join(known)}",
            )


def _check_heads(*, dim: int, n_head: int, n_kv_head: int, rope: bool, head_dim: int | None) -> None:
    if head_dim is None and dim % n_head:
        raise UserError(
            f"{n_head} heads do not divide dim {dim}",
            setting="model.n_head",
            fix=f"use a divisor of {dim}: {_nearest(_divisors(dim), n_head)}",
        )
    if n_head % n_kv_head:
        raise UserError(
            f"{n_kv_head} key/value heads do not divide {n_head} heads",
            setting="model.n_kv_head",
            fix=f"use a divisor of {n_head}: {_nearest(_divisors(n_head), n_kv_head)}",
        )
    if rope and head_dim is not None and head_dim % 2:
        raise UserError(
            f"rotary embeddings rotate channel pairs, but model.head_dim={head_dim} is odd",
            setting="model.head_dim",
            fix=f"use an even head_dim: {head_dim + 1}, or null: dim / n_head",
        )
    if rope and head_dim is None and (dim // n_head) % 2:
        even = [h for h in _divisors(dim) if (dim // h) % 2 == 0]
        raise UserError(
            f"rotary embeddings rotate channel pairs, but the head size dim/n_head = {dim // n_head} is odd",
            setting="model.n_head",
            fix=f"use an n_head that leaves an even head size: {_nearest(even, n_head)}",
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(candidates: list[int], wanted: int) -> str:
    """The candidates just below and just above `wanted`, as a fix offers them."""
    below = [c for c in candidates if c <= wanted]
    above = [c for c in candidates if c >= wanted]
    near = sorted({*below[-1:], *above[:1]})
    return " or ".join(map(str, near))

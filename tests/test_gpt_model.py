"""model=gpt: both forms' forward (shapes, causality, grouped-query attention, rotary embeddings), how
it splits (stages, shard units, tied embeddings), its named sizes built on the meta device as
pre-flight builds them (exact published parameter counts), the FLOPs estimate, GPT-2 weight files, and
bad settings refused in one line before anything starts."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hydra import compose

from ddpexp import models, weights
from ddpexp.data import DataInfo
from ddpexp.errors import UserError
from ddpexp.models.gpt import GPT
from ddpexp.preflight import check_model
from ddpexp.strategies.ddp_mp import StageChain, group
from ddpexp.strategies.fsdp import shard_units

from .test_cli import refuse

pytestmark = pytest.mark.usefixtures("hydra_conf")

BYTES = DataInfo(num_classes=256, input_shape=(64,), vocab_size=256)  # what a byte-level corpus gives
LLAMA_FORM = ["model.norm=rmsnorm", "model.pos_embedding=rope", "model.mlp=swiglu", "model.bias=false"]
FORMS = {"gpt2": [], "llama": [*LLAMA_FORM, "model.n_kv_head=2"]}
# The published shapes and their parameter counts (the model cards'): built on the meta device only.
PUBLISHED = {
    "gpt2_124m": 124_439_808,
    "llama3_2_1b": 1_235_814_400,
    "llama3_1_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_1_405b": 405_853_388_800,
    "mixtral_8x7b": 46_702_792_704,
    "mixtral_8x22b": 140_630_071_296,
    "qwen3_30b_a3b": 30_532_122_624,
}


def config(*overrides: str) -> Any:
    return compose(config_name="config", overrides=list(overrides))


def built(*overrides: str) -> GPT:
    """model=gpt_tiny as a run builds it (models.build with the data's facts), seeded."""
    cfg = config("model=gpt_tiny", *overrides)
    torch.manual_seed(0)
    model = models.build(cfg.model, BYTES)
    assert isinstance(model, GPT)
    return model


def ids(batch: int = 3, length: int = 64, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------ the forward


@pytest.mark.parametrize("form", FORMS)
def test_token_ids_give_float_logits_over_the_vocabulary_at_every_position(form: str):
    model = built(*FORMS[form])
    for length in (64, 17):  # the context, and any shorter input
        out = model(ids(length=length))
        assert out.shape == (3, length, 256) and out.dtype == torch.float32


@pytest.mark.parametrize("form", FORMS)
def test_a_later_token_never_changes_an_earlier_prediction(form: str):
    model = built(*FORMS[form])
    x = ids()
    changed = x.clone()
    changed[:, 40] = (changed[:, 40] + 1) % 256
    before, after = model(x), model(changed)
    torch.testing.assert_close(after[:, :40], before[:, :40], rtol=0, atol=0)
    assert not torch.allclose(after[:, 40:], before[:, 40:])


@pytest.mark.parametrize("form", FORMS)
def test_positions_reach_the_predictions(form: str):
    """With one block and no position information, the last position would see the tokens before it as
    a set: shuffling them would not change its logits. Learned and rotary positions both make it."""
    model = built(*FORMS[form], "model.n_layer=1")
    x = ids()
    shuffled = torch.cat([x[:, :-1].flip(1), x[:, -1:]], dim=1)
    assert not torch.allclose(model(shuffled)[:, -1], model(x)[:, -1], atol=1e-4)


def llama_reference(model: GPT, x: torch.Tensor) -> torch.Tensor:
    """Llama's forward written out from the model's tensors: RMSNorm, rotary embeddings in the complex
    form of Llama's reference code, each key/value head repeated for its group of query heads,
    masked attention by hand, SwiGLU."""
    cfg, state = model.config, model.state_dict()
    batch, length = x.shape
    hd, group_size = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    freqs = cfg.rope_theta ** (-torch.arange(0, hd, 2).float() / hd)
    turn = torch.polar(torch.ones(length, hd // 2), torch.outer(torch.arange(length).float(), freqs))
    future = ~torch.ones(length, length, dtype=torch.bool).tril()

    def rms(h: torch.Tensor, name: str) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * state[name + ".weight"]

    def heads(h: torch.Tensor, rotary: bool) -> torch.Tensor:
        h = h.view(batch, length, -1, hd)
        if rotary:
            h = torch.view_as_real(torch.view_as_complex(h.unflatten(-1, (-1, 2))) * turn[:, None]).flatten(
                -2
            )
        return h.transpose(1, 2)

    h = state["tok_embeddings.weight"][x]
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        a = rms(h, p + "attention_norm")
        q = heads(a @ state[p + "attention.wq.weight"].T, rotary=True)
        k = heads(a @ state[p + "attention.wk.weight"].T, rotary=True).repeat_interleave(group_size, 1)
        v = heads(a @ state[p + "attention.wv.weight"].T, rotary=False).repeat_interleave(group_size, 1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(future, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)
        h = h + out @ state[p + "attention.wo.weight"].T
        f = rms(h, p + "ffn_norm")
        gate, up = f @ state[p + "feed_forward.w1.weight"].T, f @ state[p + "feed_forward.w3.weight"].T
        h = h + (F.silu(gate) * up) @ state[p + "feed_forward.w2.weight"].T
    return rms(h, "norm") @ state["output.weight"].T


def test_the_llama_form_computes_llamas_forward():
    model = built(*FORMS["llama"], "model.rope_theta=500000", "model.tie_embeddings=true")
    x = ids()
    torch.testing.assert_close(model(x), llama_reference(model, x), rtol=1e-5, atol=1e-5)


def test_the_two_forms_have_their_own_layers():
    gpt2, llama = built(*FORMS["gpt2"]), built(*FORMS["llama"])
    assert isinstance(gpt2.norm, torch.nn.LayerNorm) and isinstance(llama.norm, torch.nn.RMSNorm)
    assert gpt2.pos_embeddings is not None and llama.pos_embeddings is None
    block2, block_l = gpt2.blocks[0], llama.blocks[0]
    assert block2.feed_forward.w3 is None and block_l.feed_forward.w3 is not None
    assert block2.attention.wq.bias is not None and block_l.attention.wq.bias is None
    assert block_l.attention.wk.out_features == 2 * 16  # 2 key/value heads of dim 64/4
    assert all(not isinstance(m, torch.nn.Dropout) for m in [*gpt2.modules(), *llama.modules()])


def test_grouped_query_attention_shares_each_key_value_head_with_its_group():
    """n_kv_head=2 of 4 heads = the same model with each key/value head's weights repeated for the two
    query heads of its group (heads 0,1 read kv head 0; heads 2,3 kv head 1)."""
    grouped = built(*LLAMA_FORM, "model.n_kv_head=2")
    full = built(*LLAMA_FORM, "model.n_kv_head=4")
    state = grouped.state_dict()
    for name, tensor in state.items():
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            state[name] = tensor.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
    full.load_state_dict(state)
    torch.testing.assert_close(full(ids()), grouped(ids()))


def test_rotary_embeddings_rotate_each_channel_pair_by_position_times_frequency():
    """Against the complex-number form of the RoPE paper (Llama's reference code): channel pair i of
    position m is multiplied by exp(i m theta^(-2i/d))."""
    from ddpexp.models.gpt import rope_angles, rotate

    x = torch.randn(2, 10, 3, 8)
    cos, sin = rope_angles(10, 8, 500000.0, x.device)
    freqs = 500000.0 ** (-torch.arange(0, 8, 2).float() / 8)
    turn = torch.polar(torch.ones(10, 4), torch.outer(torch.arange(10).float(), freqs))
    reference = torch.view_as_real(torch.view_as_complex(x.reshape(2, 10, 3, 4, 2)) * turn[:, None, :])
    torch.testing.assert_close(rotate(x, cos, sin), reference.flatten(-2))


def test_rotary_attention_scores_depend_on_relative_positions_only():
    """The point of RoPE: a query and a key moved the same number of positions later score the same."""
    from ddpexp.models.gpt import rope_angles, rotate

    q, k = torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16)
    cos, sin = rope_angles(16, 16, 10000.0, q.device)

    def scores(start: int) -> torch.Tensor:
        at = slice(start, start + 6)
        return torch.einsum("bqhd,bkhd->bhqk", rotate(q, cos[at], sin[at]), rotate(k, cos[at], sin[at]))

    torch.testing.assert_close(scores(10), scores(0), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scores(0), torch.einsum("bqhd,bkhd->bhqk", q, k), atol=1e-2)


# ------------------------------------------------------------------------------------ tied embeddings


def test_tied_embeddings_are_one_tensor_under_both_names_that_both_uses_train():
    tied, untied = built("model.tie_embeddings=true"), built()
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert untied.num_params() - tied.num_params() == 256 * 64
    untied.load_state_dict(tied.state_dict())  # both names saved: the untied model takes the same values
    x = ids()
    torch.testing.assert_close(untied(x), tied(x), rtol=0, atol=0)
    tied(x).square().mean().backward()
    untied(x).square().mean().backward()
    both = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, both)


# ------------------------------------------------------------------------------------ splits


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=true"], FORMS["llama"]])
def test_stages_composed_in_order_are_the_forward(overrides: list[str]):
    """Embeddings, each block, norm + head; grouped into k consecutive parts (as ddp_mp and pipeline
    group them) for every k, the chain gives the model's own logits."""
    model = built("model.n_layer=3", *overrides)
    stages = model.stages()
    assert len(stages) == 5 and stages[1:4] == list(model.blocks)
    x = ids(batch=2, length=16)
    for k in range(1, len(stages) + 1):
        chain = StageChain(group(list(model.stages()), k), [torch.device("cpu")] * k)
        torch.testing.assert_close(chain(x), model(x), rtol=0, atol=0)


def test_fsdp_shards_each_block_and_the_rest_with_the_root():
    for model in (built("model.n_layer=3"), built("model.n_layer=3", "model.tie_embeddings=true")):
        assert model.shard_units() == list(model.blocks)
        assert shard_units(model) == list(model.blocks)  # the tie is outside every block


@pytest.mark.parametrize("strategy", ["pipeline", "ddp_mp"])
def test_stages_on_other_devices_or_processes_refuse_tied_embeddings_naming_the_setting(strategy: str):
    """A tensor cannot live in two stages: pre-flight refuses the tie, and the untied model passes."""
    cfg = config("model=gpt_tiny", f"strategy={strategy}", "model.tie_embeddings=true")
    with pytest.raises(UserError) as refused:
        check_model(cfg.model, BYTES, cfg)
    line = str(refused.value)
    assert "tok_embeddings.weight" in line and "model.tie_embeddings=false" in line and "\n" not in line
    cfg = config("model=gpt_tiny", f"strategy={strategy}")
    check_model(cfg.model, BYTES, cfg)


# ------------------------------------------------------------------------------------ named sizes


@pytest.mark.parametrize(("name", "count"), PUBLISHED.items())
def test_published_shapes_built_on_meta_have_their_exact_parameter_counts(name: str, count: int):
    """As pre-flight builds them (the user's model=NAME on a byte corpus: a vocabulary larger than the
    data's is allowed), on the meta device: no memory, exact counts."""
    cfg = config(f"model={name}")
    model = check_model(cfg.model, BYTES, cfg)
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == count
    assert model.tok_embeddings.num_embeddings == cfg.model.vocab_size  # the model's, not the data's


def test_the_docs_give_each_named_size_its_parameter_count():
    """docs/models-data.md's table of transformer sizes states the counts these builds give."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "models-data.md").read_text()
    rows = {m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"^\| `(\w+)` \| ([\d,]+) \|", page, re.M)}
    names = ["gpt_tiny", "gpt_small", "gpt", *PUBLISHED]
    assert set(names) <= rows.keys(), rows
    for name in names:
        cfg = config(f"model={name}")
        with torch.device("meta"):
            model = models.build(cfg.model, BYTES)
        assert rows[name] == sum(p.numel() for p in model.parameters()), name


def test_flops_per_token_is_six_n_plus_the_attention_term():
    """GPT-2 124M at its context of 1024: N = 124,439,808 less the 1024 x 768 position table (the tied
    head counts, as nanoGPT counts it); 6 N + 12 x 12 layers x 768 x 1024."""
    with torch.device("meta"):
        model = models.build(config("model=gpt2_124m").model, BYTES)
    assert model.num_params(non_embedding=True) == 124_439_808 - 1024 * 768
    assert model.flops_per_token(1024) == 6 * 123_653_376 + 12 * 12 * 768 * 1024 == 855_166_464
    with torch.device("meta"):
        untied = models.build(config("model=llama3_1_8b").model, BYTES)
    assert untied.num_params(non_embedding=True) == 8_030_261_248 - 128256 * 4096  # the head counts


# ------------------------------------------------------------------------------------ the data's facts


def test_vocab_size_comes_from_the_data_unless_a_larger_one_is_set():
    assert built().tok_embeddings.num_embeddings == 256
    assert built("model.vocab_size=50257").tok_embeddings.num_embeddings == 50257
    with pytest.raises(UserError) as refused:
        built("model.vocab_size=100")
    assert str(refused.value) == (
        "model.vocab_size: is 100 but the dataset provides 256 (fix: set model.vocab_size>=256, or null: "
        "the dataset's)"
    )


def test_block_size_null_is_the_data_length():
    assert built("model.block_size=null").pos_embeddings.num_embeddings == 64


BAD = [
    (["model.n_head=5"], "model.n_head: 5 heads do not divide dim 64 (fix: use a divisor of 64: 4 or 8)"),
    (
        ["model.n_kv_head=3"],
        "model.n_kv_head: 3 key/value heads do not divide 4 heads (fix: use a divisor of 4: 2 or 4)",
    ),
    (
        ["model.block_size=32"],
        "model.block_size: the data's samples are 64 tokens, longer than the model's context of 32",
    ),
    (["model.norm=batchnorm"], "model.norm: unknown norm 'batchnorm' (fix: use one of layernorm, rmsnorm)"),
    (["model.mlp=relu"], "model.mlp: unknown mlp 'relu' (fix: use one of gelu, swiglu)"),
    (
        ["model.pos_embedding=alibi"],
        "model.pos_embedding: unknown pos_embedding 'alibi' (fix: use one of learned, rope)",
    ),
    (
        ["model.pos_embedding=rope", "model.n_head=64"],
        "model.n_head: rotary embeddings rotate channel pairs, but the head size",
    ),
    (["model.n_layer=0"], "model.n_layer: must be positive, got 0"),
]


@pytest.mark.parametrize(("overrides", "start"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_settings_are_refused_by_preflight_in_one_line_with_the_fix(overrides: list[str], start: str):
    cfg = config("model=gpt_tiny", *overrides)
    with pytest.raises(UserError) as refused:
        check_model(cfg.model, BYTES, cfg)
    line = str(refused.value)
    assert line.startswith(start) and "(fix: " in line and "\n" not in line, line


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.n_head=5"], ["model.n_head: 5 heads do not divide dim 64", "4 or 8"]),
        (["data.block_size=128"], ["model.block_size", "128 tokens", "context of 64"]),
        (["strategy=pipeline", "model.tie_embeddings=true"], ["tied weights", "model.tie_embeddings=false"]),
        (["strategy=pipeline", "strategy.stages=5"], ["strategy.stages: GPT splits into at most 4 stages"]),
        (
            ["model.block_size=null", "data.block_size=4000", "data.max_bytes=30000", "trainer.batch_size=2"],
            ["data.block_size: the eval split of python_stdlib holds", "fewer than one sample"],
        ),
    ],
)
def test_the_command_line_refuses_a_bad_transformer_before_anything_starts(
    overrides: list[str], words: list[str], tmp_path: Path, monkeypatch, capsys
):
    """Through `python -m ddpexp` on the corpus every machine has (the standard library's source)."""
    args = ["model=gpt_tiny", "data=python_stdlib", "task=lm", *overrides]
    line = refuse(tmp_path, monkeypatch, capsys, *args)
    assert all(word in line for word in words), line


def test_the_command_line_refuses_weights_for_another_vocabulary_before_anything_starts(
    tmp_path: Path, tmp_path_factory, monkeypatch, capsys
):
    path = save_as(gpt2_state(vocab=300), "huggingface", tmp_path_factory.mktemp("weights") / "gpt2.pt")
    args = ["model=gpt_tiny", "model.tie_embeddings=true", f"model.weights={path}"]
    line = refuse(tmp_path, monkeypatch, capsys, *args, "data=python_stdlib", "task=lm")
    assert line.startswith("ddpexp: error: model.vocab_size: the weights are for a vocabulary of 300"), line


# ------------------------------------------------------------------------------------ GPT-2 weights


def gpt2_state(
    vocab: int = 256, layers: int = 2, dim: int = 64, context: int = 64
) -> dict[str, torch.Tensor]:
    """A GPT-2 state_dict as Hugging Face's GPT2LMHeadModel holds it: Conv1D matrices stored (in,
    out), q/k/v fused in c_attn, the causal-mask buffers, lm_head the very tensor of wte."""
    g = torch.Generator().manual_seed(2)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    state = {"transformer.wte.weight": r(vocab, dim), "transformer.wpe.weight": r(context, dim)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        state |= {
            p + "ln_1.weight": 1 + r(dim),
            p + "ln_1.bias": r(dim),
            p + "attn.bias": torch.ones(context, context).tril().view(1, 1, context, context),
            p + "attn.masked_bias": torch.tensor(-1e4),
            p + "attn.c_attn.weight": r(dim, 3 * dim),
            p + "attn.c_attn.bias": r(3 * dim),
            p + "attn.c_proj.weight": r(dim, dim),
            p + "attn.c_proj.bias": r(dim),
            p + "ln_2.weight": 1 + r(dim),
            p + "ln_2.bias": r(dim),
            p + "mlp.c_fc.weight": r(dim, 4 * dim),
            p + "mlp.c_fc.bias": r(4 * dim),
            p + "mlp.c_proj.weight": r(4 * dim, dim),
            p + "mlp.c_proj.bias": r(dim),
        }
    state |= {"transformer.ln_f.weight": 1 + r(dim), "transformer.ln_f.bias": r(dim)}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def gpt2_reference(state: dict[str, torch.Tensor], x: torch.Tensor, n_head: int) -> torch.Tensor:
    """GPT-2's forward written out from the file's own tensors: Conv1D is x @ W + b, attention masked
    by hand, GELU in its tanh form."""
    batch, length = x.shape
    dim = state["transformer.wte.weight"].shape[1]
    hd = dim // n_head

    def ln(h: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(h, (dim,), state[name + ".weight"], state[name + ".bias"], eps=1e-5)

    def conv1d(h: torch.Tensor, name: str) -> torch.Tensor:
        return h @ state[name + ".weight"] + state[name + ".bias"]

    h = state["transformer.wte.weight"][x] + state["transformer.wpe.weight"][:length]
    future = ~torch.ones(length, length, dtype=torch.bool).tril()
    layers = len({k.split(".")[2] for k in state if k.startswith("transformer.h.")})
    for i in range(layers):
        p = f"transformer.h.{i}."
        q, k, v = (
            t.view(batch, length, n_head, hd).transpose(1, 2)
            for t in conv1d(ln(h, p + "ln_1"), p + "attn.c_attn").split(dim, dim=-1)
        )
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(future, float("-inf"))
        h = h + conv1d(
            (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, dim), p + "attn.c_proj"
        )
        a = conv1d(ln(h, p + "ln_2"), p + "mlp.c_fc")
        a = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
        h = h + conv1d(a, p + "mlp.c_proj")
    return ln(h, "transformer.ln_f") @ state["lm_head.weight"].T


def save_as(state: dict[str, torch.Tensor], layout: str, path: Path) -> Path:
    """huggingface: the state_dict as it is. gpt2model: Hugging Face's GPT2Model (no prefix, no head).
    nanogpt: nanoGPT's ckpt.pt, {"model": ...} with nn.Linear's (out, in) matrices, no mask buffers,
    saved from a torch.compile'd model."""
    if layout == "gpt2model":
        saved: dict[str, Any] = {
            k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"
        }
    elif layout == "nanogpt":
        conv1d = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
        linear = {
            k: v.t().contiguous() if k.endswith(conv1d) else v for k, v in state.items() if "_bias" not in k
        }
        linear = {k: v for k, v in linear.items() if not k.endswith(".attn.bias")}
        saved = {"model": {"_orig_mod." + k: v for k, v in linear.items()}, "iter_num": 100}
    else:
        saved = state
    torch.save(saved, path)
    return path


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layout", ["huggingface", "gpt2model", "nanogpt"])
def test_gpt2_weights_load_through_model_weights_and_give_gpt2s_logits(
    layout: str, tied: bool, tmp_path: Path
):
    """model.weights=FILE as a run takes it: pre-flight fits the file to the meta model, each worker
    builds the model and loads it (train.build_model); the logits are GPT-2's from the same tensors."""
    state = gpt2_state()
    path = save_as(state, layout, tmp_path / "gpt2.pt")
    cfg = config("model=gpt_tiny", f"model.tie_embeddings={tied}", f"model.weights={path}")
    weights.check_initial(cfg.model, check_model(cfg.model, BYTES, cfg))
    model = models.build(cfg.model, BYTES)
    weights.load_initial(model, cfg.model)
    x = ids()
    torch.testing.assert_close(model(x), gpt2_reference(state, x, n_head=4), rtol=1e-5, atol=1e-5)


def test_a_gpt2_file_for_another_vocabulary_is_refused_naming_model_vocab_size(tmp_path: Path):
    """Pre-flight refuses it in one line; following the fix (a vocabulary larger than the data's is
    allowed) loads it; weights_strict=false loads the blocks and leaves the embeddings."""
    state = gpt2_state(vocab=300)
    path = save_as(state, "huggingface", tmp_path / "gpt2.pt")
    cfg = config("model=gpt_tiny", "model.tie_embeddings=true", f"model.weights={path}")
    with pytest.raises(UserError) as refused:
        weights.check_initial(cfg.model, check_model(cfg.model, BYTES, cfg))
    assert str(refused.value) == (
        "model.vocab_size: the weights are for a vocabulary of 300, the model has 256 (fix: set "
        "model.vocab_size=300 (it may exceed the data's), or model.weights_strict=false to leave the "
        "embeddings at their initial values)"
    )
    fixed = config(
        "model=gpt_tiny", "model.tie_embeddings=true", f"model.weights={path}", "model.vocab_size=300"
    )
    model = models.build(fixed.model, BYTES)
    weights.load_initial(model, fixed.model)
    torch.testing.assert_close(model(ids()), gpt2_reference(state, ids(), n_head=4), rtol=1e-5, atol=1e-5)

    loose = config("model=gpt_tiny", f"model.weights={path}", "model.weights_strict=false")
    model = models.build(loose.model, BYTES)
    before = model.tok_embeddings.weight.clone()
    weights.load_initial(model, loose.model)
    torch.testing.assert_close(model.tok_embeddings.weight, before, rtol=0, atol=0)
    torch.testing.assert_close(model.blocks[1].feed_forward.w1.bias, state["transformer.h.1.mlp.c_fc.bias"])


def test_a_gpt2_file_for_a_longer_context_is_refused_naming_model_block_size(tmp_path: Path):
    path = save_as(gpt2_state(context=1024), "huggingface", tmp_path / "gpt2.pt")
    cfg = config("model=gpt_tiny", f"model.weights={path}")
    with pytest.raises(UserError) as refused:
        weights.check_initial(cfg.model, check_model(cfg.model, BYTES, cfg))
    assert str(refused.value).startswith(
        "model.block_size: the weights are for a context of 1024, the model has 64 "
        "(fix: set model.block_size=1024"
    )


def test_initialisation_is_gpt2s():
    """N(0, 0.02) weights, zero biases, unit norms; the residual projections at 0.02 / sqrt(2 n_layer)."""
    model = built("model.dim=256", "model.n_layer=4")
    block = model.blocks[0]
    for weight in (model.tok_embeddings.weight, block.attention.wq.weight, block.feed_forward.w1.weight):
        assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    for weight in (block.attention.wo.weight, block.feed_forward.w2.weight):
        assert weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert block.attention.wq.bias.eq(0).all() and block.attention_norm.weight.eq(1).all()


def test_a_transformer_on_images_is_refused_naming_the_token_corpus(tmp_path: Path, monkeypatch, capsys):
    """`python -m ddpexp model=gpt_tiny` alone meets the default data (digits, images)."""
    line = refuse(tmp_path, monkeypatch, capsys, "model=gpt_tiny")
    assert "reads token ids but this dataset gives images" in line, line
    assert "data=python_stdlib task=lm" in line, line

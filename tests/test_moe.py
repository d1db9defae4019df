"""The mixture-of-experts transformer (models/moe.py): published shapes to the parameter, routing that
a plain loop over tokens reproduces, a load-balancing loss that reaches the gradients as its formula
says and is the same on any split of the batch, the capacity's drop rule, and the routing metrics."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ddpexp.errors import UserError
from ddpexp.models import moe
from ddpexp.models.gpt import GPT, gpt

from .conftest import made_once, metrics, run_here, scalars, weights

TINY = dict(
    vocab_size=64,
    input_shape=[16],
    n_layer=2,
    n_head=4,
    dim=32,
    norm="rmsnorm",
    pos_embedding="rope",
    mlp="swiglu",
    bias=False,
)
ROUTED = dict(experts=4, top_k=2, ffn_dim=48)

# Published totals and active parameters (the models' Hugging Face configs; Mixtral's paper gives 47B
# and 13B, Mistral 141B and 39B, Qwen3's card 30.5B and 3.3B).
PUBLISHED = {
    "mixtral_8x7b": (32000, 46_702_792_704, 12_879_925_248),
    "mixtral_8x22b": (32768, 140_630_071_296, 39_161_468_928),
    "qwen3_30b_a3b": (151936, 30_532_122_624, 3_353_032_704),
}


def tiny(**routing: object) -> GPT:
    torch.manual_seed(0)
    return gpt(**TINY, moe={**ROUTED, **routing})


@pytest.mark.usefixtures("hydra_conf")
@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_moe_shapes_have_their_published_parameter_counts(name: str):
    from hydra import compose
    from hydra.utils import instantiate

    vocab, total, active = PUBLISHED[name]
    cfg = OmegaConf.to_container(compose(config_name="config", overrides=[f"model={name}"]).model)
    args = {k: v for k, v in cfg.items() if k not in ("weights", "weights_strict")}
    with torch.device("meta"):
        model = instantiate({**args, "vocab_size": vocab}, input_shape=[128])
    assert (model.num_params(), model.active_params()) == (total, active)


def test_tensor_parallelism_plans_each_expert_split_by_hidden_unit_and_the_router_whole():
    """The plan gives a MoE layer its own style (the router left out of it), its shared experts the
    dense MLP's; the experts split on their hidden units."""
    from ddpexp.models.moe import is_tensor_parallel_style
    from ddpexp.strategies.nd import tensor_parallel

    model = tiny(shared_experts=1)
    plan = model.parallel_plan(tp=2, sequence_parallel=True)
    assert is_tensor_parallel_style(plan["blocks.0.feed_forward"])
    assert {"blocks.0.feed_forward.shared.w1", "blocks.0.feed_forward.shared.w2"} <= plan.keys()
    assert not any("router" in path for path in plan)
    dims = tensor_parallel.split_dims(model, plan)
    experts = model.blocks[0].feed_forward.experts
    assert [dims[id(experts.w1)], dims[id(experts.w2)], dims[id(experts.w3)]] == [1, 2, 1]
    assert id(model.blocks[0].feed_forward.router.weight) not in dims


def test_flops_per_token_count_the_experts_a_token_reaches():
    model = tiny()
    dense_part = model.active_params(non_embedding=True)
    assert dense_part < model.num_params(non_embedding=True)
    expected = 6 * dense_part + 12 * 2 * 32 * 16
    assert model.flops_per_token(16) == expected


def reference_moe(layer: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the top-k experts' outputs weighted by their renormalised softmax scores."""
    cfg, experts = layer.cfg, layer.experts
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            token = x[b, t]
            scores = layer.router(token).softmax(-1)
            top, chosen = scores.topk(cfg.top_k)
            top = top / top.sum()
            for weight, e in zip(top, chosen.tolist(), strict=True):
                hidden = F.silu(experts.w1[e] @ token) * (experts.w3[e] @ token)
                out[b, t] += weight * (experts.w2[e] @ hidden)
    return out


def test_dropless_routing_gives_each_token_its_top_k_experts_weighted_by_their_scores():
    layer = tiny().blocks[0].feed_forward
    x = torch.randn(3, 16, 32)
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)
    # control: outputs handed back to the wrong tokens (a combine off by one place) are caught
    layer.run_experts = lambda tokens, counts: layer.experts(tokens, counts).roll(1, dims=0)
    assert not torch.allclose(layer(x), reference_moe(layer, x), rtol=1e-3, atol=1e-4)


def lm_loss(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def gradients(model: GPT, ids: torch.Tensor, parts: int, per_step: int) -> dict[str, torch.Tensor]:
    """One optimizer step's gradient over `ids` cut into `parts` micro-batches, as the engine takes it
    (each micro-batch's loss over parts) with `per_step` sequences to a rank's step."""
    model.zero_grad()
    moe.balance_over(model, per_step)
    for part in ids.chunk(parts):
        (lm_loss(model, part) / parts).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def explicit_balance_loss(model: GPT, ids: torch.Tensor, coef: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise loss, written out: per sequence and MoE layer, coef x sum_i f_i P_i,
    f_i = E / (K L) x tokens choosing i, P_i = mean over the sequence of i's normalised score;
    averaged over the sequences, summed over the layers."""
    inputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
        for layer in moe.routing_layers(model)
    ]
    model(ids[:, :-1])
    for hook in hooks:
        hook.remove()
    total = torch.zeros(())
    for layer, x in zip(moe.routing_layers(model), inputs, strict=True):
        cfg = layer.cfg
        for sequence in x:
            scores = layer.router(sequence).float().softmax(-1)
            chosen = scores.topk(cfg.top_k, dim=-1).indices
            f = torch.zeros(cfg.experts)
            for e in chosen.flatten().tolist():
                f[e] += cfg.experts / (cfg.top_k * sequence.shape[0])
            p = (scores / scores.sum(-1, keepdim=True)).mean(0)
            total = total + coef * (f * p).sum() / x.shape[0]
    return total


def test_the_balance_loss_reaches_the_gradients_as_its_formula_says():
    model = tiny(aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (4, 17))
    ours = gradients(model, ids, 1, per_step=4)
    for layer in moe.routing_layers(model):  # the model's own loss off: the explicit one instead
        layer.cfg = dataclasses.replace(layer.cfg, aux_loss_coef=0.0)
    model.zero_grad()
    (lm_loss(model, ids) + explicit_balance_loss(model, ids, 0.5)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    without = tiny(aux_loss_coef=0.0)
    router = "blocks.0.feed_forward.router.weight"
    assert not torch.allclose(gradients(without, ids, 1, per_step=4)[router], ours[router], atol=1e-6)


def test_the_balance_loss_is_the_same_on_any_split_of_the_global_batch():
    """Whole, in two micro-batches, and over two 'ranks' whose gradients are averaged (DDP's): the
    same gradient, as the strategies' parity with single needs."""
    model = tiny(aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (4, 17))
    whole = gradients(model, ids, 1, per_step=4)
    accumulated = gradients(model, ids, 2, per_step=4)
    ranks = [gradients(model, half, 1, per_step=2) for half in ids.chunk(2)]
    for name, value in whole.items():
        torch.testing.assert_close(accumulated[name], value, rtol=1e-5, atol=1e-8, msg=name)
        torch.testing.assert_close((ranks[0][name] + ranks[1][name]) / 2, value, rtol=1e-5, atol=1e-8)
    # control: a rank that scaled by the global batch instead of its own would be caught
    wrong = [gradients(model, half, 1, per_step=4) for half in ids.chunk(2)]
    router = "blocks.0.feed_forward.router.weight"
    assert not torch.allclose((wrong[0][router] + wrong[1][router]) / 2, whole[router], rtol=1e-3)


def test_the_capacity_drops_an_expert_s_latest_tokens_of_each_sequence():
    """Every token prefers expert 0 (top-1): with capacity factor 1 over 4 experts an 8-token sequence
    gives each expert 2 places, so expert 0 keeps positions 0 and 1 of each sequence."""
    model = gpt(**TINY, moe={**ROUTED, "top_k": 1, "capacity_factor": 1.0})
    layer = model.blocks[0].feed_forward
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.ones(3, 8, 32) + 0.01 * torch.randn(3, 8, 32)
    out = layer.train()(x)
    kept = out.abs().sum(-1) > 0
    assert kept.tolist() == [[True, True] + [False] * 6] * 3
    summary = moe.routing_summary(layer.counts.take(torch.device("cpu"))[None])
    assert summary["moe/dropped_frac"] == pytest.approx(18 / 24)
    assert summary["moe/load_max_over_mean"] == pytest.approx(4.0)  # all 6 kept went to one of 4


def test_counts_are_taken_once_per_training_forward_and_not_in_evaluation():
    from ddpexp import activation_checkpointing, memory
    from ddpexp.config import ActivationCheckpointing

    model = tiny()
    ids = torch.randint(0, 64, (2, 17))
    meter = memory.ActivationMeter()
    activation_checkpointing.apply(model, ActivationCheckpointing.full, meter=meter)
    with meter.measure(model):  # as the engine measures one step: the backward recomputes whole blocks
        lm_loss(model.train(), ids).backward()
    with torch.no_grad():
        model.eval()(ids[:, :-1])
    rows = torch.stack([layer.counts.take(torch.device("cpu")) for layer in moe.routing_layers(model)])
    assert rows[:, :4].sum(1).tolist() == [2 * 16 * 2] * 2  # sequences x tokens x top_k, once
    assert rows[:, -1].tolist() == [2, 2]


@pytest.mark.parametrize(
    ("routing", "setting"),
    [
        ({"top_k": 5}, "model.moe.top_k"),
        ({"score": "relu"}, "model.moe.score"),
        ({"experts_per_rank": 2}, "model.moe.experts_per_rank"),
        ({"first_dense": 2}, "model.moe.first_dense"),
        ({"capacity_factor": math.inf}, "model.moe.capacity_factor"),
        ({"aux_loss_coef": -1.0}, "model.moe.aux_loss_coef"),
    ],
)
def test_bad_routing_settings_are_refused_naming_the_setting(routing: dict, setting: str):
    with pytest.raises(UserError) as refused:
        gpt(**TINY, moe={**ROUTED, **routing})
    assert refused.value.setting == setting


def test_meta_device_builds_and_runs_with_balanced_routing():
    with torch.device("meta"):
        model = gpt(**TINY, moe={**ROUTED, "capacity_factor": 1.0})
        out = model(torch.zeros(2, 16, dtype=torch.long))
    assert out.shape == (2, 16, 64) and out.is_meta


# ------------------------------------------------------------------------------ strategies, in processes

# lr 0.1 (updates large against the weights) on 55,000 bytes of the corpus, as test_gpt_parity trains.
MOE = [
    "model=gpt_moe_tiny",
    "data=python_stdlib",
    "data.max_bytes=55000",
    "task=lm",
    "optim.lr=0.1",
    "trainer.max_steps=8",
    "trainer.batch_size=16",
    "trainer.progress=false",
    "checkpoint.every_epochs=null",
]
CAPACITY = ["model.moe.capacity_factor=1.0"]
CLIP = ["trainer.clip_grad_norm=0.5", "trainer.accumulate=2"]  # below the gradient's norm: it clips
SHARED = ["model.moe.shared_experts=1"]
SWEPT = ["single", "ddp", "fsdp", "zero", "pipeline"]
# name -> (arguments after MOE, world size, the run it must equal)
ALONE: dict[str, tuple[list[str], int, str]] = {
    "init": (["strategy=single", "trainer.max_steps=0"], 1, ""),
    "init shared": (["strategy=single", "trainer.max_steps=0", *SHARED], 1, ""),
    "nd dp_shard 2": (["strategy=nd", "strategy.dp_shard=2"], 2, "single"),
    "pipeline 2x2 accumulate 2": (
        ["strategy=pipeline", "strategy.replicas=2", "trainer.accumulate=2"],
        4,
        "single",
    ),
    "single capacity": (["strategy=single", *CAPACITY], 1, ""),
    "ddp capacity": (["strategy=ddp", *CAPACITY], 2, "single capacity"),
    "single checkpointed accumulate 2": (
        ["strategy=single", "trainer.activation_checkpointing=full", "trainer.accumulate=2"],
        1,
        "single",
    ),
    "single clip accumulate 2": (["strategy=single", *CLIP], 1, ""),
    # expert parallelism: the experts over ep ranks of each dp_shard group (see EXPERT_PARALLEL)
    "nd ep 2": (["strategy=nd", "strategy.ep=2", "checkpoint.every_steps=4"], 2, "single"),
    "nd dp_shard 4 ep 4": (["strategy=nd", "strategy.dp_shard=4", "strategy.ep=4"], 4, "single"),
    "nd dp_shard 4 ep 2": (["strategy=nd", "strategy.dp_shard=4", "strategy.ep=2"], 4, "single"),
    "nd hsdp 2 x dp_shard 2 ep 2": (
        ["strategy=nd", "strategy.dp_replicate=2", "strategy.dp_shard=2", "strategy.ep=2"],
        4,
        "single",
    ),
    "nd pp 2 x dp_shard 2 ep 2": (
        ["strategy=nd", "strategy.pp=2", "strategy.dp_shard=2", "strategy.ep=2"],
        4,
        "single",
    ),
    "nd ep 2 clip accumulate 2": (["strategy=nd", "strategy.ep=2", *CLIP], 2, "single clip accumulate 2"),
    "nd ep 2 capacity": (["strategy=nd", "strategy.ep=2", *CAPACITY], 2, "single capacity"),
    # tensor parallelism: the router whole, each expert's hidden units split (see TENSOR_PARALLEL)
    "nd tp 2": (["strategy=nd", "strategy.tp=2"], 2, "single"),
    "single shared": (["strategy=single", *SHARED], 1, ""),
    "nd tp 2 sp shared": (
        ["strategy=nd", "strategy.tp=2", "strategy.sequence_parallel=true", *SHARED],
        2,
        "single shared",
    ),
    "nd dp_shard 2 ep 2 tp 2": (
        ["strategy=nd", "strategy.dp_shard=2", "strategy.ep=2", "strategy.tp=2"],
        4,
        "single",
    ),
}
EXPERT_PARALLEL = [name for name in ALONE if " ep " in name]
TENSOR_PARALLEL = [name for name in ALONE if " tp " in name]
PARITY = {
    **{name: (2, "single") for name in SWEPT if name != "single"},
    **{name: (world, equal) for name, (_, world, equal) in ALONE.items() if equal},
}


@pytest.fixture(scope="session")
def moe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def make(cwd: Path) -> None:
        sweep = ["-m", *MOE, f"strategy={','.join(SWEPT)}", "hydra.sweep.dir=sweep"]
        alone = [[*MOE, *args, f"hydra.run.dir={_folder(name)}"] for name, (args, _, _) in ALONE.items()]
        for args in [sweep, *alone]:
            result = run_here(cwd, *args)
            assert result.returncode == 0, result

    made = made_once(tmp_path_factory, "moe-parity", make)
    return {
        **{name: made / "sweep" / f"strategy={name}" for name in SWEPT},
        **{name: made / _folder(name) for name in ALONE},
    }


def _folder(name: str) -> str:
    return re.sub(r"\W+", "_", name)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(PARITY))
def test_strategies_train_the_mixture_of_experts_to_single_s_parameters_and_routing(
    moe_runs: dict[str, Path], name: str
):
    from .test_gpt_parity import EXACT, drift

    world, equal = PARITY[name]
    run, single = moe_runs[name], moe_runs[equal]
    start = moe_runs["init shared" if equal == "single shared" else "init"]
    measured = drift(weights(run), weights(single), weights(start))
    assert measured <= EXACT, f"{name}: a tensor drifted {measured:.3g} from {equal}'s, allowed {EXACT:g}"
    ours, theirs = metrics(run), metrics(single)
    assert ours["facts"]["world_size"] == world
    a, b = ours["final"], theirs["final"]
    assert a["step"] == b["step"] == 8
    assert a["eval/loss"] == pytest.approx(b["eval/loss"], rel=1e-6, abs=0)
    assert a["train/epoch_loss"] == pytest.approx(b["train/epoch_loss"], rel=1e-5, abs=0)
    # the same tokens went to the same experts, and the same load-balancing loss was paid
    assert a["moe/load_max_over_mean"] == pytest.approx(b["moe/load_max_over_mean"], rel=1e-12)
    assert a["moe/dropped_frac"] == pytest.approx(b["moe/dropped_frac"], rel=1e-12, abs=0)
    assert a["moe/aux_loss"] == pytest.approx(b["moe/aux_loss"], rel=1e-6)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_routing_shows_in_tensorboard_and_the_report(moe_runs: dict[str, Path], capsys):
    single, capacity = moe_runs["single"], moe_runs["single capacity"]
    assert metrics(capacity)["final"]["moe/dropped_frac"] > 0
    assert metrics(single)["final"]["moe/dropped_frac"] == 0  # dropless
    assert metrics(single)["final"]["moe/load_max_over_mean"] > 1
    assert "moe/load_max_over_mean" in scalars(single)
    from ddpexp.report.cli import main as report

    report([str(moe_runs["single capacity"].parent)])
    out = capsys.readouterr().out
    assert "expert load max/mean" in out and "dropped" in out


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", EXPERT_PARALLEL)
def test_expert_parallel_all_to_alls_send_what_the_cost_model_declares(moe_runs: dict[str, Path], name: str):
    """comm/bytes_per_step by kind: the dispatch and combine all-to-alls (forward and backward, with
    the counts) as expert_parallel.communication declares them for balanced routing, and so exactly
    whatever the balance; the experts' gradient all-reduce across the ranks holding the same experts
    among the gradients. With a capacity the experts drop what they cannot take: fewer bytes, never more."""
    from ddpexp.predict import predicted_bytes

    final = metrics(moe_runs[name])["final"]
    for kind in ("expert_dispatch", "expert_combine"):
        measured, declared = final[f"comm/bytes_per_step/{kind}"], predicted_bytes(moe_runs[name], kind=kind)
        if "capacity" in name:
            assert 0 < measured < declared
        else:
            assert measured == pytest.approx(declared, rel=1e-12), kind
    if "capacity" not in name:
        assert predicted_bytes(moe_runs[name]) == pytest.approx(final["comm/bytes_per_step"], rel=1e-12)
    assert final["moe/load_max_over_mean"] > 1.2  # the corpus's bytes do not route evenly: still exact


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", TENSOR_PARALLEL)
def test_tensor_parallel_moe_layers_send_what_the_cost_model_declares(moe_runs: dict[str, Path], name: str):
    """comm/bytes_per_step/tensor_parallel: besides attention's, each MoE layer's two all-reduces a
    pass (the experts' outputs forward, the routed tokens' gradient backward: every choice this rank
    routes, whatever the balance), its shared experts' column- and row-wise ones and, with sequence
    parallelism, the gathers of its input and of its output's gradient."""
    from ddpexp.predict import predicted_bytes

    final = metrics(moe_runs[name])["final"]
    measured = final["comm/bytes_per_step/tensor_parallel"]
    assert measured == pytest.approx(predicted_bytes(moe_runs[name], kind="tensor_parallel"), rel=1e-12)
    assert final["comm/bytes_per_step"] == pytest.approx(predicted_bytes(moe_runs[name]), rel=1e-12)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_an_expert_parallel_checkpoint_resumes_under_single_and_under_another_layout(
    moe_runs: dict[str, Path], tmp_path: Path
):
    """Its state is whole (the experts gathered from their ranks): single, ep 4 over 4 ranks and ep 2 x
    tp 2 (the experts split by hidden unit too) continue from step 4 to the uninterrupted ep 2 run's
    parameters at step 8."""
    from .test_gpt_parity import EXACT, drift

    uninterrupted = moe_runs["nd ep 2"]
    start = uninterrupted / "checkpoints" / "step-00000004.pt"
    layouts = {
        "single": ["strategy=single"],
        "ep4": ["strategy=nd", "strategy.dp_shard=4", "strategy.ep=4"],
        "ep2_tp2": ["strategy=nd", "strategy.dp_shard=2", "strategy.ep=2", "strategy.tp=2"],
    }
    for name, args in layouts.items():
        result = run_here(tmp_path, *MOE, *args, f'trainer.resume="{start}"', f"hydra.run.dir={name}")
        assert result.returncode == 0, result
        measured = drift(weights(tmp_path / name), weights(uninterrupted), weights(moe_runs["init"]))
        assert measured <= EXACT, f"resumed under {name}: drifted {measured:.3g}"
        assert metrics(tmp_path / name)["final"]["step"] == 8


def test_arrivals_by_source_rank_are_regrouped_by_expert():
    """Rank 0 sent 1 row for this rank's expert 0 and 2 for its expert 1, rank 1 sent 3 for expert 0:
    rows 0 | 1 2 | 3 4 5 arrive; the experts take 0 3 4 5 (expert 0), then 1 2 (expert 1)."""
    from ddpexp.strategies.nd.expert_parallel import _by_expert

    assert _by_expert(torch.tensor([[1, 2], [3, 0]])).tolist() == [0, 3, 4, 5, 1, 2]

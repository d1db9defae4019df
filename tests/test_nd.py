"""strategy=nd: data, tensor, sequence, context and pipeline parallelism composed on one device mesh.

Every combination that fits a world of 4 on CPU trains the
transformer to single's parameters at the same global batch, within test_gpt_parity's fp32 bound
(a tensor's distance from single's <= 1e-4 of single's update of it); the bytes its meters count equal
what its cost model declares; a 2-D run's checkpoint resumes under single and under another mesh.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpexp.errors import UserError
from ddpexp.strategies.nd.degrees import Degrees, resolve

from .conftest import made_once, metrics, run_here, weights
from .test_cli import refuse
from .test_gpt_parity import EXACT, GPT, assert_same_job, drift

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(1200)]

CHECKPOINTED = ["checkpoint.every_steps=4"]
# name -> (world size, arguments after GPT)
MESHES: dict[str, tuple[int, list[str]]] = {
    "tp 2": (2, ["strategy.tp=2"]),
    "tp 2 sequence parallel": (2, ["strategy.tp=2", "strategy.sequence_parallel=true"]),
    "dp_shard 2 x tp 2": (4, ["strategy.dp_shard=2", "strategy.tp=2", *CHECKPOINTED]),
    "dp_shard 2 x tp 2 sequence parallel, clip, accumulate 2": (
        4,
        [
            "strategy.dp_shard=2",
            "strategy.tp=2",
            "strategy.sequence_parallel=true",
            "trainer.clip_grad_norm=0.5",
            "trainer.accumulate=2",
        ],
    ),
    "dp_replicate 2 x dp_shard 2": (4, ["strategy.dp_replicate=2", "strategy.dp_shard=2"]),
    # FSDP's shards of the tensor-parallel splits on the host (offload).
    "dp_shard 2 x tp 2, offload": (4, ["strategy.dp_shard=2", "strategy.tp=2", "strategy.offload=true"]),
    "dp_replicate 2 x tp 2": (4, ["strategy.dp_replicate=2", "strategy.tp=2", "strategy.dp_shard=1"]),
    "pp 2 x tp 2": (4, ["strategy.pp=2", "strategy.tp=2", "strategy.dp_shard=1"]),
    "pp 2 x dp_shard 2, 1f1b": (4, ["strategy.pp=2", "strategy.dp_shard=2", "strategy.schedule=1f1b"]),
    # Two stages a rank: FSDP over each stage's replicas in a loop, tensor parallelism inside a V.
    "pp 2 x dp_shard 2, interleaved_1f1b": (
        4,
        ["strategy.pp=2", "strategy.dp_shard=2", "strategy.schedule=interleaved_1f1b"],
    ),
    "pp 2 x tp 2, zbv": (
        4,
        ["strategy.pp=2", "strategy.tp=2", "strategy.dp_shard=1", "strategy.schedule=zbv"],
    ),
    "tp 2 loss parallel": (2, ["strategy.tp=2", "strategy.loss_parallel=true"]),
    "pp 2 x tp 2 sequence parallel, loss parallel": (
        4,
        [
            "strategy.pp=2",
            "strategy.tp=2",
            "strategy.dp_shard=1",
            "strategy.sequence_parallel=true",
            "strategy.loss_parallel=true",
        ],
    ),
    # Context parallelism: each rank 1/2 of every sequence, attention a ring; composed with FSDP (over
    # dp_shard x cp), tensor parallelism and stages.
    "cp 2": (2, ["strategy.cp=2", "strategy.dp_shard=1"]),
    # Full checkpointing runs each block's forward again, and the ring gathers again (declared).
    "cp 2, full checkpointing": (
        2,
        ["strategy.cp=2", "strategy.dp_shard=1", "trainer.activation_checkpointing=full"],
    ),
    "dp_shard 2 x cp 2": (4, ["strategy.dp_shard=2", "strategy.cp=2", *CHECKPOINTED]),
    "cp 2 x tp 2": (4, ["strategy.cp=2", "strategy.tp=2", "strategy.dp_shard=1"]),
    "pp 2 x cp 2": (4, ["strategy.pp=2", "strategy.cp=2", "strategy.dp_shard=1"]),
    # Each stage's blocks compiled after tensor parallelism (a whole stage compiled fails here).
    "pp 2 x tp 2 compiled": (
        4,
        ["strategy.pp=2", "strategy.tp=2", "strategy.dp_shard=1", "trainer.compile=true"],
    ),
}
SINGLES = {"init": ["trainer.max_steps=0"], "single": [], "single clip": ["trainer.clip_grad_norm=0.5"]}


def _folder(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


@pytest.fixture(scope="module")
def nd_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def make(cwd: Path) -> None:
        for name, args in SINGLES.items():
            result = run_here(cwd, *GPT, "strategy=single", *args, f"hydra.run.dir={_folder(name)}")
            assert result.returncode == 0, result
        for name, (_, args) in MESHES.items():
            result = run_here(cwd, *GPT, "strategy=nd", *args, f"hydra.run.dir={_folder(name)}")
            assert result.returncode == 0, result

    made = made_once(tmp_path_factory, "nd-runs", make)
    return {name: made / _folder(name) for name in [*SINGLES, *MESHES]}


@pytest.mark.parametrize("name", list(MESHES))
def test_every_mesh_trains_the_transformer_to_single_s_parameters(nd_runs: dict[str, Path], name: str):
    world, _ = MESHES[name]
    run, single = nd_runs[name], nd_runs["single clip" if "clip" in name else "single"]
    measured = drift(weights(run), weights(single), weights(nd_runs["init"]))
    assert measured <= EXACT, f"{name}: a tensor drifted {measured:.3g} from single's, allowed {EXACT:g}"
    ours, theirs = assert_same_job(run, single, world)
    assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-6, abs=0)
    assert ours["train/epoch_loss"] == pytest.approx(theirs["train/epoch_loss"], rel=1e-5, abs=0)


@pytest.mark.parametrize("name", list(MESHES))
def test_the_bytes_each_mesh_sends_are_the_bytes_its_cost_model_declares(nd_runs: dict[str, Path], name: str):
    """comm/bytes_per_step, counted by the meters (FSDP's collectives, HSDP's all-reduce, and every
    collective DTensor issues for tensor parallelism), equals the sum of what Nd.communication declares
    for the run's size, which ddpexp-predict prices."""
    from ddpexp.predict import predicted_bytes

    final = metrics(nd_runs[name])["final"]
    assert final["comm/bytes_per_step"] > 0
    assert predicted_bytes(nd_runs[name]) == pytest.approx(final["comm/bytes_per_step"], rel=1e-9)
    copied = final.get("comm/bytes_per_step/offload", 0)
    assert copied == pytest.approx(predicted_bytes(nd_runs[name], offload=True)) and (copied > 0) == (
        "offload" in name
    )
    if "tp" in name:
        assert final["comm/bytes_per_step/tensor_parallel"] > 0
    else:
        assert "comm/bytes_per_step/tensor_parallel" not in final
    ring = final.get("comm/bytes_per_step/context_parallel", 0)
    assert ring == predicted_bytes(nd_runs[name], kind="context_parallel") and (ring > 0) == ("cp" in name)
    assert 0 < final["comm/share"] <= 1  # a share of the wall time


@pytest.mark.parametrize("name", list(MESHES))
def test_each_rank_holds_its_part_of_the_parameters_gradients_and_optimizer_state(
    nd_runs: dict[str, Path], name: str
):
    """mem/* per rank, counted from the tensors (a DTensor's local part): the gradients and the
    momentum buffers are the size of the rank's parameters (each gradient cut to its parameter's split
    before the optimizer), and the ranks' parameters add up to one model per dp_replicate group:
    sharding, tensor parallelism and stages each hold a part once (within FSDP's padding)."""
    ranks = metrics(nd_runs[name])["memory_per_rank"]
    whole = metrics(nd_runs["single"])["memory_per_rank"][0]["mem/params_mb"]
    for rank in ranks:
        assert rank["mem/grads_mb"] == pytest.approx(rank["mem/params_mb"]), rank
        assert rank["mem/optim_state_mb"] == pytest.approx(rank["mem/params_mb"]), rank
    replicas = 2 if "dp_replicate 2" in name else 1
    assert sum(r["mem/params_mb"] for r in ranks) == pytest.approx(replicas * whole, rel=0.02), name


@pytest.mark.parametrize(
    "mesh",
    [
        ["strategy.tp=2", "strategy.dp_shard=1"],
        ["strategy.tp=2", "strategy.dp_shard=1", "strategy.sequence_parallel=true"],
        ["strategy.tp=2", "strategy.dp_shard=2", "strategy.sequence_parallel=true"],
        ["strategy.tp=2", "strategy.cp=2", "strategy.dp_shard=1", "strategy.loss_parallel=true"],
    ],
    ids=["tp 2", "tp 2 sp", "dp_shard 2 x tp 2 sp", "cp 2 x tp 2 lp"],
)
def test_bf16_training_sends_what_its_declaration_says_in_bf16(tmp_path: Path, mesh: list[str]):
    """Under trainer.precision=bf16 tensor parallelism sends in the dtypes the step computes in:
    autocast's (tp alone: the linear layers' outputs bf16, the embeddings', norms' and residual
    stream's fp32) or, with FSDP over the data-parallel ranks, its mixed-precision policy's (every
    activation bf16, the sequence-parallel norms' weight gradients too). The declaration runs its
    meta forward the same way: the same bytes, by kind."""
    from ddpexp.predict import predicted_bytes

    args = [*GPT, "trainer.max_steps=2", "trainer.precision=bf16", "strategy=nd", *mesh]
    result = run_here(tmp_path, *args, "hydra.run.dir=run")
    assert result.returncode == 0, result
    final = metrics(tmp_path / "run")["final"]
    tag = "comm/bytes_per_step/tensor_parallel"
    assert predicted_bytes(tmp_path / "run", kind="tensor_parallel") == final[tag] > 0
    assert predicted_bytes(tmp_path / "run") == pytest.approx(final["comm/bytes_per_step"], rel=1e-12)


def test_fp8_all_gather_on_a_mesh_sends_what_its_declaration_says(tmp_path: Path):
    """trainer.fp8_all_gather with FSDP over dp_shard 2 and tensor parallelism 2: FSDP gathers each
    rank's float8 weight shards in float8, and the weights' absolute maxima are all-reduced once a step
    over both mesh dimensions they are split on (one float a weight, each); the weights come cast, so
    tensor parallelism all-reduces the scales of its split activations and gradients only. Declared
    to the byte, by kind."""
    from ddpexp.predict import predicted_bytes

    args = [*GPT, "trainer.max_steps=2", "trainer.precision=fp8", "trainer.fp8_all_gather=true"]
    result = run_here(
        tmp_path, *args, "strategy=nd", "strategy.tp=2", "strategy.dp_shard=2", "hydra.run.dir=run"
    )
    assert result.returncode == 0, result
    final = metrics(tmp_path / "run")["final"]
    tp = "comm/bytes_per_step/tensor_parallel"
    fsdp = final["comm/bytes_per_step"] - final[tp]
    assert (
        predicted_bytes(tmp_path / "run") - predicted_bytes(tmp_path / "run", kind="tensor_parallel") == fsdp
    )
    assert predicted_bytes(tmp_path / "run", kind="tensor_parallel") == final[tp]


def test_sequence_parallelism_moves_other_collectives_than_plain_tensor_parallelism(nd_runs: dict[str, Path]):
    """The same parameters, but its reduce-scatters and all-gathers are not plain tp's all-reduces:
    the byte counts differ (and each matches its own declaration, above)."""
    plain, sequence = (metrics(nd_runs[n])["final"] for n in ("tp 2", "tp 2 sequence parallel"))
    tag = "comm/bytes_per_step/tensor_parallel"
    assert plain[tag] != sequence[tag]


def test_loss_parallelism_sends_a_few_floats_a_token_instead_of_the_logits(nd_runs: dict[str, Path]):
    """Under loss_parallel the head's logits stay split by vocabulary: no rank gathers them (gpt_tiny:
    16 x 64 tokens, 256 entries each), and the cross-entropy all-reduces three floats a token
    instead. The same parameters (above), fewer bytes."""
    plain, split = (metrics(nd_runs[n])["final"] for n in ("tp 2", "tp 2 loss parallel"))
    tag = "comm/bytes_per_step/tensor_parallel"
    tokens, vocab = 16 * 64, 256
    gathered = tokens * vocab // 2 * 4  # the logits' all-gather: each rank hands in its half, fp32
    assert plain[tag] - split[tag] == gathered - 3 * tokens * 4


def test_loss_parallelism_is_refused_for_a_plan_that_cannot_keep_the_logits_split():
    from ddpexp.strategies.nd import tensor_parallel

    class Planned(torch.nn.Linear):
        def parallel_plan(self, *, tp: int, sequence_parallel: bool) -> dict:
            return {}

    assert tensor_parallel.plan_of(Planned(2, 2), tp=2, sequence_parallel=False) == {}
    with pytest.raises(UserError, match="takes no loss_parallel") as caught:
        tensor_parallel.plan_of(Planned(2, 2), tp=2, sequence_parallel=False, loss_parallel=True)
    assert caught.value.setting == "strategy.loss_parallel"


def test_a_model_with_batchnorm_trains_and_evaluates_in_stages(tmp_path: Path):
    """Each stage's buffers (BatchNorm's running statistics) are synchronised among that stage's ranks
    only: the default broadcast of the whole model's buffers waited forever on ranks that hold one
    stage (the hang detector stopped the run). The ConvNet has BatchNorm; 2 stages x dp_shard 2."""
    args = ["strategy=nd", "strategy.pp=2", "strategy.dp_shard=2", "model=convnet", "data=synthetic"]
    result = run_here(tmp_path, *args, "trainer.max_steps=3", "trainer.progress=false", "hydra.run.dir=run")
    assert result.returncode == 0, result
    record = metrics(tmp_path / "run")
    assert record["status"] == "completed" and "eval/acc" in record["final"], record


@pytest.mark.parametrize(
    ("mesh", "resumed"),
    [
        ("dp_shard 2 x tp 2", {"tp": ["strategy.tp=2", "strategy.sequence_parallel=true"]}),
        ("dp_shard 2 x cp 2", {"cp": ["strategy.cp=2", "strategy.dp_shard=1"]}),
    ],
)
def test_a_2d_checkpoint_resumes_under_single_and_under_another_mesh(
    nd_runs: dict[str, Path], tmp_path: Path, mesh: str, resumed: dict[str, list[str]]
):
    """A 2-D mesh's checkpoint at step 4 holds full, plain state: single and another mesh each
    continue from it to the uninterrupted 2-D run's parameters at step 8."""
    uninterrupted = nd_runs[mesh]
    start = uninterrupted / "checkpoints" / "step-00000004.pt"
    others = {name: ["strategy=nd", *args] for name, args in resumed.items()}
    for name, args in {"single": ["strategy=single"], **others}.items():
        result = run_here(tmp_path, *GPT, *args, f'trainer.resume="{start}"', f"hydra.run.dir={name}")
        assert result.returncode == 0, result
        measured = drift(weights(tmp_path / name), weights(uninterrupted), weights(nd_runs["init"]))
        assert measured <= EXACT, f"resumed under {name}: drifted {measured:.3g}"
        assert metrics(tmp_path / name)["final"]["step"] == 8


def test_compile_compiles_each_block_in_place_and_leaves_the_rest_eager():
    """torchtitan's per-block compile: the blocks' calls compiled, the module trained and its
    embeddings and head left as they were (what tensor parallelism and FSDP hold on to)."""
    from ddpexp.models.gpt import gpt
    from ddpexp.strategies import Wrapped
    from ddpexp.strategies import resolve as resolve_strategy

    model = gpt(input_shape=(16,), vocab_size=64, n_layer=2, n_head=2, dim=32, block_size=16)
    wrapped = Wrapped(module=model, base=model)
    resolve_strategy({"name": "nd"}).compile(wrapped)
    assert wrapped.module is model
    blocks = model.shard_units()
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert [m for m in model.modules() if m._compiled_call_impl is not None] == blocks

    # A pipeline stage holding none of the blocks (the embeddings alone) stays eager, not compiled whole.
    fresh = gpt(input_shape=(16,), vocab_size=64, n_layer=2, n_head=2, dim=32, block_size=16)
    stage = Wrapped(module=torch.nn.ModuleList([fresh.tok_embeddings]), base=fresh)
    resolve_strategy({"name": "nd"}).compile(stage)
    assert not any(m._compiled_call_impl is not None for m in fresh.modules())
    assert not isinstance(stage.module, torch._dynamo.eval_frame.OptimizedModule)


def test_degrees_take_the_rest_of_the_world_and_lay_ranks_tp_innermost():
    assert resolve({"pp": 1, "dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 2}, 8) == Degrees(1, 1, 4, 2)
    d = Degrees(pp=1, dp_replicate=2, dp_shard=2, tp=2)
    assert [d.data_shard(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert d.coordinates(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    # cp ranks sit between dp_shard and tp: they read the same samples, and FSDP shards over them too.
    d = Degrees(dp_shard=2, cp=2, tp=2)
    assert [d.data_shard(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert d.coordinates(6) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 1, "tp": 0}
    assert (d.dp, d.shard, d.fsdp) == (2, 4, 4)


@pytest.mark.parametrize(
    ("given", "world", "words"),
    [
        ({"dp_shard": 2, "tp": 2}, 2, ["= 4 ranks", "the run has 2", "dist.nprocs=4"]),
        ({"dp_shard": -1, "tp": -1}, 4, ["strategy.tp", "both -1"]),
        ({"dp_shard": -1, "tp": 3}, 4, ["dist.nprocs", "4 ranks do not divide by tp 3"]),
        ({"dp_shard": 0, "tp": 1}, 4, ["strategy.dp_shard", "positive"]),
    ],
)
def test_bad_degrees_are_refused_naming_the_setting(given: dict[str, int], world: int, words: list[str]):
    full = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, **given}
    with pytest.raises(UserError) as refused:
        resolve(full, world)
    line = str(refused.value)
    assert all(w in line for w in words) and "(fix: " in line, line


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["strategy.tp=2", "strategy.dp_shard=2", "dist.nprocs=2"],
            ["dp_shard 2 x tp 2 = 4 ranks", "dist.nprocs=4"],
        ),
        (["strategy.tp=3", "strategy.dp_shard=1"], ["model.n_head", "4 heads", "strategy.tp=3", "2 or 4"]),
        (["strategy.tp=2", "model.n_head=2", "model.n_kv_head=1"], ["model.n_kv_head", "1 key/value heads"]),
        (
            ["strategy.tp=4", "strategy.sequence_parallel=true", "model.block_size=66", "data.block_size=66"],
            ["model.block_size", "66 positions"],
        ),
        (
            ["model=mlp", "data=synthetic", "task=classification", "strategy.tp=2"],
            ["no tensor-parallel plan"],
        ),
        (["strategy.pp=5", "strategy.dp_shard=1"], ["strategy.pp: GPT splits into at most 4 stages, not 5"]),
        (
            ["strategy.cp=3", "strategy.dp_shard=1"],
            ["strategy.cp", "2 x cp = 6 equal chunks", "64 tokens do not divide", "[2, 4, 8, 16, 32]"],
        ),
        (
            ["model=mlp", "data=synthetic", "task=classification", "strategy.cp=2"],
            ["strategy.cp", "MLP cannot be told which positions"],
        ),
        (
            ["strategy.pp=2", "strategy.dp_shard=1", "strategy.microbatches=3"],
            ["strategy.microbatches", "does not split into 3 micro-batches"],
        ),
        # A degree of 0 beside dp_shard's default -1 divided by zero choosing the ranks to start.
        (["strategy.tp=0"], ["strategy.tp", "positive degree", "got 0"]),
        (["strategy.dp_replicate=0"], ["strategy.dp_replicate", "positive degree"]),
        (["strategy.pp=2", "strategy.microbatches=0"], ["strategy.microbatches", "positive, got 0"]),
        (
            ["strategy.pp=2", "strategy.dp_shard=1", "model.tie_embeddings=true"],
            ["strategy.pp: tok_embeddings.weight, output.weight", "tied", "use fewer strategy.pp"],
        ),
    ],
)
def test_the_command_line_refuses_a_mesh_that_cannot_work_before_anything_starts(
    overrides: list[str], words: list[str], tmp_path: Path, monkeypatch, capsys
):
    args = ["model=gpt_tiny", "data=python_stdlib", "task=lm", "strategy=nd", *overrides]
    line = refuse(tmp_path, monkeypatch, capsys, *args)
    assert all(word in line for word in words), line

"""Context parallelism (strategy=nd, strategy.cp): the Llama form of the transformer (RoPE, grouped-query
attention, SwiGLU, RMSNorm) trained with each rank holding half of every sequence reaches single's
parameters; the positions each rank's tokens hold reach RoPE; the ring's bytes are declared; bad
input is refused in one line. The GPT-2 form's meshes (cp alone, with FSDP, tensor parallelism and
stages) are in test_nd.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpexp.errors import UserError

from .conftest import made_once, metrics, run_here, weights
from .test_gpt_parity import EXACT, GPT, assert_same_job, drift

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(1200)]

LLAMA = [*GPT, "model.pos_embedding=rope", "model.n_kv_head=2", "model.mlp=swiglu", "model.norm=rmsnorm"]
RUNS = {
    "init": ["strategy=single", "trainer.max_steps=0"],
    "single": ["strategy=single"],
    "cp 2": ["strategy=nd_cp", "strategy.dp_shard=1"],
}


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def make(cwd: Path) -> None:
        for name, args in RUNS.items():
            result = run_here(cwd, *LLAMA, *args, f"hydra.run.dir={name.replace(' ', '_')}")
            assert result.returncode == 0, result

    made = made_once(tmp_path_factory, "cp-llama-runs", make)
    return {name: made / name.replace(" ", "_") for name in RUNS}


def test_half_of_every_sequence_a_rank_trains_the_llama_form_to_single_s_parameters(llama_runs):
    """RoPE's angles at each rank's own positions (head-tail chunks: 0-15 and 48-63 on rank 0),
    keys and values of 2 heads for 4 queries' heads passed around the ring: single's parameters
    within the fp32 bound, evaluation exact (every window and token scored once)."""
    run, single = llama_runs["cp 2"], llama_runs["single"]
    measured = drift(weights(run), weights(single), weights(llama_runs["init"]))
    assert measured <= EXACT, f"drifted {measured:.3g} from single's, allowed {EXACT:g}"
    ours, theirs = assert_same_job(run, single, 2)
    assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-6, abs=0)
    assert ours["train/epoch_loss"] == pytest.approx(theirs["train/epoch_loss"], rel=1e-5, abs=0)


def test_the_ring_s_bytes_are_what_its_cost_model_declares(llama_runs):
    """gpt_tiny in the Llama form: 2 layers, keys and values of 2 heads x 16 channels, 16 windows of
    32 tokens a rank. Forward and backward each gather them once (fp32), the backward passes their
    gradients on twice (cp rotations, fp32)."""
    from ddpexp.predict import predicted_bytes

    final = metrics(llama_runs["cp 2"])["final"]
    kv = 2 * 2 * 16  # keys and values: 2 heads x 16 channels each
    local = 16 * 32 * kv * 2  # elements a rank holds, both layers
    assert final["comm/bytes_per_step/context_parallel"] == local * 4 * 2 + local * 4 * 2
    assert predicted_bytes(llama_runs["cp 2"], kind="context_parallel") == pytest.approx(
        final["comm/bytes_per_step/context_parallel"], rel=1e-12
    )
    assert predicted_bytes(llama_runs["cp 2"]) == pytest.approx(final["comm/bytes_per_step"], rel=1e-12)


def test_a_rank_s_tokens_take_the_positions_it_is_given():
    """GPT.sequence_positions reaches every block's RoPE and the learned position table, and only
    inside it. RoPE scores relative positions only: the same tokens 10 positions later give the same
    logits, tokens spread apart other ones; the learned table's rows are read at the given positions."""
    from ddpexp.models.gpt import gpt

    torch.manual_seed(0)
    ids = torch.randint(0, 32, (1, 4))
    rope = gpt(
        vocab_size=32, input_shape=[16], n_layer=2, n_head=2, dim=16, pos_embedding="rope", init_std=0.5
    )
    plain = rope(ids)
    with rope.sequence_positions(torch.arange(10, 14)):
        torch.testing.assert_close(rope(ids), plain, rtol=1e-4, atol=1e-5)
    with rope.sequence_positions(torch.tensor([0, 1, 2, 9])):
        spread = rope(ids)
    torch.testing.assert_close(spread[:, :3], plain[:, :3])  # causal: the first three see no change
    assert not torch.allclose(spread[:, 3], plain[:, 3], atol=1e-4)
    torch.testing.assert_close(rope(ids), plain)  # outside: 0..L-1 again

    learned = gpt(vocab_size=32, input_shape=[16], n_layer=1, n_head=2, dim=16)
    with learned.sequence_positions(torch.tensor([4, 5, 6, 7])):
        moved = learned(ids)
    with torch.no_grad():  # the table's rows 4-7 put where 0-3 were: the same logits without positions
        learned.pos_embeddings.weight[:4] = learned.pos_embeddings.weight[4:8].clone()
    torch.testing.assert_close(learned(ids), moved)


def test_a_block_the_ring_cannot_split_is_refused_with_the_cp_that_would():
    from ddpexp.strategies.nd import context_parallel

    class Positioned(torch.nn.Linear):
        def sequence_positions(self, positions: torch.Tensor):  # pragma: no cover - not called
            raise AssertionError

    context_parallel.check(Positioned(2, 2), cp=4, length=64)  # 8 chunks of 8
    with pytest.raises(UserError) as refused:
        context_parallel.check(Positioned(2, 2), cp=4, length=36)
    line = str(refused.value)
    assert (
        "2 x cp = 8 equal chunks" in line
        and "[2, 3, 6, 9, 18]" in line
        and refused.value.setting == "strategy.cp"
    )
    with pytest.raises(UserError, match="cannot be told which positions"):
        context_parallel.check(torch.nn.Linear(2, 2), cp=2, length=64)

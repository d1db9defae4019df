"""naive_allreduce's hand-written ring all-reduce (strategy.algorithm=ring) on CPU/gloo: `ring_sum`
sums exactly like an all-reduce for any buffer size, even one with fewer elements than ranks, and
sends 2(W-1)/W of the buffer per rank; trained end to end it gives the weights `collective` gives, at
2 and 3 ranks, and `comm/bytes_per_step` counts the bytes the ring sends."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpexp.strategies.naive_allreduce import chunk_bounds, ring_sum

from .conftest import QUICK, assert_close_weights, metrics, run_here, start_ranks

pytestmark = pytest.mark.multiproc

WORLD = 3
# Sizes below, at and above W, divisible by 2 or 3 or by neither.
SIZES = (1, 2, 3, 4, 7, 12, 1001)


def contribution(rank: int, size: int) -> torch.Tensor:
    """Integer-valued floats, different on every rank: every sum is exact, whatever the order."""
    return torch.arange(size, dtype=torch.float32) * (rank + 1) + 1000 * rank


def _rank(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=WORLD)
    pair = dist.new_group([0, 1])  # every rank takes part in creating it; only 0 and 1 use it
    results: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
    for size in SIZES:
        flat = contribution(rank, size)
        results[WORLD, size] = flat, ring_sum(flat)
        if rank < 2:
            flat = contribution(rank, size)
            results[2, size] = flat, ring_sum(flat, pair)
    torch.save(results, f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[tuple[int, int], tuple[torch.Tensor, int]]]:
    tmp = tmp_path_factory.mktemp("ring")
    start_ranks(_rank, (str(tmp),), nprocs=WORLD)
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_chunks_cover_the_buffer_and_differ_by_at_most_one_element():
    for size in SIZES:
        for world in (2, 3):
            bounds = chunk_bounds(size, world)
            lengths = [stop - start for start, stop in bounds]
            assert bounds[0][0] == 0 and bounds[-1][1] == size and sum(lengths) == size
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("size", SIZES)
def test_ring_sum_is_the_exact_sum_on_every_rank(ranks, world: int, size: int):
    expected = sum(contribution(r, size) for r in range(world))
    for rank in range(world):
        result, _ = ranks[rank][world, size]
        assert torch.equal(result, expected), (rank, result, expected)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("size", SIZES)
def test_each_rank_sends_2_w_minus_1_chunks_of_the_buffer(ranks, world: int, size: int):
    sent = [ranks[rank][world, size][1] for rank in range(world)]
    assert sum(sent) == 2 * (world - 1) * size * 4  # float32; at each step the ranks send every chunk once
    lengths = [stop - start for start, stop in chunk_bounds(size, world)]
    for rank, nbytes in enumerate(sent):
        reduce_scatter = [(rank - s) % world for s in range(world - 1)]  # chunks r, r-1, ...
        all_gather = [(rank + 1 - s) % world for s in range(world - 1)]  # chunks r+1, r, ...
        assert nbytes == 4 * sum(lengths[c] for c in reduce_scatter + all_gather), rank


# A tiny MLP, 3 steps at a global batch both 2 and 3 ranks divide; one bucket per parameter
# (784x16, 16, 16x10, 10 elements: 3 divides none of them). At the same global batch data parallelism
# trains the same weights on any number of ranks, so one collective run (3 ranks) is the reference.
TINY = [*QUICK, "model.hidden=[16]", "trainer.max_steps=3", "trainer.batch_size=66"]
RUNS = {"ring-2": ("ring", 2), "ring-3": ("ring", 3), "collective-3": ("collective", 3)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cwd = tmp_path_factory.mktemp("ring-runs")
    for name, (algorithm, world) in RUNS.items():
        result = run_here(
            cwd,
            "strategy=naive_allreduce",
            f"strategy.algorithm={algorithm}",
            f"dist.nprocs={world}",
            *TINY,
            f"hydra.run.dir={name}",
        )
        assert result.returncode == 0, result
        assert metrics(cwd / name)["facts"]["world_size"] == world
    return {name: cwd / name for name in RUNS}


@pytest.mark.parametrize("world", [2, 3])
def test_ring_trains_like_collective(runs: dict[str, Path], world: int):
    assert_close_weights(runs[f"ring-{world}"], runs["collective-3"])


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_per_step_are_what_each_algorithm_sends(runs: dict[str, Path], world: int):
    """collective counts the gradient buffer S (4 bytes x parameters), whatever W; ring the bytes
    each rank sends, 2(W-1)/W x S on average over ranks: S at W=2, 4/3 S at W=3."""
    weights = torch.load(runs["collective-3"] / "model.pt", weights_only=True)
    gradient_bytes = 4 * sum(v.numel() for v in weights.values())  # the MLP has no buffers
    ring, collective = (
        metrics(runs[name])["final"]["comm/bytes_per_step"] for name in (f"ring-{world}", "collective-3")
    )
    assert collective == gradient_bytes
    assert ring == pytest.approx(2 * (world - 1) / world * gradient_bytes, rel=1e-12, abs=0)

"""fsdp (FSDP2, fully_shard) on 2 gloo ranks: it trains the same model as `single` at the same global
batch (both reshard settings, with accumulation, with clipping), evaluates exactly, and its
checkpoints hold the full state, so runs move between fsdp and the other strategies."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpexp import load_model
from ddpexp.models.mlp import mlp
from ddpexp.predict import predicted_bytes
from ddpexp.strategies.fsdp import Fsdp, FsdpConfig, shard_units

from .conftest import (
    PARITY,
    RESUME,
    assert_close_weights,
    metrics,
    run_here,
    scored_by_single,
    start_ranks,
    weights,
)

pytestmark = pytest.mark.multiproc


def test_fsdp_trains_like_single_at_the_same_global_batch(parity_sweep: Path, tmp_path: Path):
    single = parity_sweep / "strategy=single"
    sweep = ["-m", "strategy=fsdp", "strategy.reshard_after_forward=true,false", *PARITY, "hydra.sweep.dir=s"]
    result = run_here(tmp_path, *sweep)
    assert result.returncode == 0, result
    for reshard in ("True", "False"):  # Hydra names the sweep directories after the parsed values
        run = tmp_path / "s" / f"strategy.reshard_after_forward={reshard}"
        assert_close_weights(run, single)
        assert metrics(run)["facts"]["world_size"] == 2
        # exact evaluation: every eval sample once, the same loss as single's on the same weights
        assert metrics(run)["final"]["eval/samples"] == metrics(single)["final"]["eval/samples"]
        assert metrics(run)["final"]["eval/loss"] == pytest.approx(
            metrics(single)["final"]["eval/loss"], rel=1e-5
        )
    _assert_memory_is_sharded(tmp_path / "s" / "strategy.reshard_after_forward=True", parity_sweep)
    accumulated = run_here(tmp_path, "strategy=fsdp", *PARITY, "trainer.accumulate=2", "hydra.run.dir=acc")
    assert accumulated.returncode == 0, accumulated
    assert_close_weights(tmp_path / "acc", single)


def _assert_memory_is_sharded(fsdp: Path, parity_sweep: Path) -> None:
    """Bytes per rank, counted exactly: ddp holds every parameter, gradient and momentum buffer on each
    rank; fsdp holds rank r's dim-0 chunk of each (torch.chunk's split: ceil(n/2) rows, then the rest)."""
    shapes = [v.shape for v in weights(fsdp).values()]  # mlp: parameters only, no buffers
    full = sum(math.prod(s) for s in shapes) * 4 / 2**20
    ddp = metrics(parity_sweep / "strategy=ddp")
    resident = ("mem/params_mb", "mem/grads_mb", "mem/optim_state_mb")
    for rank in ddp["memory_per_rank"]:
        assert {k: rank[k] for k in resident} == dict.fromkeys(resident, full)
    sharded = metrics(fsdp)["memory_per_rank"]
    for r, rank in enumerate(sharded):
        rows = [min(math.ceil(s[0] / 2), s[0] - r * math.ceil(s[0] / 2)) for s in shapes]
        mine = sum(n * math.prod(s[1:]) for n, s in zip(rows, shapes, strict=True)) * 4 / 2**20
        assert {k: rank[k] for k in resident} == dict.fromkeys(resident, mine), r
        # activations are not sharded: fsdp's rank holds what ddp's does for the same micro-batch
        assert rank["mem/activations_mb"] == ddp["memory_per_rank"][r]["mem/activations_mb"]
    assert sum(rank["mem/params_mb"] for rank in sharded) == pytest.approx(full)
    assert metrics(fsdp)["final"]["mem/params_mb"] == pytest.approx(full / 2, rel=0.01)  # max over ranks


def test_fsdp_clips_the_sharded_gradients_like_single(tmp_path: Path):
    """Clipping needs the norm of the whole gradient, not of one rank's shard. 65 eval samples split
    33/32 give the ranks 2 and 1 eval batches: fsdp's collective forwards must still pair up."""
    clip = [*PARITY, "trainer.clip_grad_norm=0.05", "optim.lr=0.5", "data.num_eval=65"]
    for strategy in ("single", "fsdp"):
        result = run_here(tmp_path, f"strategy={strategy}", *clip, f"hydra.run.dir={strategy}")
        assert result.returncode == 0, result
    assert_close_weights(tmp_path / "fsdp", tmp_path / "single")
    ours, theirs = (metrics(tmp_path / s)["final"] for s in ("fsdp", "single"))
    assert ours["eval/samples"] == theirs["eval/samples"] == 65
    assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-5)
    unclipped = run_here(
        tmp_path, "strategy=single", *clip[:-3], "optim.lr=0.5", "data.num_eval=65", "hydra.run.dir=unclipped"
    )
    assert unclipped.returncode == 0, unclipped
    assert not torch.allclose(
        weights(tmp_path / "single")["body.1.weight"], weights(tmp_path / "unclipped")["body.1.weight"]
    )


def test_fsdp_evaluates_exactly_with_fewer_eval_samples_than_ranks(tmp_path: Path):
    """One eval sample on 2 ranks: rank 1 has none, yet FSDP's forward is collective, so it runs rank
    0's inputs with it, unscored. The one sample is scored once, as single scores it."""
    few = [*PARITY, "trainer.max_steps=2", "data.num_eval=1"]
    for strategy in ("single", "fsdp"):
        result = run_here(tmp_path, f"strategy={strategy}", *few, f"hydra.run.dir={strategy}")
        assert result.returncode == 0, result
    ours, theirs = (metrics(tmp_path / s)["final"] for s in ("fsdp", "single"))
    assert ours["eval/samples"] == theirs["eval/samples"] == 1
    assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-5)


def test_a_ddp_checkpoint_resumes_under_fsdp_and_an_fsdp_one_under_single(uninterrupted, tmp_path: Path):
    """ddp -> fsdp continues to the uninterrupted ddp run's result; fsdp's checkpoint and model.pt are
    full, plain state: single scores them identically and resumes training from them."""
    ddp = uninterrupted("ddp")
    start = ddp / "checkpoints" / "step-00000064.pt"
    args = [
        "strategy=fsdp",
        *RESUME,
        "trainer.max_steps=70",
        f'trainer.resume="{start}"',
        "hydra.run.dir=fsdp",
    ]
    result = run_here(tmp_path, *args)
    assert result.returncode == 0, result
    assert_close_weights(tmp_path / "fsdp", ddp)
    assert isinstance(load_model(tmp_path / "fsdp"), torch.nn.Module)
    scored = scored_by_single(tmp_path, tmp_path / "fsdp")
    last = tmp_path / "fsdp" / "checkpoints" / "last.pt"
    assert scored["eval/loss"] == pytest.approx(metrics(tmp_path / "fsdp")["final"]["eval/loss"], rel=1e-6)
    more = [
        "strategy=single",
        *RESUME,
        "trainer.max_steps=75",
        f'trainer.resume="{last}"',
        "hydra.run.dir=single",
    ]
    resumed = run_here(tmp_path, *more)
    assert resumed.returncode == 0, resumed
    state = torch.load(tmp_path / "single" / "checkpoints" / "last.pt", weights_only=True)
    assert state["step"] == 75 and state["optimizer"]["state"]  # momentum buffers came across


def test_fsdp_shards_only_the_blocks_that_are_submodules_of_the_model():
    """ResNet's stages() groups its stem and head in new containers (for ddp_mp) that its forward never
    calls: sharded as units, FSDP would never gather them, and the root refuses their already sharded
    parameters. They go with the root's unit; the residual layers are units."""
    from ddpexp.models.resnet import resnet18

    model = resnet18(num_classes=10, input_shape=[3, 32, 32])
    assert shard_units(model) == [model.layer1, model.layer2, model.layer3, model.layer4]
    assert shard_units(mlp(num_classes=10, input_shape=[1, 28, 28])) != []


# ---------------------------------------------------------------- accumulation skips the reductions

# The collectives FSDP2 reduce-scatters gradients with (torch.distributed's name changed across
# versions: reduce_scatter_tensor, reduce_scatter_single): whichever this torch has are counted.
REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter")


def _count_reduce_scatters() -> list[int]:
    calls = [0]
    for name in REDUCE_SCATTERS:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def _accumulating_rank(rank: int, tmp: str) -> None:
    """One optimizer step's backward passes as the engine runs them: all micro-batches but the last
    under the strategy's no_sync, forward included. Reduce-scatter calls counted per step."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=2)
    calls = _count_reduce_scatters()
    # All that FSDP.wrap reads of the context: the device, and the training's precision.
    ctx: Any = SimpleNamespace(device=torch.device("cpu"), plan=SimpleNamespace(precision="fp32"))
    counts = {}
    for accumulate in (1, 2, 4):
        torch.manual_seed(0)
        model = mlp(num_classes=10, input_shape=[1, 28, 28])  # two shard units: body and head
        wrapped = Fsdp(FsdpConfig()).wrap(model, ctx=ctx, measure_comm=False)
        before = calls[0]
        for micro in range(accumulate):
            last = micro == accumulate - 1
            with nullcontext() if last else wrapped.no_sync():
                wrapped.module(torch.randn(4, 1, 28, 28)).square().mean().backward()
        counts[accumulate] = calls[0] - before
        assert all(p.grad is not None for p in model.parameters())
    torch.save(counts, f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()


def test_fsdp_accumulation_reduces_the_gradients_once_per_step(tmp_path: Path):
    """trainer.accumulate=K under fsdp: gradients stay local (unsharded) until the last micro-batch,
    whose backward reduce-scatters them: as many reduce-scatters per step as without accumulation (one
    per shard unit), not one per micro-batch."""
    start_ranks(_accumulating_rank, (str(tmp_path),), nprocs=2)
    for rank in range(2):
        counts = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert counts[1] > 0, counts  # the counter does see FSDP's reduce-scatters
        assert counts == {1: counts[1], 2: counts[1], 4: counts[1]}, (rank, counts)


def test_fsdp_communication_is_measured_all_gathers_and_reduce_scatters(tmp_path: Path):
    """trainer.measure_comm counts each unit's all-gathers (the rank's shard) and reduce-scatters (the
    unit's whole gradient) per step. The MLP's sizes split evenly over 2 ranks (no padding), so with
    S its parameter bytes: without resharding one all-gather of every unit per step, S/2, plus the
    reduce-scatters, S; resharding after forward gathers the non-root units again in backward."""
    sweep = ["-m", "strategy=fsdp", "strategy.reshard_after_forward=false,true", *PARITY, "hydra.sweep.dir=s"]
    result = run_here(tmp_path, *sweep)
    assert result.returncode == 0, result
    keep, reshard = (
        metrics(tmp_path / "s" / f"strategy.reshard_after_forward={v}")["final"] for v in (False, True)
    )
    size = 4 * sum(
        v.numel() for v in weights(tmp_path / "s" / "strategy.reshard_after_forward=False").values()
    )
    assert keep["comm/bytes_per_step"] == pytest.approx(1.5 * size, rel=1e-9)
    assert 1.5 * size < reshard["comm/bytes_per_step"] <= 2 * size
    # The cost model (FSDP.communication, what ddpexp-predict uses) counts the same bytes.
    for v, final in ((False, keep), (True, reshard)):
        predicted = predicted_bytes(tmp_path / "s" / f"strategy.reshard_after_forward={v}")
        assert predicted == pytest.approx(final["comm/bytes_per_step"], rel=0.01), v
    for final in (keep, reshard):
        # > 0 only: on a run this short the share can pass 1 (ranks' start-up skew waits in the first
        # collective, counted against rank 0's epoch time; a known limit of comm/share).
        assert final["comm/share"] > 0 and final["comm/time_per_step_s"] > 0

"""pipeline on gloo ranks: each rank one stage of the model, micro-batched through GPipe or 1F1B. It
trains the same model as `single` at the same global batch (both schedules; 3 stages; 2 replicas with
accumulation; with clipping), evaluates every eval sample once through the pipeline, measures its
bubble, and its checkpoints hold the whole model and a plain optimizer state, so runs move between
pipeline and the other strategies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose

from ddpexp import load_model
from ddpexp.errors import UserError
from ddpexp.plan import HostFacts
from ddpexp.strategies.pipeline import Pipeline, PipelineConfig
from ddpexp.strategies.pipeline.stage import StageTimer
from ddpexp.validate import plan

from .conftest import (
    PARITY,
    RESUME,
    TOLERANCE,
    assert_close_weights,
    metrics,
    run_here,
    same_weights,
    scored_by_single,
    weights,
)

CPU_HOST = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
# A BatchNorm-free model with 3 stages (conv, conv, head), small enough for 3 ranks on 2 cores.
CONV3 = ["model=convnet", "model.batch_norm=false", "model.channels=[4,8]", "data=synthetic"]


def assert_bubble(run: Path, *, stages: int, microbatches: int) -> None:
    final = metrics(run)["final"]
    assert final["pipe/bubble_frac_textbook"] == (stages - 1) / (microbatches + stages - 1)
    assert 0.0 <= final["pipe/bubble_frac"] < 1.0


def test_the_layout_puts_the_stages_of_a_replica_on_one_shard(hydra_conf):
    """rank = replica x stages + stage; the global batch splits over the replicas only."""
    cfg = compose(config_name="config", overrides=["strategy=pipeline", "strategy.replicas=2", *PARITY[:2]])
    p = plan(cfg, CPU_HOST)
    assert (p.world_size, p.nprocs_per_node, p.data_parallel) == (4, 4, 2)
    assert p.shard_of_rank == (0, 0, 1, 1)
    assert p.per_rank_batch == cfg.trainer.batch_size // 2


class TwoLayers(torch.nn.Module):
    def __init__(self, *, tied: bool, split: bool) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        if tied:
            self.b.weight = self.a.weight
        self.split = split

    def stages(self) -> list[torch.nn.Module]:
        return [self.a, self.b] if self.split else [self.a]


@pytest.mark.parametrize(
    ("tied", "split", "words"),
    [
        (True, True, ["a.weight", "two stages", "tied"]),
        (False, False, ["leave out b.weight", "strategy=ddp"]),
    ],
)
def test_a_model_whose_stages_do_not_partition_it_is_refused(tied: bool, split: bool, words: list[str]):
    """Each rank keeps its stage's weights only: a tensor in two stages, or in none, cannot work."""
    with pytest.raises(UserError) as refused:
        Pipeline(PipelineConfig(stages=2 if split else 1)).check_model(TwoLayers(tied=tied, split=split))
    assert all(word in str(refused.value) for word in words), refused.value


def test_the_bubble_is_the_share_of_each_step_outside_the_stage_s_computations():
    """Measured on a fake clock: step time and compute time add up from the second step on (the
    first infers the shapes), so the bubble of these steps is 1 - 2.5 / 4."""
    now = [0.0]
    timer = StageTimer(torch.device("cpu"), clock=lambda: now[0])
    for _ in range(3):
        with timer.step():
            now[0] += 1.0  # waiting for the previous stage's activations
            with timer.compute():
                now[0] += 2.0  # a forward
            now[0] += 0.5  # waiting for the next stage's gradient
            with timer.compute():
                now[0] += 0.5  # a backward
    assert timer.take() == (5.0, 8.0)
    assert timer.take() == (0.0, 0.0)  # per epoch


@pytest.mark.multiproc
def test_pipeline_trains_like_single_at_the_same_global_batch(parity_sweep: Path, tmp_path: Path):
    """Both schedules, 2 stages x 4 micro-batches, against single: the same weights, the same exact
    evaluation (every eval sample once, scored by the last stage), and the bubble measured."""
    single = parity_sweep / "strategy=single"
    sweep = ["-m", "strategy=pipeline", "strategy.schedule=gpipe,1f1b", *PARITY, "hydra.sweep.dir=s"]
    result = run_here(tmp_path, *sweep)
    assert result.returncode == 0, result
    for schedule in ("gpipe", "1f1b"):
        run = tmp_path / "s" / f"strategy.schedule={schedule}"
        assert_close_weights(run, single)
        ours, theirs = metrics(run), metrics(single)
        assert ours["facts"]["world_size"] == 2
        assert ours["final"]["eval/samples"] == theirs["final"]["eval/samples"]
        assert ours["final"]["eval/loss"] == pytest.approx(theirs["final"]["eval/loss"], rel=1e-5)
        assert ours["final"]["train/epoch_loss"] == pytest.approx(
            theirs["final"]["train/epoch_loss"], rel=1e-5
        )
        assert_bubble(run, stages=2, microbatches=4)
        # what the stages send is counted, not timed: no share of the wall time is claimed for it
        assert ours["final"]["comm/bytes_per_step/activations"] > 0
        assert "comm/share" not in ours["final"] and "comm/time_per_step_s" not in ours["final"]
        # each rank holds its own stage only: the first (the MLP's body) is the larger
        body = sum(v.numel() for k, v in weights(run).items() if k.startswith("body.")) * 4 / 2**20
        assert ours["final"]["mem/params_mb"] == pytest.approx(body)


@pytest.mark.multiproc
def test_three_stages_with_clipping_train_like_single(tmp_path: Path):
    """3 ranks, 1F1B: clipping needs the whole gradient's norm, not one stage's."""
    clip = [*CONV3, "trainer.progress=false", "trainer.max_steps=3", "trainer.batch_size=48"]
    clip += ["trainer.clip_grad_norm=0.05", "optim.lr=0.5"]
    pipe = ["strategy=pipeline", "strategy.stages=3", "strategy.schedule=1f1b", "strategy.microbatches=3"]
    for name, strategy in (("single", ["strategy=single"]), ("pipeline", pipe)):
        result = run_here(tmp_path, *strategy, *clip, f"hydra.run.dir={name}")
        assert result.returncode == 0, result
    assert_close_weights(tmp_path / "pipeline", tmp_path / "single")
    assert metrics(tmp_path / "pipeline")["facts"]["world_size"] == 3
    assert_bubble(tmp_path / "pipeline", stages=3, microbatches=3)
    unclipped = run_here(tmp_path, "strategy=single", *clip[:-2], "optim.lr=0.5", "hydra.run.dir=unclipped")
    assert unclipped.returncode == 0, unclipped
    assert not torch.allclose(
        weights(tmp_path / "single")["head.1.weight"], weights(tmp_path / "unclipped")["head.1.weight"]
    )


@pytest.mark.multiproc
def test_two_replicas_average_their_stages_and_score_every_eval_sample_once(tmp_path: Path):
    """2 stages x 2 replicas on 4 ranks, with accumulation, against single. 65 eval samples split
    33/32 over the replicas (eval batches of 32: one of a single sample): single scores the
    pipeline's own weights on the same 65 samples identically."""
    data = [*PARITY, "data.num_eval=65"]  # the synthetic labels depend on the eval size: single's too
    args = ["strategy=pipeline", "strategy.replicas=2", "trainer.accumulate=2"]
    for name, strategy in (("single", ["strategy=single"]), ("pipe", args)):
        result = run_here(tmp_path, *strategy, *data, f"hydra.run.dir={name}")
        assert result.returncode == 0, result
    assert_close_weights(tmp_path / "pipe", tmp_path / "single")
    ours = metrics(tmp_path / "pipe")["final"]
    assert ours["eval/samples"] == 65
    assert ours["comm/bytes_per_step/gradients"] > 0  # the data-parallel all-reduce of each stage's
    # What the stages send each other, counted as sent, is what the cost model declares, byte for byte.
    from ddpexp.predict import predicted_bytes

    assert ours["comm/bytes_per_step/activations"] > 0
    assert predicted_bytes(tmp_path / "pipe") == pytest.approx(ours["comm/bytes_per_step"], rel=1e-9)
    scored = run_here(
        tmp_path,
        "strategy=single",
        *data,
        "trainer.mode=eval",
        f'trainer.resume="{tmp_path / "pipe" / "model.pt"}"',
        "hydra.run.dir=eval",
    )
    assert scored.returncode == 0, scored
    theirs = metrics(tmp_path / "eval")["final"]
    assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-6)
    assert ours["eval/acc"] == theirs["eval/acc"]


@pytest.mark.multiproc
def test_pipeline_checkpoints_hold_the_whole_model_and_a_plain_optimizer_state(uninterrupted, tmp_path: Path):
    """A pipeline run resumed from its own checkpoint ends bitwise where the uninterrupted one does; its
    checkpoint is single's (same model, same momentum, numbered the same), which single scores
    identically and resumes from to the uninterrupted single run's result."""
    pipe, single = uninterrupted("pipeline"), uninterrupted("single")
    step64 = [torch.load(d / "checkpoints" / "step-00000064.pt", weights_only=True) for d in (pipe, single)]
    ours, theirs = step64
    assert list(ours["model"]) == list(theirs["model"])
    for name, value in ours["model"].items():
        torch.testing.assert_close(value, theirs["model"][name], **TOLERANCE, msg=name)
    assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    assert ours["optimizer"]["state"].keys() == theirs["optimizer"]["state"].keys()
    for index, state in ours["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(value, theirs["optimizer"]["state"][index][key], **TOLERANCE)

    start = pipe / "checkpoints" / "step-00000064.pt"
    args = ["strategy=pipeline", *RESUME, "trainer.max_steps=70", f'trainer.resume="{start}"']
    resumed = run_here(tmp_path, *args, "hydra.run.dir=pipe")
    assert resumed.returncode == 0, resumed
    assert same_weights(tmp_path / "pipe", pipe)

    assert isinstance(load_model(pipe), torch.nn.Module)
    scored = scored_by_single(tmp_path, pipe)
    assert scored["eval/loss"] == pytest.approx(metrics(pipe)["final"]["eval/loss"], rel=1e-6)
    more = [
        "strategy=single",
        *RESUME,
        "trainer.max_steps=70",
        f'trainer.resume="{start}"',
        "hydra.run.dir=single",
    ]
    moved = run_here(tmp_path, *more)
    assert moved.returncode == 0, moved
    assert_close_weights(tmp_path / "single", single)


@pytest.mark.multiproc  # a fresh interpreter
def test_the_strategy_registry_does_not_import_torch_pipelining():
    """torch.distributed.pipelining takes ~1.3 s to import (torch._dynamo, DTensor). Every launcher,
    worker, ddpexp-predict and ddpexp-report loads the built-in strategies, so the pipeline strategy
    imports it only when it builds a pipeline (ddpexp-predict went from 4.5 to 2.5-3.3 s)."""
    code = (
        "import sys, ddpexp.strategies as s; s.load_builtins(); "
        "print('torch.distributed.pipelining' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]

"""The pipeline schedules that run several stages on each rank: interleaved 1F1B and interleaved zero
bubble (stages in a loop over the ranks), ZB-V and DualPipeV (two stages a rank, in a V), through
torch.distributed.pipelining. Each trains the transformer to single's parameters at the same global
batch (alone, and as 2 replicas with accumulation), sends between stages the bytes its cost model
declares, and reports its bubble next to its schedule's formula. With FSDP or tensor parallelism
inside the stages they are tests/test_nd.py's meshes; their memory is tests/test_memory_model.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpexp.strategies.pipeline.stage import Schedule, bubble_textbook, in_flight, stage_ranks

from .conftest import made_once, metrics, run_here, weights
from .test_gpt_parity import EXACT, GPT, assert_same_job, drift

SCHEDULES = ["interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"]
PIPELINE = {name: ["strategy=pipeline", f"strategy.schedule={name}"] for name in SCHEDULES}
REPLICATED = {
    f"{name} 2x2 accumulate 2": [*PIPELINE[name], "strategy.replicas=2", "trainer.accumulate=2"]
    for name in ("interleaved_1f1b", "zbv")
}
# Each split backward recomputes a checkpointed block once for the inputs' gradients, once for the weights'.
CHECKPOINTED = {"zbv checkpointed": [*PIPELINE["zbv"], "trainer.activation_checkpointing=full"]}
SAVING = ["checkpoint.every_steps=4"]  # ZB-V's step-4 checkpoint, resumed under other layouts
RUNS = {
    "init": ["strategy=single", "trainer.max_steps=0"],
    "single": ["strategy=single"],
    **PIPELINE,
    **REPLICATED,
    **CHECKPOINTED,
    "zbv saving": [*PIPELINE["zbv"], *SAVING],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def make(cwd: Path) -> None:
        for name, args in RUNS.items():
            result = run_here(cwd, *GPT, *args, f"hydra.run.dir={_folder(name)}")
            assert result.returncode == 0, result

    made = made_once(tmp_path_factory, "pipeline-schedules", make)
    return {name: made / _folder(name) for name in RUNS}


def _folder(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [*PIPELINE, *REPLICATED, *CHECKPOINTED])
def test_every_schedule_trains_the_transformer_to_single_s_parameters(runs: dict[str, Path], name: str):
    """gpt_tiny's 4 stages (embedding, 2 blocks, head) on 2 ranks, 4 micro-batches; every eval window
    scored once through the stages."""
    run, single = runs[name], runs["single"]
    measured = drift(weights(run), weights(single), weights(runs["init"]))
    assert measured <= EXACT, f"{name}: a tensor drifted {measured:.3g} from single's, allowed {EXACT:g}"
    ours, theirs = assert_same_job(run, single, 4 if "2x2" in name else 2)
    assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-6, abs=0)
    assert ours["train/epoch_loss"] == pytest.approx(theirs["train/epoch_loss"], rel=1e-5, abs=0)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [*PIPELINE, *REPLICATED])
def test_the_bytes_between_stages_are_those_the_cost_model_declares(runs: dict[str, Path], name: str):
    """What the stages send each other (and the replicas' all-reduce) equals Pipeline.communication's
    count; a V sends over 2 of its 3 stage boundaries (its turn stays on the last rank), a loop over
    all 3."""
    from ddpexp.predict import predicted_bytes

    final = metrics(runs[name])["final"]
    assert predicted_bytes(runs[name]) == pytest.approx(final["comm/bytes_per_step"], rel=1e-9)
    looped = "interleaved_1f1b 2x2 accumulate 2" if "2x2" in name else "interleaved_1f1b"
    loop = metrics(runs[looped])["final"]["comm/bytes_per_step/activations"]
    share = 2 / 3 if name.startswith(("zbv", "dualpipev")) else 1.0
    assert final["comm/bytes_per_step/activations"] == pytest.approx(share * loop)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(PIPELINE))
def test_each_schedule_reports_its_measured_bubble_next_to_its_formula(runs: dict[str, Path], name: str):
    final = metrics(runs[name])["final"]
    formula = bubble_textbook(Schedule(name), ranks=2, microbatches=4, per_rank=2)
    assert final["pipe/bubble_frac_textbook"] == pytest.approx(formula)
    assert 0.0 <= final["pipe/bubble_frac"] < 1.0


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_stages_are_placed_on_the_ranks_as_torch_places_them(ranks: int):
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for schedule, style in (("interleaved_1f1b", "loop"), ("zbv", "v")):
        mapping = generate_stage_to_rank_mapping(ranks, 2 * ranks, style=style)
        assert stage_ranks(Schedule(schedule), ranks, 2) == [mapping[s] for s in range(2 * ranks)]
    assert stage_ranks(Schedule("interleaved_1f1b"), ranks, 3) == [s % ranks for s in range(3 * ranks)]


def test_the_textbook_bubbles_are_the_papers():
    """p = 4 ranks, m = 8 micro-batches, v = 2 stages a rank."""
    p, m, v = 4, 8, 2
    assert bubble_textbook(Schedule("gpipe"), ranks=p, microbatches=m, per_rank=1) == 3 / 11
    assert bubble_textbook(Schedule("1f1b"), ranks=p, microbatches=m, per_rank=1) == 3 / 11
    assert bubble_textbook(Schedule("interleaved_1f1b"), ranks=p, microbatches=m, per_rank=v) == 3 / 19
    assert bubble_textbook(Schedule("interleaved_zero_bubble"), ranks=p, microbatches=m, per_rank=v) == 3 / 51
    assert bubble_textbook(Schedule("zbv"), ranks=p, microbatches=m, per_rank=v) == 0.0
    assert bubble_textbook(Schedule("1f1b"), ranks=1, microbatches=m, per_rank=1) == 0.0


def test_the_micro_batches_in_flight_follow_torch_s_order_of_each_rank_s_work():
    """1F1B's first rank holds p micro-batches, its last one; ZB-V balances the ranks, each holding p
    micro-batches' worth over its two half-size stages at its peak (the paper's claim), and its
    split backwards leave every micro-batch done by the step's end."""
    assert in_flight(Schedule("1f1b"), ranks=4, microbatches=8, per_rank=1, rank=0) == (((4, 0),),)
    assert in_flight(Schedule("1f1b"), ranks=4, microbatches=8, per_rank=1, rank=3) == (((1, 0),),)
    for rank in range(4):
        points = in_flight(Schedule("zbv"), ranks=4, microbatches=8, per_rank=2, rank=rank)
        assert max(sum(live for live, _ in point) for point in points) == 8
        assert points[-1] == ((0, 8), (0, 8))


@pytest.mark.multiproc
def test_a_checkpoint_of_two_stages_a_rank_resumes_under_single_and_under_another_schedule(
    runs: dict[str, Path], tmp_path: Path
):
    """ZB-V's checkpoint at step 4 holds the whole model under its own names and a plain optimizer
    state: single, and interleaved 1F1B on a different placement of the stages, each continue from it
    to the uninterrupted run's parameters at step 8."""
    uninterrupted = runs["zbv saving"]
    start = uninterrupted / "checkpoints" / "step-00000004.pt"
    for name, args in {"single": ["strategy=single"], "interleaved": PIPELINE["interleaved_1f1b"]}.items():
        result = run_here(tmp_path, *GPT, *args, f'trainer.resume="{start}"', f"hydra.run.dir={name}")
        assert result.returncode == 0, result
        measured = drift(weights(tmp_path / name), weights(uninterrupted), weights(runs["init"]))
        assert measured <= EXACT, f"resumed under {name}: drifted {measured:.3g}"
        assert metrics(tmp_path / name)["final"]["step"] == 8


@pytest.mark.multiproc
def test_the_schedules_script_prints_every_schedule_s_row(tmp_path: Path):
    """scripts/pipeline_schedules.py, the docs' table: one round, 3 steps a run."""
    script = Path(__file__).parents[1] / "scripts" / "pipeline_schedules.py"
    args = [
        "--rounds",
        "1",
        "--format",
        "md",
        "--out",
        str(tmp_path / "runs"),
        "--extra",
        "trainer.max_steps=3",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| ") for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert rows >= {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"}

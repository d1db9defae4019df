"""local_sgd and diloco on 2 gloo processes. They are other algorithms than `single`, so what is tested
is what holds exactly: with H = 1 and SGD as the (inner) optimizer local SGD is ddp, and so is DiLoCo
with an outer SGD of lr 1 without momentum (to float rounding); the bytes per step are the model's
parameters / H, measured and as the cost model declares them; a run stopped mid-period resumes bitwise
(every rank's own copy and optimizer state, and DiLoCo's global parameters and outer momentum, are in
the checkpoint), and the checkpoint's model is the global one, which `single` scores identically; bad
settings are refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpexp import predict, strategies
from ddpexp.config import Precision
from ddpexp.engine import Engine, LoopSettings
from ddpexp.errors import UserError
from ddpexp.recorder import NullRecorder
from ddpexp.strategies import Wrapped
from ddpexp.strategies.local_sgd import split_by_bytes

from .conftest import PARITY, RESUME, metrics, run_here, same_weights, scored_by_single
from .test_cli import refuse
from .test_training import assert_same_state, ckpt

# Sums of two ranks' updates in another order than ddp's averaged gradient: float rounding only.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def close(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.allclose(v, wb[k], **TOLERANCE) for k, v in wa.items())


RUNS = {
    "ddp": ["strategy=ddp"],
    "local_sgd_h1": ["strategy=local_sgd", "strategy.sync_every=1"],
    "diloco_h1_plain": [
        "strategy=diloco",
        "strategy.sync_every=1",
        "strategy.outer_lr=1",
        "strategy.outer_momentum=0",
    ],
    "diloco_h1_nesterov": ["strategy=diloco", "strategy.sync_every=1"],  # the paper's outer step
    "local_sgd_h5": ["strategy=local_sgd", "strategy.sync_every=5"],
    "diloco_h5_streaming": ["strategy=diloco", "strategy.sync_every=5", "strategy.fragments=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PARITY experiment (5 steps of SGD with momentum 0.9 on the MLP, 2 ranks) under each of RUNS."""
    cwd = tmp_path_factory.mktemp("periodic")
    for name, args in RUNS.items():
        result = run_here(cwd, *args, *PARITY, f"hydra.run.dir={name}")
        assert result.returncode == 0, result
    return cwd


@pytest.mark.multiproc
def test_with_h_1_and_sgd_both_are_ddp(runs: Path):
    """SGD's update (momentum and weight decay included) is linear in the gradient, so averaging the
    ranks' parameters after each step is stepping on the averaged gradient; DiLoCo's outer SGD with lr 1
    and no momentum lands on that average. The controls: a Nesterov outer step, or averaging only
    every 5 steps, is another algorithm, and the check tells."""
    ddp = runs / "ddp"
    assert close(runs / "local_sgd_h1", ddp)
    assert close(runs / "diloco_h1_plain", ddp)
    assert not close(runs / "diloco_h1_nesterov", ddp)
    assert not close(runs / "local_sgd_h5", ddp)
    # what is evaluated is the global model: with H = 1, ddp's
    for name in ("local_sgd_h1", "diloco_h1_plain"):
        ours, theirs = metrics(runs / name)["final"], metrics(ddp)["final"]
        assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-5)
        assert ours["eval/samples"] == theirs["eval/samples"]


@pytest.mark.multiproc
def test_bytes_per_step_are_the_models_parameters_over_h(runs: Path):
    """comm/bytes_per_step = S/H (the MLP has no buffers), of the kind each sends, and what the cost
    model declares for the run (`ddpexp-predict` compares the two one for one)."""
    S = sum(v.numel() for v in weights(runs / "ddp").values()) * 4
    expected = {
        "local_sgd_h1": ("parameters", S),
        "diloco_h1_plain": ("gradients", S),
        "local_sgd_h5": ("parameters", S / 5),
        "diloco_h5_streaming": ("gradients", S / 5),  # two halves, at steps 2 and 5
    }
    for name, (kind, nbytes) in expected.items():
        final = metrics(runs / name)["final"]
        assert final["comm/bytes_per_step"] == final[f"comm/bytes_per_step/{kind}"] == nbytes, name
        assert predict.predicted_bytes(runs / name) == pytest.approx(nbytes, rel=1e-12), name
        assert final["comm/time_per_step_s"] > 0, name  # timed although one step in 10 is sampled


def test_fragments_split_the_parameters_into_consecutive_parts_of_about_equal_bytes():
    sizes = [10, 1, 1, 100, 5, 5, 50, 50]
    params = [torch.zeros(n) for n in sizes]
    assert split_by_bytes(params, 1) == [list(range(8))]
    assert split_by_bytes(params, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_by_bytes(params, 8) == [[i] for i in range(8)]
    for parts in range(1, 9):
        split = split_by_bytes(params, parts)
        assert [i for part in split for i in part] == list(range(8)) and all(split), parts


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["diloco", "local_sgd"])
def test_a_run_stopped_mid_period_resumes_bitwise_and_single_scores_its_checkpoint(
    strategy: str, tmp_path: Path
):
    """Stopped at step 45 (checkpoints every 20 steps; H = 4, so 1 step into a period: the ranks' copies
    differ) and resumed to 70: the same checkpoint state and model.pt as the run that never stopped.
    The checkpoint's model is the global one (the average of the copies, or DiLoCo's global
    parameters), which `single` scores as the run itself did."""
    args = [f"strategy={strategy}", "strategy.sync_every=4", *RESUME]
    whole = run_here(tmp_path, *args, "trainer.max_steps=70", "hydra.run.dir=whole")
    assert whole.returncode == 0, whole
    first = run_here(tmp_path, *args, "trainer.max_steps=45", "hydra.run.dir=parts")
    assert first.returncode == 0, first
    saved = ckpt(tmp_path / "parts")["optimizer"][strategy]
    ranks = saved["ranks"]
    assert saved["steps"] == 45 and len(ranks) == 2
    assert not torch.equal(ranks[0]["params"][0], ranks[1]["params"][0])  # mid-period: copies differ
    if strategy == "diloco":
        assert saved["outer"]["state"]  # the outer momentum
    second = run_here(tmp_path, *args, "trainer.max_steps=70", "hydra.run.dir=parts", "trainer.resume=auto")
    assert second.returncode == 0, second
    assert "resumed from" in second.stdout + second.stderr + (tmp_path / "parts" / "ddpexp.log").read_text()
    assert_same_state(ckpt(tmp_path / "whole"), ckpt(tmp_path / "parts"))
    assert same_weights(tmp_path / "whole", tmp_path / "parts")
    ours = metrics(tmp_path / "whole")["final"]
    theirs = scored_by_single(tmp_path, tmp_path / "whole")
    assert theirs["eval/acc"] == ours["eval/acc"]
    assert theirs["eval/loss"] == pytest.approx(ours["eval/loss"], rel=1e-6)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["strategy=local_sgd", "strategy.sync_every=0"], ["strategy.sync_every", "1 or more"]),
        (["strategy=diloco", "strategy.sync_every=-2"], ["strategy.sync_every", "1 or more"]),
        (["strategy=diloco", "strategy.outer_lr=0"], ["strategy.outer_lr", "> 0"]),
        (["strategy=diloco", "strategy.outer_momentum=1"], ["strategy.outer_momentum", "[0, 1)"]),
        (["strategy=diloco", "strategy.fragments=0"], ["strategy.fragments", "> 0"]),
        (
            ["strategy=diloco", "strategy.sync_every=4", "strategy.fragments=5"],
            ["strategy.fragments", "strategy.fragments<=4"],
        ),
        (
            [
                "strategy=diloco",
                "model=toy",
                "data=synthetic",
                "strategy.sync_every=8",
                "strategy.fragments=8",
            ],
            ["strategy.fragments", "too few"],
        ),
        (["strategy=local_sgd", "dist.nprocs=1"], ["dist.nprocs", "strategy=single"]),
        (["strategy=local_sgd", "strategy.outer_lr=1"], ["strategy.outer_lr", "strategy=diloco"]),
        (["strategy=diloco", "strategy.sync_bn=true"], ["strategy.sync_bn", "not in 'DilocoConfig'"]),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(
    args: list[str], words: list[str], tmp_path: Path, monkeypatch, capsys
):
    line = refuse(tmp_path, monkeypatch, capsys, *args)
    for word in words:
        assert word in line, line


def test_fp16_is_refused_where_ranks_step_on_their_own_gradients(recwarn):
    """fp16's loss scaler skips a step where a rank's gradients overflow; with gradients of their own,
    one rank could skip alone and the ranks' synchronisations fall out of step."""
    model = torch.nn.Linear(2, 2)
    settings = LoopSettings(epochs=1, max_steps=None, log_every_steps=1, eval_every_epochs=1, global_batch=2)
    settings.precision = Precision.fp16

    def engine(own_steps: bool) -> Engine:
        return Engine(
            model=Wrapped(module=model, base=model, own_steps=own_steps, sync_buffers=lambda: None),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_loader=None,  # type: ignore[arg-type]
            eval_loader=None,  # type: ignore[arg-type]
            recorder=NullRecorder(),
            settings=settings,
            device=torch.device("cpu"),
        )

    engine(False)
    with pytest.raises(UserError, match="fall out of step"):
        engine(True)


def test_both_describe_their_bytes_for_the_cost_model_and_diloco_allows_one_rank():
    from .test_predict import S, job  # the ConvNet with BatchNorm: 116,136 bytes of parameters

    statistics = sum(b.numel() * 4 for b in job(2).model.buffers() if b.is_floating_point())
    assert statistics == 384  # running means and variances; the batch counters are equal on every rank
    for name, settings in (("local_sgd", {"sync_every": 4}), ("diloco", {"sync_every": 4, "fragments": 2})):
        out = strategies.resolve({"name": name, **settings}).communication(job=job(2))
        assert [c.counted for c in out] == [S / 4, statistics / 4]
        assert out[0].calls == settings.get("fragments", 1) / 4
        assert strategies.resolve({"name": name, **settings}).communication(job=job(1)) == []


def test_a_collective_of_some_steps_only_is_timed_every_time_and_not_scaled():
    """The meter samples one step in k and scales the sampled busy time up by k; a collective that runs
    every H steps would be missed by the sample or scaled k-fold, so it is added as it is."""
    from ddpexp.strategies.comm import CommMeter

    meter = CommMeter()
    for step in range(4):
        meter.begin_step(every=2)  # steps 0 and 2 sampled
        if meter.timing:
            meter.record(10.0 * step, 10.0 * step + 1.0, 8)  # 1 s in each sampled step
        if step == 3:  # an unsampled step
            meter.record_unsampled(35.0, 35.5, 100, "parameters")
        meter.end_step()
    busy, nbytes = meter.take()
    assert busy == pytest.approx(2 * 2 + 0.5)  # 2 s sampled in 2 of 4 steps, scaled; 0.5 s as it is
    assert nbytes["gradients"] == 16 and nbytes["parameters"] == 100


@pytest.mark.usefixtures("hydra_conf")
def test_the_low_communication_preset_runs_each_strategy_on_one_model_batch_and_step_count():
    """experiment=low_communication (the comparison on the DiLoCo page): five jobs, every one
    accepted by pre-flight on a CPU-only host, with the same model, data, optimizer, global batch and
    steps, a step count every H divides (the saved models then hold every step)."""
    from hydra import compose

    from ddpexp.composition import expand
    from ddpexp.plan import HostFacts
    from ddpexp.preflight import check_job

    def comp(overrides: list[str]):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)

    _, expanded, varying = expand(["experiment=low_communication"], multirun=True, compose=comp)
    assert varying == {"strategy"}
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    seen = {}
    for job in expanded:
        cfg = comp(job)
        check_job(cfg, host, multirun=True)
        strategy = strategies.resolve(cfg.strategy)
        seen[next(o for o in job if o.startswith("strategy="))] = strategy.changed_settings()
        assert (cfg.model.n_layer, cfg.data.block_size, cfg.optim.name) == (4, 128, "adamw")  # gpt_small
        assert (cfg.trainer.batch_size, cfg.trainer.max_steps) == (32, 200)
        assert cfg.trainer.max_steps % getattr(strategy.settings, "sync_every", 1) == 0
    assert seen == {
        "strategy=ddp": {},
        "strategy=local_sgd": {},
        "strategy=diloco": {},
        "strategy=diloco_streaming": {"fragments": 5},
        "strategy=ps_async": {"mode": "async"},
    }
    # the page's second command (a sweep whose one job is this): local SGD at DiLoCo's H, same settings
    more = ["experiment=low_communication", "strategy=local_sgd", "strategy.sync_every=50"]
    cfg = comp(more)
    check_job(cfg, host, multirun=True)
    assert strategies.resolve(cfg.strategy).changed_settings() == {"sync_every": 50}
    assert (cfg.trainer.batch_size, cfg.trainer.max_steps, cfg.model.n_layer) == (32, 200, 4)


@pytest.mark.multiproc
def test_a_checkpoint_of_another_strategy_or_world_size_starts_every_rank_from_its_model(tmp_path: Path):
    """A ddp checkpoint (no copies of its own) resumed under diloco, and that diloco checkpoint (2 ranks)
    resumed on 4: every rank continues from the saved model and optimizer state in a fresh period; the
    outer momentum carries over to another world size, with a warning that the run is not bitwise."""
    args = [*RESUME, "trainer.max_steps=20"]
    ddp = run_here(tmp_path, "strategy=ddp", *args, "hydra.run.dir=ddp")
    assert ddp.returncode == 0, ddp
    start = tmp_path / "ddp" / "checkpoints" / "last.pt"
    diloco = ["strategy=diloco", "strategy.sync_every=4", *RESUME]
    two = run_here(
        tmp_path, *diloco, "trainer.max_steps=30", f'trainer.resume="{start}"', "hydra.run.dir=two"
    )
    assert two.returncode == 0, two
    before = ckpt(tmp_path / "two")["optimizer"]["diloco"]
    assert before["steps"] == 10 and before["outer"]["state"]  # 10 steps since the resume: 2 outer steps
    then = tmp_path / "two" / "checkpoints" / "last.pt"
    four = run_here(
        tmp_path,
        *diloco,
        "dist.nprocs=4",
        "trainer.max_steps=33",
        f'trainer.resume="{then}"',
        "hydra.run.dir=four",
    )
    assert four.returncode == 0, four
    said = four.stdout + four.stderr + (tmp_path / "four" / "ddpexp.log").read_text()
    assert "checkpoint of 2 ranks on 4" in said and "not bitwise" in said
    after = ckpt(tmp_path / "four")["optimizer"]["diloco"]
    assert after["world_size"] == 4 and after["steps"] == 3 and len(after["ranks"]) == 4
    for key, state in before["outer"]["state"].items():  # no outer step since: the same momentum
        assert torch.equal(state["momentum_buffer"], after["outer"]["state"][key]["momentum_buffer"]), key


@pytest.mark.multiproc
def test_diloco_on_one_process_takes_outer_steps_and_sends_nothing(tmp_path: Path):
    """One rank: every H steps the outer step moves the global model by the copy's progress, and the copy
    restarts from it; nothing is sent, as declared."""
    args = ["strategy=diloco", "strategy.sync_every=2", "dist.nprocs=1", *PARITY]
    result = run_here(tmp_path, *args, "trainer.max_steps=4", "hydra.run.dir=one")
    assert result.returncode == 0, result
    m = metrics(tmp_path / "one")
    assert m["facts"]["world_size"] == 1 and m["final"]["comm/bytes_per_step"] == 0
    assert predict.predicted_bytes(tmp_path / "one") == 0
    saved = ckpt(tmp_path / "one")["optimizer"]["diloco"]
    mine = saved["ranks"][0]["params"]
    assert saved["outer"]["state"] and saved["steps"] == 4
    model = list(weights(tmp_path / "one").values())  # the MLP's parameters, in order
    assert all(torch.equal(g, p) for g, p in zip(model, mine, strict=True))  # just after an outer step


@pytest.mark.multiproc
def test_diloco_says_on_the_console_when_no_outer_step_has_moved_what_it_evaluates(tmp_path: Path):
    """H = 50 over a 5-step run: the global model never moves, every evaluation scores the starting
    weights, and the console says why (once), not only the docs. A run whose outer steps came says
    nothing."""
    args = ["strategy=diloco", "dist.nprocs=1", *PARITY]
    still = run_here(tmp_path, *args, "strategy.sync_every=50", "hydra.run.dir=still")
    assert still.returncode == 0, still
    said = [line for line in (still.stdout + still.stderr).splitlines() if "no outer step yet" in line]
    assert len(said) == 1 and "after step 50" in said[0], still.stdout + still.stderr
    moved = run_here(tmp_path, *args, "strategy.sync_every=1", "hydra.run.dir=moved")
    assert moved.returncode == 0 and "no outer step" not in moved.stdout + moved.stderr, moved

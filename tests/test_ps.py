"""ps (parameter server) on 3 gloo processes, rank 0 serving ranks 1 and 2: mode=sync trains the same
model as `single` at the same global batch (with accumulation and clipping too), mode=async does not
and still learns digits, with its staleness recorded; evaluation is exact; checkpoints are the
server's full state (resume, cross-strategy); a fast worker never deadlocks the async server; a dead
server stops the run at once, blamed."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ddpexp.optim import OptimizerSpec
from ddpexp.strategies.ps import ASYNC, Ps, PsConfig

from .conftest import PARITY, RESUME, metrics, run_here, same_weights, scored_by_single, start_ranks
from .fault_harness import LONG, Watched
from .test_training import assert_same_state, ckpt

pytestmark = pytest.mark.multiproc

TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # the server sums two workers' gradients, single one batch's


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def close(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.allclose(v, wb[k], **TOLERANCE) for k, v in wa.items())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PARITY experiment under ps, sync and async, with communication measured."""
    cwd = tmp_path_factory.mktemp("ps")
    sweep = ["-m", "strategy=ps", "strategy.mode=sync,async", "trainer.measure_comm=true"]
    result = run_here(cwd, *sweep, *PARITY, "hydra.sweep.dir=s")
    assert result.returncode == 0, result
    return cwd / "s"


def test_sync_trains_like_single_and_async_does_not(parity_sweep: Path, runs: Path, tmp_path: Path):
    single, sync, asynchronous = (
        parity_sweep / "strategy=single",
        runs / "strategy.mode=sync",
        runs / "strategy.mode=async",
    )
    assert close(sync, single)
    assert not close(asynchronous, single)  # the control: W-1 stale updates per step are another algorithm
    facts = metrics(sync)["facts"]
    assert (facts["world_size"], facts["replicas"], facts["per_rank_batch_size"]) == (3, 2, 32)
    # the optimizer lives on the server: its state on rank 0 only
    ranks = metrics(sync)["memory_per_rank"]
    assert ranks[0]["mem/optim_state_mb"] > 0 and [r["mem/optim_state_mb"] for r in ranks[1:]] == [0, 0]
    # accumulation and clipping: the server clips the averaged gradient, as single clips its own
    extra = [*PARITY, "trainer.accumulate=2", "trainer.clip_grad_norm=0.05", "optim.lr=0.5"]
    for strategy in ("single", "ps"):
        result = run_here(tmp_path, f"strategy={strategy}", *extra, f"hydra.run.dir={strategy}")
        assert result.returncode == 0, result
    assert close(tmp_path / "ps", tmp_path / "single")


def test_evaluation_scores_every_sample_once_on_the_servers_weights(parity_sweep: Path, runs: Path):
    single = metrics(parity_sweep / "strategy=single")["final"]
    for mode in ("sync", "async"):
        m = metrics(runs / f"strategy.mode={mode}")
        assert m["final"]["eval/samples"] == m["facts"]["eval_samples"] == single["eval/samples"]
    ours = metrics(runs / "strategy.mode=sync")["final"]
    assert ours["eval/loss"] == pytest.approx(single["eval/loss"], rel=1e-5)


def test_comm_counts_pushes_and_pulls_and_async_records_staleness(runs: Path):
    """Per step each worker pushes S bytes and the server sends each a pull of S: 2(W-1)/W x S per rank."""
    S = sum(v.numel() for v in weights(runs / "strategy.mode=sync").values()) * 4  # the MLP: no buffers
    for mode in ("sync", "async"):
        final = metrics(runs / f"strategy.mode={mode}")["final"]
        assert final["comm/bytes_per_step"] == pytest.approx(2 * 2 / 3 * S, rel=1e-12), mode
    assert "ps/staleness_mean" not in metrics(runs / "strategy.mode=sync")["final"]
    final = metrics(runs / "strategy.mode=async")["final"]
    assert 0 <= final["ps/staleness_mean"] <= final["ps/staleness_max"] <= 10  # 10 pushes in 5 steps
    assert final["ps/staleness_max"] >= 1  # two workers: one of them always pushes after the other's update


def test_async_learns_digits(tmp_path: Path):
    """The default experiment (ConvNet with BatchNorm on digits), asynchronously: every push is one
    update; the server's BatchNorm statistics follow the workers' batches."""
    result = run_here(tmp_path, "strategy=ps", "strategy.mode=async", "trainer.epochs=3", "hydra.run.dir=run")
    assert result.returncode == 0, result
    m = metrics(tmp_path / "run")
    assert m["status"] == "completed" and m["final"]["eval/acc"] >= 0.90, m["final"]
    assert m["final"]["eval/samples"] == m["facts"]["eval_samples"]
    for epoch in m["history"]:  # 22 engine steps an epoch, 2 pushes each
        assert 0 < epoch["ps/staleness_mean"] <= epoch["ps/staleness_max"] <= 44
        assert epoch["ps/staleness_max"] >= 1
    counted = {k: int(v) for k, v in weights(tmp_path / "run").items() if k.endswith("num_batches_tracked")}
    assert counted == {
        "layer1.1.num_batches_tracked": 132,
        "layer2.1.num_batches_tracked": 132,
    }  # one per push


def test_resume_mid_epoch_is_bitwise_the_uninterrupted_run_and_checkpoints_cross_strategies(
    uninterrupted, tmp_path: Path
):
    whole = uninterrupted("ps")
    args = ["strategy=ps", *RESUME]
    first = run_here(tmp_path, *args, "trainer.max_steps=45", "hydra.run.dir=parts")
    assert first.returncode == 0, first
    second = run_here(tmp_path, *args, "trainer.max_steps=70", "hydra.run.dir=parts", "trainer.resume=auto")
    assert second.returncode == 0, second
    assert "resumed from" in second.stdout + second.stderr
    assert_same_state(ckpt(whole), ckpt(tmp_path / "parts"))
    assert same_weights(whole, tmp_path / "parts")
    assert metrics(tmp_path / "parts")["final"]["eval/acc"] == metrics(whole)["final"]["eval/acc"]
    # the checkpoint is the common full state: single scores it identically and trains on from it
    scored = scored_by_single(tmp_path, whole)
    last = whole / "checkpoints" / "last.pt"
    ours, theirs = metrics(whole)["final"], scored
    assert theirs["eval/acc"] == ours["eval/acc"] and theirs["eval/loss"] == pytest.approx(
        ours["eval/loss"], rel=1e-6
    )
    more = run_here(
        tmp_path,
        "strategy=single",
        *RESUME,
        "trainer.max_steps=75",
        f'trainer.resume="{last}"',
        "hydra.run.dir=single",
    )
    assert more.returncode == 0, more
    state = ckpt(tmp_path / "single")
    assert state["step"] == 75 and state["optimizer"]["state"]  # the server's momentum came across
    # and the other way: single's checkpoint resumes under ps as under ddp (the same 2 data shards)
    start = tmp_path / "single" / "checkpoints" / "last.pt"
    for strategy in ("ps", "ddp"):
        args = [f"strategy={strategy}", *RESUME, "trainer.max_steps=80", f'trainer.resume="{start}"']
        result = run_here(tmp_path, *args, f"hydra.run.dir=from-single-{strategy}")
        assert result.returncode == 0, result
    assert close(tmp_path / "from-single-ps", tmp_path / "from-single-ddp")
    assert not close(tmp_path / "from-single-ps", tmp_path / "single")  # 5 steps were taken


def test_a_dead_server_stops_the_run_within_seconds_and_is_blamed(tmp_path: Path):
    run = Watched(tmp_path, ["strategy=ps", *LONG], fault="rank0:step12:kill")
    code, _out, err = run.finish()
    assert code == 1, err
    assert err.splitlines()[0].startswith("ddpexp: rank 0 of 3 failed: killed by SIGKILL"), err
    assert run.ranks_seen() == {"0", "1", "2"}
    assert run.ended - run.exit_time_of_rank(0) < 10, "the workers were not stopped promptly"
    run.assert_nothing_left()
    assert metrics(tmp_path / "run")["status"] == "failed"


# ------------------------------------------------------------------ a fast and a slow worker, async

STEPS = 4


def _async_rank(rank: int, tmp: str) -> None:
    """The engine's steps, by hand, on a tiny model with BatchNorm. Rank 2 pushes only once rank 1 has
    finished all its steps: with no collective to hold it back, rank 1 pushes twice per server step."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=3, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    strategy = Ps(PsConfig(mode=ASYNC))
    cpu = SimpleNamespace(device=torch.device("cpu"))
    wrapped = strategy.wrap(model, ctx=cpu, measure_comm=True)
    optimizer = strategy.build_optimizer(wrapped, OptimizerSpec(torch.optim.SGD, {"lr": 0.1}))
    fast_done = Path(tmp) / "fast-done"
    for step in range(STEPS):
        if wrapped.train_step is not None:  # the server
            wrapped.train_step(None, torch.empty(0), 1.0, torch.nn.functional.cross_entropy)
        else:
            torch.manual_seed(rank * 100 + step)
            wrapped.module(torch.randn(8, 4)).square().mean().backward()
            while rank == 2 and not fast_done.exists():
                time.sleep(0.05)
        wrapped.sync_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if rank == 1:
        fast_done.touch()
    staleness = list(wrapped.node.staleness) if rank == 0 else []
    metrics = wrapped.extra_metrics() if wrapped.extra_metrics else {}
    wrapped.sync_buffers()
    torch.save(
        {"state": model.state_dict(), "staleness": staleness, "metrics": metrics}, f"{tmp}/rank{rank}.pt"
    )
    dist.destroy_process_group()


def test_a_fast_worker_pushing_twice_per_step_never_deadlocks_the_async_server(tmp_path: Path):
    # not forked from this process: once it has computed (the in-process runs of other tests), forked
    # ranks hang in their first BatchNorm forward (OpenMP's thread pool does not survive a fork); the
    # forkserver never computes
    start_ranks(_async_rank, (str(tmp_path),), nprocs=3)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    # rank 1 always holds the newest parameters; rank 2's first push comes 4 updates after its pull,
    # its later ones right after their own reply
    assert ranks[0]["staleness"] == [0, 0, 0, 0, 4, 0, 0, 0]
    for r in ranks:  # reduced over the ranks: every rank returns the server's numbers
        assert r["metrics"] == {"ps/staleness_mean": 0.5, "ps/staleness_max": 4.0}
    for r in ranks[1:]:  # after the broadcast every rank holds the server's parameters and buffers
        for name, value in ranks[0]["state"].items():
            assert torch.equal(value, r["state"][name]), name
    assert int(ranks[0]["state"]["1.num_batches_tracked"]) == 2 * STEPS  # every push's forward counted

"""End to end through the command line, the way users run ddpexp (CPU, gloo, 2-3 ranks)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddpexp import models
from ddpexp.data.synthetic import synthetic
from ddpexp.recorder import TAGS
from ddpexp.train import seed_everything

from .conftest import (
    PARITY,
    PARITY_STRATEGIES,
    QUICK,
    STEPS,
    Result,
    metrics,
    run_ddpexp,
    run_here,
    same_weights,
    scalars,
)

pytestmark = pytest.mark.multiproc

FACT_KEYS = {
    "strategy",
    "backend",
    "init_method",
    "world_size",
    "global_batch_size",
    "per_rank_batch_size",
    "device_type",
}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


# ------------------------------------------------------------------------------------ default run


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory):
    cwd = tmp_path_factory.mktemp("default")
    return run_ddpexp(cwd)  # no arguments at all: the README's default experiment


def test_default_run_reaches_95_percent_on_digits(default_run):
    assert default_run.returncode == 0, default_run
    (run_dir,) = default_run.run_dirs()
    m = metrics(run_dir)
    assert m["status"] == "completed"
    assert m["facts"]["data"] == "digits" and m["facts"]["model"] == "convnet"
    assert m["final"]["epoch"] == 10
    assert m["final"]["eval/acc"] >= 0.95
    assert m["final"]["eval/samples"] == m["facts"]["eval_samples"]


def test_the_dataloader_path_trains_bitwise_the_model_the_device_path_trains(tmp_path: Path):
    """The default run's automatic choice on digits is device-resident batching; the DataLoader path
    serves the same batches in the same order, so two epochs of each end in the same weights."""
    for mode in ("device", "dataloader"):
        result = run_here(tmp_path, "trainer.epochs=2", f"loader.mode={mode}", f"hydra.run.dir={mode}")
        assert result.returncode == 0, result
        assert metrics(tmp_path / mode)["facts"]["loader"] == mode
    assert same_weights(tmp_path / "device", tmp_path / "dataloader")


def test_default_run_prints_epoch_summaries_and_the_run_dir(default_run):
    lines = default_run.stdout.splitlines()
    epochs = [ln for ln in lines if re.match(r"epoch \d+/10 ", ln)]
    assert len(epochs) == 10
    for word in ("train_loss", "eval_loss", "eval_acc", "samples/s"):
        assert word in epochs[-1]
    (run_dir,) = default_run.run_dirs()
    assert lines[-1] == f"run dir: {run_dir}"


def test_run_dir_holds_config_metrics_events_and_weights(default_run):
    (run_dir,) = default_run.run_dirs()
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert "${" not in OmegaConf.to_yaml(cfg)  # fully resolved
    assert cfg.trainer.batch_size == 64 and cfg.model._target_.endswith("convnet")
    m = metrics(run_dir)
    assert m["facts"].keys() >= FACT_KEYS
    assert m["facts"]["strategy"] == "single" and m["facts"]["world_size"] == 1
    assert m["best"]["eval/acc"] >= m["final"]["eval/acc"]
    model = models.build(cfg.model, synthetic(shape=[1, 28, 28]).info())
    model.load_state_dict(weights(run_dir))  # plain state dict of the unwrapped model


def test_tensorboard_events_have_documented_tags_per_step(default_run):
    (run_dir,) = default_run.run_dirs()
    s = scalars(run_dir)
    assert set(TAGS) <= s.keys()
    steps_per_epoch = 1438 // 64
    assert [step for step, _ in s["eval/acc"]] == [steps_per_epoch * e for e in range(1, 11)]
    assert s["train/loss"][-1][1] < s["train/loss"][0][1]
    assert all(v > 0 for _, v in s["perf/samples_per_s"])


# ---------------------------------------------------------------------- DDP vs single, sweep naming


def test_sweep_subdirs_are_named_after_the_overrides(parity_sweep: Path):
    names = sorted(p.name for p in parity_sweep.iterdir() if p.is_dir())
    assert names == sorted(f"strategy={s}" for s in PARITY_STRATEGIES)
    facts = metrics(parity_sweep / "strategy=ddp")["facts"]
    assert (facts["world_size"], facts["backend"], facts["per_rank_batch_size"]) == (2, "gloo", 32)
    assert scalars(parity_sweep / "strategy=ddp")["eval/acc"]  # rank 0 wrote the events...
    assert len(list((parity_sweep / "strategy=ddp").glob("events.out.tfevents.*"))) == 1  # ...only rank 0


@pytest.mark.parametrize("strategy", PARITY_STRATEGIES[1:])
def test_every_strategy_matches_single_process_with_the_same_global_batch(parity_sweep: Path, strategy: str):
    single = weights(parity_sweep / "strategy=single")
    ddp = weights(parity_sweep / f"strategy={strategy}")
    for m in (metrics(parity_sweep / "strategy=single"), metrics(parity_sweep / f"strategy={strategy}")):
        assert m["final"]["step"] == STEPS
        assert m["facts"]["global_batch_size"] == 64
    cfg = OmegaConf.load(parity_sweep / "strategy=single" / "config.yaml")
    seed_everything(cfg.seed)
    initial = models.build(cfg.model, instantiate(cfg.data).info()).state_dict()
    assert single.keys() == ddp.keys()
    for name in single:
        moved = (single[name] - initial[name]).abs().max().item()
        assert moved > 1e-4, f"{name} did not train"
        torch.testing.assert_close(ddp[name], single[name], rtol=1e-5, atol=1e-6)


def test_strategy_facts(parity_sweep: Path):
    facts = {s: metrics(parity_sweep / f"strategy={s}")["facts"] for s in PARITY_STRATEGIES}
    assert facts["dp"]["replicas"] == 1 and facts["dp"]["world_size"] == 1  # no GPU: one CPU replica
    assert facts["ddp_mp"]["devices_per_process"] == 2 and facts["ddp_mp"]["world_size"] == 2
    assert facts["naive_allreduce"]["replicas"] == 2 and facts["naive_allreduce"]["backend"] == "gloo"
    assert facts["single"]["backend"] is None
    # Fair use of the cores: processes on the host x threads per process never exceed the cores.
    cpus = facts["single"]["host_cpus"]
    assert facts["single"]["threads"] == cpus and facts["ddp"]["threads"] == max(1, cpus // 2)
    for f in facts.values():
        assert f["job_started_at"] <= f["job_ended_at"] and f["load_avg_start"] is not None
        assert f["load_avg_end"] is not None


def test_every_contender_gets_one_cpu_share_and_openmp_threads_that_sleep_while_waiting(parity_sweep: Path):
    """On a busy host each strategy gets what a one-process run gets: the ranks stay in the command's
    session (the autogroup scheduler's unit of CPU share), and no OpenMP thread spins on a core its
    sibling needs. (single and dp ran in this process, whose policy conftest set as the command line
    does: the next test runs one from the command line itself.)"""
    for strategy in PARITY_STRATEGIES:
        facts = metrics(parity_sweep / f"strategy={strategy}")["facts"]
        assert facts["sessions"] == 1, strategy
        if facts["world_size"] > 1:
            assert facts["wait_policy"] == "passive", strategy
        assert facts["autogroup"] in (True, False, None)


def test_init_and_start_methods_train_to_the_same_parameters_as_env(parity_sweep: Path, tmp_path: Path):
    """tcp:// and file:// rendezvous, with workers started as fresh interpreters (spawn) instead of
    forked from the forkserver, train exactly as parity_sweep's env:// forkserver run."""
    spawned = ["strategy=ddp", "init=tcp,file", "dist.start_method=spawn"]
    result = run_here(tmp_path, "-m", *spawned, *PARITY, "hydra.sweep.dir=s")
    assert result.returncode == 0, result
    assert metrics(parity_sweep / "strategy=ddp")["facts"]["start_method"] == "forkserver"
    env = weights(parity_sweep / "strategy=ddp")
    for init in ("tcp", "file"):
        run_dir = tmp_path / "s" / f"init={init}"
        assert metrics(run_dir)["facts"]["init_method"] == init
        assert metrics(run_dir)["facts"]["start_method"] == "spawn"
        for name, value in weights(run_dir).items():
            assert torch.equal(value, env[name]), (init, name)
    assert not (tmp_path / "s" / "init=file" / "rendezvous").exists()  # removed at the end


def test_torchrun_matches_self_launch_with_one_run_dir(parity_sweep: Path, tmp_path: Path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"]
    _assert_one_run_like_self_launch(
        run_ddpexp(tmp_path, "strategy=ddp", *PARITY, launcher=torchrun), parity_sweep
    )


def _assert_one_run_like_self_launch(result, parity_sweep: Path) -> None:
    """A run started by an external launcher: one run dir, and exactly parity_sweep's self-launched ddp."""
    assert result.returncode == 0, result
    (run_dir,) = result.run_dirs()
    assert list((result.cwd / "outputs").glob("*/*")) == [run_dir]
    facts = metrics(run_dir)["facts"]
    assert facts["launcher"] == "torchrun" and facts["world_size"] == 2
    assert facts["sessions"] == 2  # torchrun starts each worker in a session of its own: the report warns
    self_launched = weights(parity_sweep / "strategy=ddp")
    for name, value in weights(run_dir).items():
        assert torch.equal(value, self_launched[name]), name
    ours = metrics(run_dir)["final"]
    theirs = metrics(parity_sweep / "strategy=ddp")["final"]
    assert ours["eval/loss"] == theirs["eval/loss"] and ours["train/epoch_loss"] == theirs["train/epoch_loss"]


@pytest.mark.parametrize("use_env", [False, True], ids=["--local-rank", "--use-env"])
def test_torch_distributed_launch_matches_self_launch_with_one_run_dir(
    parity_sweep: Path, tmp_path: Path, use_env: bool
):
    """The deprecated launcher of the older tutorials: it passes --local-rank=N to every worker (or,
    with --use-env, only sets LOCAL_RANK as torchrun does)."""
    from ddpexp.launch.rendezvous import free_port

    launch = [
        sys.executable,
        *("-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port('127.0.0.1')}"),
        *(["--use-env"] if use_env else []),
        "-m",
    ]
    _assert_one_run_like_self_launch(
        run_ddpexp(tmp_path, "strategy=ddp", *PARITY, launcher=launch), parity_sweep
    )


# ------------------------------------------------------------------------------------- exact eval

EVAL = [*QUICK, "data.num_eval=511", "trainer.max_steps=0", "trainer.batch_size=60"]


@pytest.fixture(scope="module")
def eval_single(tmp_path_factory: pytest.TempPathFactory):
    result = run_here(tmp_path_factory.mktemp("eval1"), *EVAL)
    assert result.returncode == 0, result
    (run_dir,) = result.run_dirs()
    return metrics(run_dir)["final"]


@pytest.mark.parametrize("nprocs", [2, 3])
def test_exact_eval_when_eval_set_is_not_divisible_by_world_size(eval_single, nprocs: int, tmp_path: Path):
    assert 511 % nprocs != 0
    result = run_here(tmp_path, "strategy=ddp", f"dist.nprocs={nprocs}", *EVAL)
    assert result.returncode == 0, result
    (run_dir,) = result.run_dirs()
    ddp = metrics(run_dir)["final"]
    assert ddp["eval/samples"] == eval_single["eval/samples"] == 511
    assert ddp["eval/acc"] == eval_single["eval/acc"]
    # Each sample scored once: one counted twice or left out moves the mean by ~1/511. Not bitwise: on
    # some CPUs (AMX) a matrix product rounds by its batch's size and its threads (rel 4e-9 seen).
    assert math.isclose(ddp["eval/loss"], eval_single["eval/loss"], rel_tol=1e-7)


# ----------------------------------------------------------------------------- two nodes, torchrun


def test_two_torchrun_nodes_on_localhost_make_one_run(parity_sweep: Path, tmp_path: Path):
    from ddpexp.launch.rendezvous import free_port

    port = free_port("127.0.0.1")

    def node(rank: int) -> list[str]:
        return [
            sys.executable,
            *("-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1"),
            *("--master_addr=127.0.0.1", f"--master_port={port}", "-m"),
        ]

    _two_nodes(
        tmp_path,
        parity_sweep,
        [*node(0), "ddpexp", "strategy=ddp", *PARITY],
        [*node(1), "ddpexp", "strategy=ddp", *PARITY],
    )


def _two_nodes(tmp_path: Path, parity_sweep: Path, first: list[str], second: list[str]) -> tuple[Path, str]:
    """Start node 1's command in the background, run node 0's, and check what every two-node run must
    give: both exit 0, one run directory (node 0's; node 1 writes nothing where it runs), world size 2
    over 2 nodes, and parity_sweep's 1-node ddp weights (close, not equal: a rank alone on its "node"
    gets all the cores). Returns node 0's run directory and node 1's output."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    joining = subprocess.Popen(
        second, cwd=node1, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        leading = subprocess.run(first, cwd=node0, env=env, capture_output=True, text=True, timeout=240)
        out1, _ = joining.communicate(timeout=120)
    finally:
        joining.kill()
    result = Result(leading.returncode, leading.stdout, leading.stderr, node0)
    assert result.returncode == 0, result
    assert joining.returncode == 0, out1
    (run_dir,) = result.run_dirs()
    assert list(node1.iterdir()) == []
    facts = metrics(run_dir)["facts"]
    assert (facts["world_size"], facts["nnodes"], facts["nprocs_per_node"]) == (2, 2, 1)
    reference = weights(parity_sweep / "strategy=ddp")
    for name, value in weights(run_dir).items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)
    return run_dir, out1


# ------------------------------------------------------------------------ two nodes, self-launched


def test_two_self_launched_nodes_on_localhost_make_one_run(parity_sweep: Path, tmp_path: Path):
    """Tutorials 002/004: the same command on every machine, each with its dist.node_rank. Node 0 makes
    the run directory; node 1 joins it (a shared filesystem, here the same disk). init=env; tcp and
    file differ only in the URL the workers get (each case costs ~15 s more, so they are not here)."""
    from ddpexp.launch.rendezvous import free_port, port_is_free

    port = free_port("127.0.0.1")
    while not port_is_free("127.0.0.1", port + 1):  # node 0's launcher hands the job over on port + 1
        port = free_port("127.0.0.1")
    common = ["strategy=ddp", "dist.nprocs=1", "dist.nnodes=2", f"dist.master_port={port}", *PARITY]
    ddpexp = [sys.executable, "-m", "ddpexp"]
    run_dir, out1 = _two_nodes(
        tmp_path, parity_sweep, [*ddpexp, *common, "dist.node_rank=0"], [*ddpexp, *common, "dist.node_rank=1"]
    )
    assert f"run dir: {run_dir}" in out1  # node 1 names the run directory it joined
    assert (run_dir / "logs" / "rank0.log").exists() and (run_dir / "logs" / "rank1.log").exists()


def test_a_node_that_never_meets_node_0_says_where_it_waited(tmp_path: Path):
    from ddpexp.launch.rendezvous import free_port

    port = free_port("127.0.0.1")
    nodes = ["strategy=ddp", "dist.nprocs=1", "dist.nnodes=2", "dist.node_rank=1", f"dist.master_port={port}"]
    result = run_here(tmp_path, *nodes, "dist.timeout_s=1", *QUICK)
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert f"127.0.0.1:{port + 1}" in line and "dist.node_rank=0" in line and "dist.timeout_s=1" in line
    assert list(tmp_path.iterdir()) == []  # no run directory of its own


def test_a_one_process_run_from_the_command_line_has_openmp_threads_that_sleep_while_waiting(
    tmp_path: Path, monkeypatch
):
    """OpenMP reads its wait policy once, as torch loads: the command line sets it first, so a `single`
    run's threads do not spin on the core the other thread needs while anything else runs."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # an in-process run of this session set it
    result = run_ddpexp(tmp_path, "strategy=single", *QUICK, "trainer.max_steps=2", "hydra.run.dir=run")
    assert result.returncode == 0, result
    assert metrics(tmp_path / "run")["facts"]["wait_policy"] == "passive"


@pytest.mark.parametrize("first", ["", "import torch\n"], ids=["ddpexp-first", "torch-first"])
def test_a_run_from_python_gets_the_threads_the_command_line_gives(tmp_path: Path, monkeypatch, first: str):
    """A plain script's ddpexp.run, and one that imported torch before ddpexp (whose OpenMP threads
    already spin, as a notebook's do): the run's threads sleep while they wait, as from the command
    line, the second by running in a worker of its own rather than in the script's process."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    script = first + (
        "import ddpexp\n"
        f"r = ddpexp.run({[*QUICK, 'trainer.max_steps=2', 'hydra.run.dir=run']!r})\n"
        "print(r.status, r.facts['wait_policy'], r.facts['launcher'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    launcher = "spawn" if first else "inprocess"
    assert done.stdout.split()[-3:] == ["completed", "passive", launcher], done.stdout


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}])
def test_a_wait_policy_of_your_own_is_kept(monkeypatch, env: dict[str, str]):
    from ddpexp import host

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(host, "_policy_loaded", None)
    monkeypatch.delitem(sys.modules, "torch")  # as the command line finds it: torch not loaded yet
    host.quiet_waits()
    assert os.environ.get("OMP_WAIT_POLICY") == env.get("OMP_WAIT_POLICY")  # not made PASSIVE
    assert host.wait_policy() == ("active" if "OMP_WAIT_POLICY" in env else "spin 1000")


def test_the_rendezvous_port_is_picked_below_the_kernel_s_ephemeral_range(tmp_path: Path, monkeypatch):
    """The kernel hands ports of its ephemeral range to outgoing connections (gloo's, between ranks of
    a run beside this one), so a port found free there could be taken before rank 0 listened on it:
    EADDRINUSE in CI. Below the range only an explicit bind takes one. Unknown range: the kernel's."""
    from ddpexp.launch import rendezvous

    low = rendezvous._ephemeral_low()
    if low is not None and low > 2048:
        for _ in range(20):
            port = rendezvous.free_port("127.0.0.1")
            assert low // 2 <= port < low and rendezvous.port_is_free("127.0.0.1", port)
    (tmp_path / "range").write_text("40000\t60999\n")
    monkeypatch.setattr(rendezvous, "EPHEMERAL_RANGE", tmp_path / "range")
    assert 20000 <= rendezvous.free_port("127.0.0.1") < 40000
    monkeypatch.setattr(rendezvous, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert rendezvous.port_is_free("127.0.0.1", rendezvous.free_port("127.0.0.1"))

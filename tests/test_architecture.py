"""The architecture as a user meets it: a strategy added from outside the package, the in-process
API (`ddpexp.run`, `ddpexp.sweep`, `ddpexp.load_model`), an optimising sweeper, per-job clocks, and
mypy checking strategies against their contract."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ddpexp
from ddpexp import host

from .conftest import PARITY, QUICK, REPO, metrics, run_here

TEST_CONF = str(REPO / "tests" / "conf")


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> ddpexp.Result:
    """The composition root end to end in this process: ddpexp.run, strategy=single, synthetic data."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    return ddpexp.run([*PARITY, f"hydra.run.dir={run_dir}"])  # PARITY: as parity_sweep's, in this process


def test_run_returns_the_result_of_a_job_run_in_this_process(single_run: ddpexp.Result):
    assert single_run.exit_code == 0 and single_run.status == "completed"
    assert single_run.final["step"] == 5 and single_run.facts["strategy"] == "single"
    assert single_run.best_value == single_run.best["eval/acc"]
    assert (single_run.run_dir / "model.pt").exists() and (single_run.run_dir / "config.yaml").exists()


def test_threads_per_process_are_a_fair_share_of_the_cores_unless_set():
    from ddpexp.context import intra_op_threads

    cpus = host.cpus()
    assert intra_op_threads(None, 1, {}) == cpus
    assert intra_op_threads(None, 2 * cpus, {}) == 1  # never 0
    assert intra_op_threads(None, 2, {}) == max(1, cpus // 2)
    assert intra_op_threads(None, 2, {"OMP_NUM_THREADS": "3"}) == 3  # the user's environment
    assert intra_op_threads(5, 2, {"OMP_NUM_THREADS": "3"}) == 5  # trainer.threads wins


def test_an_in_process_run_uses_trainer_threads_and_gives_the_process_its_threads_back(tmp_path: Path):
    before = torch.get_num_threads()
    result = ddpexp.run([*PARITY, "trainer.threads=3", f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.facts["threads"] == 3 and result.facts["host_cpus"] == host.cpus()
    assert result.facts["machine"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert torch.get_num_threads() == before


def test_load_model_gives_the_trained_plain_module(single_run: ddpexp.Result):
    from ddpexp.data.synthetic import synthetic

    model = ddpexp.load_model(single_run.run_dir)
    assert isinstance(model, torch.nn.Module) and not model.training
    for name, value in model.state_dict().items():
        assert torch.equal(value, _weights(single_run.run_dir)[name])
    x, y = synthetic().load(Path(".")).eval.tensors  # type: ignore[misc]
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).double().mean().item()
    assert accuracy == pytest.approx(single_run.final["eval/acc"], abs=1e-12)
    from_checkpoint = ddpexp.load_model(single_run.run_dir / "checkpoints" / "last.pt")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in from_checkpoint.state_dict().items())


def _run_script(path: Path, text: str) -> str:
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, str(path)], cwd=path.parent, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.multiproc
def test_a_plain_script_runs_multi_process_strategies_through_the_api(tmp_path: Path):
    """The README's API example as a user saves it in a file: top-level calls, no `if __name__ ==
    "__main__":` guard. The workers are ddpexp's own program, so they must not run the script again
    (multiprocessing re-runs the parent's __main__ file in forkserver and spawn children; the
    stand-in that prevents it serves both start methods alike, so the default, forkserver, is run). A
    model defined in the script itself (`__main__.Net`) still reaches the workers, from a script with
    the guard that multiprocessing asks for."""
    plain = _run_script(
        tmp_path / "experiment.py",
        "import ddpexp\n"
        f"result = ddpexp.run(['strategy=ddp', *{PARITY!r}])\n"
        "print('status', result.status, result.final.get('step'))\n",
    )
    assert "status completed 5" in plain, plain
    own_model = _run_script(
        tmp_path / "own_model.py",
        "from torch import nn\n"
        "import ddpexp\n\n"
        "class Net(nn.Sequential):\n"
        "    def __init__(self, num_classes: int = 10):\n"
        "        super().__init__(nn.Flatten(), nn.Linear(28 * 28, num_classes))\n\n"
        "if __name__ == '__main__':\n"
        f"    result = ddpexp.run(['strategy=ddp', *{PARITY!r}, 'model._target_=__main__.Net'])\n"
        "    print('status', result.status, result.final.get('step'))\n",
    )
    assert "status completed 5" in own_model, own_model


def test_bad_input_raises_a_user_error_instead_of_exiting(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ddpexp.UserError, match=r"trainer\.epochs"):
        ddpexp.run(["trainer.epochs=0"])
    for bad, setting in [("trainer.accumulate=0", "trainer.accumulate"), ("optim.lr=nan", "optim.lr")]:
        with pytest.raises(ddpexp.UserError, match=setting.replace(".", r"\.")):
            ddpexp.run([bad, "strategy=ddp"])
    with pytest.raises(ddpexp.UserError, match=r"optim\.momentum"):
        ddpexp.run(["strategy=ddp", "optim.momentum=-1"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiproc
def test_a_strategy_added_from_tests_trains_through_the_cli(single_run: ddpexp.Result, tmp_path, monkeypatch):
    """tests/tiny_strategy.py registers `tiny` and tests/conf/strategy/tiny.yaml selects it: the package
    is unchanged. Through the command line it trains on 2 processes (which import the module
    themselves) to single's weights at the same global batch; its own setting reaches it (average=false
    sums the gradients, and training then differs); the report shows the column it declares for a
    scalar of its own; a setting it does not have is refused."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the workers find tests.tiny_strategy as a user's would
    args = ["--config-dir", TEST_CONF, "-m", "strategy=tiny", "strategy.average=true,false", *PARITY]
    result = run_here(tmp_path, *args, "hydra.sweep.dir=s")
    assert result.returncode == 0, result
    averaged, summed = tmp_path / "s" / "strategy.average=True", tmp_path / "s" / "strategy.average=False"
    assert metrics(averaged)["facts"]["world_size"] == 2 and metrics(averaged)["facts"]["strategy"] == "tiny"
    reference = _weights(single_run.run_dir)
    for name, value in _weights(averaged).items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)
    assert not all(torch.allclose(v, reference[k], atol=1e-4) for k, v in _weights(summed).items())
    norm = metrics(averaged)["final"]["tiny/grad_norm"]
    report = subprocess.run(
        [str(Path(sys.executable).parent / "ddpexp-report"), str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    table = (tmp_path / "s" / "report.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| run |")).strip("| ").split(" | ")
    row = next(line for line in table.splitlines() if line.startswith("| strategy.average=True |"))
    assert dict(zip(header, row.strip("| ").split(" | "), strict=True))["tiny: grad norm"] == f"{norm:.4f}"
    for extra in ("strategy.stages=2", "+strategy.stages=2"):  # at composition, and after forcing it in
        refused = run_here(tmp_path, "--config-dir", TEST_CONF, "strategy=tiny", extra)
        assert refused.returncode == 2 and "strategy.stages" in refused.stderr, refused
    assert "Key 'stages' not in 'TinyConfig'" in refused.stderr


def test_an_optimising_sweeper_gets_each_job_s_best_metric(tmp_path: Path, monkeypatch, capfd):
    """Optuna picks optim.lr from an interval (which the basic sweeper cannot expand); each trial's
    task returns its best eval accuracy, and the study's best value is the best of the trials. The
    sweep prints none of the INFO lines alembic (imported by optuna's storage) logs as it loads."""
    import yaml

    monkeypatch.chdir(tmp_path)
    results = ddpexp.sweep(
        [
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.direction=maximize",
            "optim.lr=interval(0.001,0.1)",
            "trainer.epochs=1",
            "trainer.progress=false",
            "hydra.sweep.dir=sweep",
        ]
    )
    assert [r.status for r in results] == ["completed", "completed"]
    lrs = [r.facts["lr"] for r in results]
    assert len(set(lrs)) == 2 and all(0.001 <= lr <= 0.1 for lr in lrs)
    study = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert study["best_value"] == max(r.best_value for r in results)  # type: ignore[type-var]
    printed = capfd.readouterr()
    assert "alembic" not in printed.out + printed.err, printed.out


def test_each_job_of_a_sweep_starts_its_own_clock(tmp_path: Path, monkeypatch):
    """time_to_first_step_s counts from the job's start, not the sweep's: job k's clock starts after
    job k-1 ended, and every job's time to first step is its own start-up only."""
    monkeypatch.chdir(tmp_path)
    results = ddpexp.sweep([*QUICK, "trainer.max_steps=1", "seed=0,1,2", "hydra.sweep.dir=sweep"])
    starts = [r.facts["job_started_at"] for r in results]
    ends = [metrics(r.run_dir)["started_at"] + metrics(r.run_dir)["wall_s"] for r in results]
    assert all(later >= end for later, end in zip(starts[1:], ends[:-1], strict=True)), (starts, ends)
    for start, end, r in zip(starts, ends, results, strict=True):
        assert 0 < metrics(r.run_dir)["time_to_first_step_s"] < end - start  # within its own job


def test_the_first_job_of_a_sweep_is_timed_like_the_others(tmp_path: Path, monkeypatch):
    """Job 0's clock starts when it starts, as every later job's does: after the command's start-up
    (imports, pre-flight of every job) and after what the jobs share is ready (launch/warmup.finish:
    the workers' forkserver done importing, training's modules imported for jobs run in this process).
    Before, job 0 counted from the command's start and carried all of it: a sweep's first `single`
    took 5.8 s to its first step and a repeat of it 0.1 s, and the report compared the two as the
    strategy's. When the command started is kept (facts.command_started_at)."""
    from ddpexp import preflight
    from ddpexp.launch import warmup

    moments: dict[str, float] = {}
    checked, finished = preflight.preflight, warmup.finish

    def timed_preflight(*args, **kwargs):
        out = checked(*args, **kwargs)
        moments["pre-flight done"] = time.time()
        return out

    def timed_finish():
        finished()
        moments.setdefault("warm", time.time())

    monkeypatch.setattr(preflight, "preflight", timed_preflight)
    monkeypatch.setattr(warmup, "finish", timed_finish)
    monkeypatch.chdir(tmp_path)
    before = time.time()
    results = ddpexp.sweep([*QUICK, "trainer.max_steps=1", "strategy=single,ddp", "hydra.sweep.dir=sweep"])
    assert [r.status for r in results] == ["completed", "completed"]
    for r in results:
        command, job = r.facts["command_started_at"], r.facts["job_started_at"]
        assert before <= command < moments["pre-flight done"] <= moments["warm"] <= job, (moments, r.facts)


@pytest.mark.multiproc
def test_finish_waits_for_the_forkserver_s_imports_and_imports_what_in_process_jobs_need():
    """What launch/warmup.finish promises the first job: the forkserver has imported torch (its
    libtorch is mapped) and this process has imported the modules training loads on first use."""
    code = (
        "import sys\n"
        "from ddpexp.launch import warmup\n"
        "warmup.settle('forkserver', in_process=True)\n"
        "warmup.finish()\n"
        "server = warmup._server()._forkserver_pid\n"
        "maps = open(f'/proc/{server}/maps').read()\n"
        "print('libtorch_cpu' in maps, all(m in sys.modules for m in warmup.PRELOAD))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"], proc.stdout + proc.stderr


def test_mypy_checks_strategies_against_the_contract(tmp_path: Path):
    """A strategy whose wrap() takes the wrong settings type, or misses `ctx`, fails the type check."""
    bad = tmp_path / "bad_strategy.py"
    bad.write_text(
        "from dataclasses import dataclass\n"
        "from torch import nn\n"
        "from ddpexp.config import StrategyConfig\n"
        "from ddpexp.strategies import Strategy, Wrapped, register\n"
        "from ddpexp.strategies.ddp import DdpConfig\n\n"
        "@dataclass\nclass BadConfig(StrategyConfig):\n    name: str = 'bad'\n\n"
        "@register\nclass Bad(Strategy[BadConfig]):\n    name = 'bad'\n    schema = BadConfig\n\n"
        "    def wrap(self, model: nn.Module, settings: DdpConfig, *, measure_comm: bool) -> Wrapped:\n"
        "        return Wrapped(module=model, base=model)\n"
    )
    # The contract is ddpexp's own types: the third-party packages are skipped (Any), which takes the
    # check from ~20 s of CPU (loading torch's types) to ~1 s.
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\nignore_missing_imports = True\nfollow_imports = silent\n"
        "[mypy-torch.*,torchvision.*,hydra.*,omegaconf.*,numpy.*,sklearn.*]\nfollow_imports = skip\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", f"--config-file={config}", "--cache-dir=/dev/null", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "MYPYPATH": str(REPO)},
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout
    assert 'Signature of "wrap" incompatible with supertype "ddpexp.strategies.Strategy"' in proc.stdout

"""The command line as a user meets it: help, --cfg, and one-line refusals that start nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import REPO, run_ddpexp

REFUSALS = [
    # (overrides, words the one-line error must contain)
    (["strategy=ddp", "trainer.batch_size=65"], ["trainer.batch_size", "65", "2"]),
    (["model=resnet99"], ["resnet99", "convnet", "mlp"]),
    (["trainer.epoch=3"], ["trainer.epoch"]),
    (["trainer.batch_size=big"], ["batch_size", "big"]),
    (["strategy=ddp", "backend=nccl"], ["nccl", "backend=gloo"]),
    (["optim.lr=-1"], ["optim.lr"]),
    (["strategy=ddp,single"], ["-m"]),
    (["-m", "strategy=ddp", "trainer.batch_size=64,65"], ["trainer.batch_size", "65"]),
    (["strategy=ddp", "backend=mpi"], ["MPI", "backend=gloo"]),
    (["strategy=ddp", "backend=tcp"], ["backend", "cpu:gloo,cuda:nccl"]),
    (["strategy.sync_bn=true"], ["strategy.sync_bn", "strategy=ddp"]),
    (["strategy=dp", "strategy.sync_bn=true"], ["strategy.sync_bn", "dp"]),
    (["-m", "strategy=single,ddp", "strategy.sync_bn=true"], ["strategy.sync_bn"]),
    (["strategy=ddp_mp", "strategy.stages=3", "model=mlp"], ["strategy.stages", "at most 2"]),
    (
        ["strategy=ddp_mp", "model=mlp", "~model.hidden", "model._target_=tests.user_models.unsplittable"],
        ["stages()", "strategy=ddp"],
    ),
    (["strategy=dp", "strategy.device_ids=[0,1]"], ["strategy.device_ids", "CPU"]),
    (["strategy=ddp", "strategy.device_ids=[0]"], ["strategy.device_ids", "strategy=dp"]),
    (["strategy=ddp", "device=cuda"], ["device", "device=cpu"]),
    (["-m", "hydra/launcher=slurm", "hydra.launcher.nodes=2"], ["hydra.launcher.nodes", "torchrun"]),
    (["strategy=ddp", "init=bogus"], ["init", "bogus"]),
    (
        ["strategy=ddp", "data=mnist", "data.root=/nonexistent"],
        ["/nonexistent", "data.download=true", "data=digits"],
    ),
    (["strategy=ddp", "data=imdb", "data.root=/nonexistent"], ["aclImdb", "data=digits"]),
    (["model=gcnn"], ["token ids", "data=imdb"]),
    (["trainer.precision=fp16"], ["trainer.precision", "CUDA", "bf16"]),
    (["trainer.mode=eval"], ["trainer.resume"]),
    (["strategy=ddp", "trainer.accumulate=3"], ["trainer.batch_size", "accumulated", "66"]),
    (["optim.schedule=linear"], ["optim.schedule", "cosine"]),
    (["strategy=dp", "strategy.static_graph=true"], ["strategy.static_graph", "strategy=ddp"]),
    (["strategy.bucket_cap_mb=5"], ["strategy.bucket_cap_mb", "naive_allreduce"]),
    (["-m", "data=mnist,cifar10", "data.root=/x"], ["data.root", "++data.root"]),
]


@pytest.mark.parametrize(("args", "words"), REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_bad_input_is_refused_in_one_line_before_anything_starts(tmp_path: Path, args, words):
    result = run_ddpexp(tmp_path, *args, timeout=120, env={"PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpexp: error: "), result
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no run or sweep directory, nothing launched


def test_a_run_never_reuses_a_directory_that_holds_results(tmp_path: Path):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text('{"status": "completed"}')
    result = run_ddpexp(tmp_path, f"hydra.run.dir={run_dir}", timeout=120)
    assert result.returncode == 2, result
    assert "already holds a run" in result.stderr
    assert (run_dir / "metrics.json").read_text() == '{"status": "completed"}'
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.json"]


def test_a_stale_rendezvous_file_is_refused(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory):
    stale = tmp_path_factory.mktemp("shared") / "rdzv"
    stale.write_text("")
    result = run_ddpexp(tmp_path, "strategy=ddp", "init=file", f"dist.init_file={stale}", timeout=120)
    assert result.returncode == 2, result
    assert "dist.init_file" in result.stderr and "already exists" in result.stderr
    assert list(tmp_path.iterdir()) == [] and stale.exists()


def test_help_lists_config_groups_with_one_line_each(tmp_path: Path):
    result = run_ddpexp(tmp_path, "--help", timeout=120)
    assert result.returncode == 0, result
    for line in ("strategy", "single", "ddp", "model", "convnet", "data", "digits", "synthetic", "optim"):
        assert line in result.stdout
    assert "trainer.batch_size" in result.stdout


def test_cfg_job_prints_the_composed_config(tmp_path: Path):
    result = run_ddpexp(tmp_path, "--cfg", "job", "strategy=ddp", timeout=120)
    assert result.returncode == 0, result
    assert "name: ddp" in result.stdout and "batch_size: 64" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_console_script_is_installed():
    import shutil
    import sys

    script = Path(sys.executable).parent / "ddpexp"
    assert script.exists() or shutil.which("ddpexp")

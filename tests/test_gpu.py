"""CUDA/NCCL paths. They need GPUs and are skipped (with the reason) on machines without them, CI
included; run `pytest -m gpu` on a GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import QUICK, metrics, run_ddpexp

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]
needs_1 = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
needs_2 = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
STEPS = [*QUICK, "trainer.max_steps=5", "trainer.batch_size=64", "checkpoint.every_epochs=null"]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def _close(a: Path, b: Path, tol: float = 1e-4) -> None:
    wa, wb = _weights(a), _weights(b)
    for name in wa:
        torch.testing.assert_close(wb[name].float(), wa[name].float(), rtol=tol, atol=tol)


@needs_2
@pytest.mark.parametrize("strategy", ["ddp", "dp", "naive_allreduce", "ddp_mp"])
def test_gpu_strategies_match_single_gpu(strategy: str, tmp_path: Path):
    procs = ["dist.nprocs=1"] if strategy == "ddp_mp" else ["dist.nprocs=2"] if strategy != "dp" else []
    single = run_ddpexp(tmp_path, "strategy=single", *STEPS, "hydra.run.dir=single")
    other = run_ddpexp(tmp_path, f"strategy={strategy}", *procs, *STEPS, "hydra.run.dir=other")
    assert single.returncode == 0 and other.returncode == 0, (single, other)
    facts = metrics(tmp_path / "other")["facts"]
    assert facts["device_type"] == "cuda"
    if strategy != "dp":
        assert facts["backend"] == "nccl"
    _close(tmp_path / "single", tmp_path / "other")


@needs_2
def test_torch_sync_batchnorm_matches_single_gpu_batchnorm(tmp_path: Path):
    bn = ["model=convnet", "data=synthetic", "trainer.progress=false", *STEPS[3:]]
    single = run_ddpexp(tmp_path, *bn, "hydra.run.dir=single")
    ddp = run_ddpexp(
        tmp_path, "strategy=ddp", "dist.nprocs=2", "strategy.sync_bn=true", *bn, "hydra.run.dir=ddp"
    )
    assert single.returncode == 0 and ddp.returncode == 0, (single, ddp)
    _close(tmp_path / "single", tmp_path / "ddp")


@needs_1
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_on_gpu(precision: str, tmp_path: Path):
    result = run_ddpexp(tmp_path, *STEPS, f"trainer.precision={precision}", "trainer.channels_last=true")
    assert result.returncode == 0, result
    (run_dir,) = result.run_dirs()
    assert metrics(run_dir)["facts"]["precision"] == precision

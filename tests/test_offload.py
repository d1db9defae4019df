"""FSDP CPU offload (strategy.offload=true, FSDP2's CPUOffloadPolicy) under fsdp (nd's, with tensor
parallelism, is one of test_nd's meshes; its memory is a case of test_memory_model's): it trains what
single trains, its checkpoints resume elsewhere, the copies it makes between host and device are
counted as predicted, and what it keeps in host memory is measured (mem/host_mb) as predicted. On this
host device and host memory are one, so the copies move nothing: what is proved is that the code path a
GPU run takes (the optimizer stepping on host-side shards, each shard copied before its all-gather and
each reduced gradient shard after its reduce-scatter) trains the same model."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpexp.predict import MeasuredRun
from ddpexp.predict.memory import predict_run
from ddpexp.predict.model import predicted_bytes
from ddpexp.runrecord import read_run_record

from .conftest import PARITY, RESUME, assert_close_weights, metrics, run_here

pytestmark = pytest.mark.multiproc

GPT = ["model=gpt_tiny", "data=python_stdlib", "task=lm", "optim=adamw", "trainer.progress=false"]


def test_fsdp_offload_trains_like_single_and_counts_what_it_keeps_and_copies(
    parity_sweep: Path, tmp_path: Path
):
    single = parity_sweep / "strategy=single"
    for name, extra in (("offload", []), ("offload_acc", ["trainer.accumulate=2"]), ("plain", [])):
        offload = [] if name == "plain" else ["strategy.offload=true"]
        result = run_here(tmp_path, "strategy=fsdp", *offload, *PARITY, *extra, f"hydra.run.dir={name}")
        assert result.returncode == 0, result
    for name in ("offload", "offload_acc"):
        assert_close_weights(tmp_path / name, single)
        assert metrics(tmp_path / name)["final"]["eval/loss"] == pytest.approx(
            metrics(single)["final"]["eval/loss"], rel=1e-5
        )
    ours, plain = metrics(tmp_path / "offload"), metrics(tmp_path / "plain")
    # Every parameter shard, its gradient and its momentum live on the host; the network moves the same.
    for rank in ours["memory_per_rank"]:
        states = rank["mem/params_mb"] + rank["mem/grads_mb"] + rank["mem/optim_state_mb"]
        assert rank["mem/host_mb"] == pytest.approx(states) and states > 0
    assert all(rank["mem/host_mb"] == 0 for rank in plain["memory_per_rank"])
    assert ours["final"]["comm/bytes_per_step"] == plain["final"]["comm/bytes_per_step"]
    assert "comm/bytes_per_step/offload" not in plain["final"]
    for name in ("offload", "offload_acc"):
        copied = metrics(tmp_path / name)["final"]["comm/bytes_per_step/offload"]
        assert copied == pytest.approx(_predicted_offload(tmp_path / name)) and copied > 0
        assert metrics(tmp_path / name)["final"]["comm/bytes_per_step"] == pytest.approx(
            predicted_bytes(tmp_path / name)
        )
    _memory_as_predicted(tmp_path / "offload")


def _predicted_offload(run: Path) -> float:
    return predicted_bytes(run, offload=True)


def _memory_as_predicted(run: Path) -> None:
    """Every rank's categories, host memory among them, as the memory model predicts (exact on CPU);
    the device's peak leaves out what lives on the host."""
    record = read_run_record(run)
    assert record is not None
    predicted = predict_run(MeasuredRun.of_record(record))
    for mine, measured in zip(predicted, record.memory_per_rank, strict=True):
        for key, value in mine.mb().items():
            assert value == pytest.approx(float(measured[key]), rel=0.01, abs=1e-3), key
        assert mine.host > 0 and mine.peak < mine.host + mine.activations + mine.transient + mine.buffers


def test_an_offloaded_checkpoint_resumes_under_single_and_under_fsdp_without_offload(
    uninterrupted, tmp_path: Path
):
    """Offload changes where the states live, not what is saved: its checkpoint at step 64 continues
    under single and under plain fsdp to the uninterrupted ddp run's result, and ddp's checkpoint
    continues under offload to the same."""
    reference = uninterrupted("ddp")
    first = ["strategy=fsdp", "strategy.offload=true", *RESUME, "trainer.max_steps=64", "hydra.run.dir=off"]
    assert (result := run_here(tmp_path, *first)).returncode == 0, result
    start = tmp_path / "off" / "checkpoints" / "step-00000064.pt"
    for name, args in (("single", ["strategy=single"]), ("fsdp", ["strategy=fsdp"])):
        more = [*args, *RESUME, "trainer.max_steps=70", f'trainer.resume="{start}"', f"hydra.run.dir={name}"]
        assert (result := run_here(tmp_path, *more)).returncode == 0, result
        assert_close_weights(tmp_path / name, reference)
    ddp_start = reference / "checkpoints" / "step-00000064.pt"
    again = [
        "strategy=fsdp",
        "strategy.offload=true",
        *RESUME,
        "trainer.max_steps=70",
        f'trainer.resume="{ddp_start}"',
        "hydra.run.dir=again",
    ]
    assert (result := run_here(tmp_path, *again)).returncode == 0, result
    assert_close_weights(tmp_path / "again", reference)


def test_offload_without_data_parallel_ranks_is_one_line_with_the_fix(tmp_path: Path):
    result = run_here(
        tmp_path, "strategy=nd", "strategy.tp=2", "strategy.dp_shard=1", "strategy.offload=true", *GPT
    )
    assert result.returncode != 0
    assert "strategy.offload" in result.stderr and "dp_shard=-1" in result.stderr
    assert "Traceback" not in result.stderr

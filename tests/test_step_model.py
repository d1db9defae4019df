"""The per-op step-time model (ddpexp/predict/ops.py, device.py, ddpexp/planner/timing.py): the ops a
fake forward and backward records, their FLOPs and bytes, their time on a device profile, the fusion
torch.compile is modelled by, and a step's exposed communication."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddpexp import composition
from ddpexp.planner.timing import exposed_s, optimizer_s
from ddpexp.predict.device import Device, Timing, load_device
from ddpexp.predict.memory import predict
from ddpexp.predict.ops import Op, OpTracer, Trace, Work
from ddpexp.strategies.comm import Collective, Overlap

GPT = ["data=synthetic_tokens", "task=lm", "optim=adamw", "strategy=single"]


def _config(*overrides: str):
    with composition.composer() as compose:
        return compose([*GPT, *overrides])


def test_the_trace_counts_every_matmul_and_attention_flop_of_a_step():
    """gpt_small (4 layers, dim 256, 128 tokens, untied head) at 2 samples: the matmuls are 6 FLOPs per
    token and parameter that multiplies activations (forward 2, backward 4), and the flash attention,
    causal, 2 B S^2 dim per layer forward and 2.5 times that backward (it recomputes the scores)."""
    cfg = _config("model=gpt_small", "trainer.batch_size=2")
    (rank,) = predict(cfg, world=1, global_batch=2, trace=True)
    assert rank.work is not None
    tokens, dim, layers, seq = 2 * 128, 256, 4, 128
    block = 12 * dim * dim  # q, k, v, o, and the MLP's two 4 x dim matrices
    head = 256 * dim  # the 256-token vocabulary's output head
    assert rank.work.flops("matmul") == pytest.approx(6 * (layers * block + head) * tokens)
    assert rank.work.flops("attention") == pytest.approx(3.5 * 2 * 2 * seq * seq * dim * layers)


def test_a_model_of_identical_blocks_is_extended_exactly_from_two_and_three():
    """extrapolate=True runs 2 and 3 blocks and extends: the same activations, temporaries, FLOPs and
    device time as the whole model's own run (gpt_small at 6 layers, fsdp over 2 ranks, bf16)."""
    cfg = _config("model=gpt_small", "model.n_layer=6", "trainer.precision=bf16", "strategy=fsdp")
    from ddpexp import strategies

    fsdp = strategies.resolve({"name": "fsdp"})
    whole, extended = (
        predict(cfg, world=2, global_batch=8, strategy=fsdp, trace=True, extrapolate=e)[0]
        for e in (False, True)
    )
    assert extended.activations == pytest.approx(whole.activations)
    assert extended.transient == pytest.approx(whole.transient)
    assert extended.work is not None and whole.work is not None
    assert len(extended.work.parts) == 2  # the runs of 2 and 3 blocks, weighted
    assert extended.work.flops() == pytest.approx(whole.work.flops())
    h100 = load_device("h100_sxm", where="test")
    assert h100.time(extended.work).total_s == pytest.approx(h100.time(whole.work).total_s, rel=1e-6)
    assert h100.time(extended.work, compiled=True).total_s == pytest.approx(
        h100.time(whole.work, compiled=True).total_s, rel=1e-3
    )


def test_bf16_fsdp_computes_with_bf16_parameters_and_keeps_no_cast_copies():
    """Under FSDP's bf16 policy the fake run's matmuls are bf16 with no weight cast to keep for the
    backward; autocast over fp32 parameters (mixed_precision=fp32) keeps a bf16 copy of each weight,
    which the activations count."""
    from ddpexp import strategies

    cfg = _config("model=gpt_small", "trainer.precision=bf16", "strategy=fsdp")
    policy, autocast = (
        predict(cfg, world=2, global_batch=8, strategy=strategies.resolve(s), trace=True)[0]
        for s in ({"name": "fsdp"}, {"name": "fsdp", "mixed_precision": "fp32"})
    )
    assert policy.work is not None and autocast.work is not None
    for rank in (policy, autocast):
        sizes = {op.element_size for t, _ in rank.work.parts for op in t.ops if op.kind == "matmul"}  # type: ignore[union-attr]
        assert sizes == {2}
    casts = [op for t, _ in autocast.work.parts for op in t.ops if op.name == "_to_copy"]
    mine = [op for t, _ in policy.work.parts for op in t.ops if op.name == "_to_copy"]
    assert len(casts) > len(mine)
    weights = 4 * 12 * 256 * 256 * 2 + 256 * 256 * 2  # every matrix's bf16 copy
    assert autocast.activations - policy.activations >= 0.9 * weights


def test_an_op_takes_the_longer_of_its_math_and_its_bytes_and_a_matmul_both():
    device = Device(
        "d",
        80,
        {"bf16": 1000.0, "tf32": 500.0, "fp32": 100.0},
        memory_bandwidth_GBps=1000,
        matmul_efficiency={"bf16": 0.5},
        attention_efficiency=(0.4, 0.25),
        memory_efficiency=1.0,
    )
    mm = Op("matmul", "mm", "forward", flops=1e12, bytes=1e9, element_size=2, shape=(1, 8192, 8192, 8192))
    assert device.op_s(mm) == pytest.approx(1e12 / 500e12 + 1e9 / 1000e9)
    attn = Op("attention", "_flash_backward", "backward", flops=1e12, bytes=1e6, element_size=2)
    assert device.op_s(attn) == pytest.approx(1e12 / 250e12)
    add = Op("memory", "add", "forward", bytes=3e9)
    assert device.op_s(add) == pytest.approx(3e-3)
    # A matmul whose output cannot fill the device (4 tiles of 128 x 128, no K to split) uses 4 of 100.
    small = Op("matmul", "mm", "forward", flops=1e9, bytes=0, element_size=2, shape=(1, 256, 256, 128))
    few = dataclasses.replace(device, multiprocessors=100)
    assert few.op_s(small) == pytest.approx(1e9 / (500e12 * 0.04))


def test_the_host_bounds_a_step_of_many_small_kernels_in_eager_and_compiled_mode():
    ops = [Op("memory", "add", "forward", bytes=1e3) for _ in range(100)]
    device = Device("d", 80, {"bf16": 1.0, "tf32": 1.0, "fp32": 1.0}, 1000, launch_us=10)
    timing = device.time(Work(((Trace(ops), 1.0),)))
    assert timing.forward_s == pytest.approx(100 * 10e-6)  # the host issues 100 kernels


def test_compile_fuses_an_element_wise_chain_but_not_across_a_matmul_that_waits_on_it():
    """On a recorded trace: element-wise ops in a row fuse into one kernel moving what enters and
    leaves it; an add that reads the chain's result and a matmul's fed by it (a residual) stays a
    kernel of its own."""
    x = torch.randn(64, 128)
    w = torch.randn(128, 128)
    tracer = OpTracer()
    with tracer:
        h = x * 2.0
        h = h + 1.0
        h = h.relu()  # three element-wise ops in a row: one kernel under compile
        y = h @ w  # a matmul on the chain's result
        z = y + h  # reads the chain's result too, but waits on the matmul: not fused into the chain
    eager, fused = tracer.trace.ops, tracer.trace.fused()
    assert [op.kind for op in eager] == ["memory", "memory", "memory", "matmul", "memory"]
    assert [op.kind for op in fused] == ["memory", "matmul", "memory"]
    size = 64 * 128 * 4
    assert fused[0].bytes == pytest.approx(2 * size)  # x in, relu's result out (the matmul reads it)
    assert sum(op.bytes for op in eager[:3]) == pytest.approx(6 * size)
    del z


def test_each_call_hides_behind_its_share_of_the_pass_and_waits_for_the_rest():
    """A collective of 4 calls overlapping a backward of 4 s: each call under 1 s hides all but the
    last; at 2 s each, every call waits 1 s beyond its share, the first waits whole."""
    ar = Collective("grads", "all_reduce", 1.0, 8, calls=4, overlaps=Overlap.backward)
    assert exposed_s([(ar, 2.0)], forward_s=2.0, backward_s=4.0) == pytest.approx(0.5)
    assert exposed_s([(ar, 8.0)], forward_s=2.0, backward_s=4.0) == pytest.approx(2 + 3 * 1)
    tp = Collective("tp", "all_reduce", 1.0, 8, calls=10, overlaps=Overlap.none)
    assert exposed_s([(tp, 3.0)], forward_s=2.0, backward_s=4.0) == pytest.approx(3.0)


def test_the_optimizer_step_reads_and_writes_its_states_at_the_memory_bandwidth():
    device = Device("d", 80, {"bf16": 1.0, "tf32": 1.0, "fp32": 1.0}, 1000, memory_efficiency=1.0)
    # AdamW: the parameter, its gradient, two moments read; the parameter and moments written
    assert optimizer_s(device, 1e9, 2) == pytest.approx(7e9 / 1000e9)
    assert Timing(1.0, 2.0).total_s == 3.0


def test_a_measured_matmul_table_replaces_the_model_s_share_with_the_nearest_shape_s(tmp_path):
    """conf/devices' matmul_table (scripts/gemm_efficiency.py measures it on a GPU): a matmul takes the
    share measured for the shape nearest its own in the logarithms of M, N and K."""
    profile = tmp_path / "measured.yaml"
    profile.write_text(
        "name: measured\nmemory_gib: 80\npeak_tflops: {bf16: 1000, tf32: 500, fp32: 100}\n"
        "memory_bandwidth_GBps: 1000\nmatmul_efficiency: {bf16: 0.5}\n"
        "matmul_table:\n  bf16:\n    - [256, 256, 256, 0.1]\n    - [4096, 4096, 4096, 0.8]\n"
    )
    device = load_device(str(profile), where="test")
    small = Op("matmul", "mm", "forward", flops=1e9, bytes=1e6, element_size=2, shape=(1, 300, 200, 256))
    large = Op("matmul", "mm", "forward", flops=1e12, bytes=1e6, element_size=2, shape=(2, 2048, 8192, 4096))
    assert device.op_s(small) == pytest.approx(1e9 / (1000e12 * 0.1))
    assert device.op_s(large) == pytest.approx(1e12 / (1000e12 * 0.8))
    fp32 = dataclasses.replace(large, element_size=4)  # no table for fp32: the model's
    assert device.op_s(fp32) == pytest.approx(1e12 / (100e12 * 0.5) + 1e6 / (1000e9 * 0.9))


def test_the_gemm_script_measures_on_a_gpu_and_says_so_without_one():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gemm_efficiency.py"
    result = subprocess.run(
        [sys.executable, str(script), "--peak-tflops", "989.5"], capture_output=True, text=True
    )
    if torch.cuda.is_available():
        assert result.returncode == 0 and "matmul_table:" in result.stdout
    else:
        assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr

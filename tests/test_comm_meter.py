"""The communication meter samples its timing: bytes are counted on every step, time on one optimizer
step in trainer.time_comm_every_steps, and the epoch's comm time is estimated from the timed steps.
In-process (a gloo world of one): what a strategy's meter and the engine do together."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ddpexp.strategies.comm import CommMeter


def test_the_meter_times_one_step_in_k_and_scales_the_busy_time_to_every_step():
    meter = CommMeter()
    for step in range(6):
        meter.begin_step(3)  # steps 0 and 3 are timed
        start = 10.0 * step
        meter.record(start, start + 1.0, 100)  # a synchronous collective: 1 s, 100 bytes
        meter.record(start + 0.5, start + 1.5, 8, kind="sync_bn")  # overlaps it by 0.5 s
        meter.end_step()
    meter.record(99.0, 100.0, 1)  # after a step's end (e.g. a mid-epoch eval): counted, not timed
    busy, nbytes = meter.take()
    assert busy == pytest.approx(2 * 1.5 * 6 / 2)  # two timed steps of 1.5 s busy, scaled to six
    assert nbytes == {
        "gradients": 601,
        "parameters": 0,
        "sync_bn": 48,
        "buffers": 0,
        "tensor_parallel": 0,
        "activations": 0,
        "offload": 0,
        "context_parallel": 0,
        "expert_dispatch": 0,
        "expert_combine": 0,
    }
    assert meter.take() == (0.0, dict.fromkeys(nbytes, 0))


def test_the_share_is_of_the_timed_steps_own_time_and_never_above_one(monkeypatch):
    """One step in two timed, the first of them spent waiting 5 s for a peer's first batch: scaled to
    every step the busy time (10.2 s) is more than the epoch (8 s), which read as a comm/share of 1.27
    (1.19 seen in CI). The share is the part of the timed steps' own wall time some collective
    covered, clipped to them (a completion callback's end on another thread comes after the step)."""
    clock = {"now": 0.0}
    monkeypatch.setattr("ddpexp.strategies.comm.time.perf_counter", lambda: clock["now"])
    meter = CommMeter()
    for start, end, collectives in [
        (0, 5, [(0.0, 5.0)]),
        (5, 6, []),
        (6, 7, [(6.0, 6.1), (6.5, 7.5)]),
        (7, 8, []),
    ]:
        clock["now"] = start
        meter.begin_step(2)
        for a, b in collectives:
            meter.record(a, b, 10)
        clock["now"] = end
        meter.end_step()
    busy, _, share = meter.take_with_share(8.0)
    assert busy == pytest.approx((5.0 + 0.1 + 1.0) * 4 / 2)  # comm/time_per_step_s, as before
    assert share == pytest.approx((5.0 + 0.1 + 0.5) / (5.0 + 1.0))
    meter.record_unsampled(20.0, 22.0, 10)  # local SGD's average, outside the steps: beside them
    assert meter.take_with_share(8.0)[2] == pytest.approx(2.0 / 8.0)


def test_a_meter_no_engine_steps_times_everything():
    meter = CommMeter()
    meter.record(0.0, 2.0, 4)
    meter.record(1.0, 3.0, 4)
    kinds = (
        "parameters",
        "sync_bn",
        "buffers",
        "tensor_parallel",
        "activations",
        "offload",
        "context_parallel",
        "expert_dispatch",
        "expert_combine",
    )
    zero = dict.fromkeys(kinds, 0)
    assert meter.take() == (3.0, {"gradients": 8, **zero})


def test_a_paused_meter_counts_and_times_nothing():
    """What runs inside `paused()` (a pipeline's one-off inference of its stages' shapes) is not a
    training step's communication."""
    meter = CommMeter()
    with meter.paused():
        meter.record(0.0, 2.0, 4)
        meter.record_unsampled(0.0, 2.0, 4)
    meter.record(5.0, 6.0, 1)
    assert meter.take() == (
        1.0,
        {
            "gradients": 1,
            "parameters": 0,
            "sync_bn": 0,
            "buffers": 0,
            "tensor_parallel": 0,
            "activations": 0,
            "offload": 0,
            "context_parallel": 0,
            "expert_dispatch": 0,
            "expert_combine": 0,
        },
    )


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("accumulate", [1, 3])
def test_ddp_s_buffer_broadcast_before_a_step_s_forward_is_metered_as_the_model_counts_it(accumulate: int):
    """DDP re-sends rank 0's BatchNorm statistics before each training forward that synchronises
    gradients (so once per optimizer step: not under no_sync): the meter counts them as buffers and
    times them, and the cost model's count for the step is the same."""
    from ddpexp.models.convnet import convnet
    from ddpexp.strategies.comm import Workload, buffer_bytes_of, parameter_bytes
    from ddpexp.strategies.ddp import Ddp, DdpConfig, ddp_communication

    torch.manual_seed(0)
    model = convnet(channels=[4, 8], num_classes=10, input_shape=[1, 8, 8])
    ctx: Any = SimpleNamespace(device=torch.device("cpu"))
    wrapped = Ddp(DdpConfig()).wrap(model, ctx=ctx, measure_comm=True)
    assert wrapped.comm is not None and wrapped.no_sync is not None
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    steps = 2
    for _ in range(steps):
        wrapped.comm.begin_step()
        for micro in range(accumulate):
            last = micro == accumulate - 1
            with wrapped.no_sync() if not last else contextlib.nullcontext():
                torch.nn.functional.cross_entropy(wrapped.module(x), y).backward()
        wrapped.comm.end_step()
    busy, nbytes = wrapped.comm.take()
    buffers = buffer_bytes_of(model)
    assert buffers > 0 and nbytes["buffers"] == steps * buffers
    assert nbytes["gradients"] == steps * parameter_bytes(model) and busy > 0
    meta = convnet(channels=[4, 8], num_classes=10, input_shape=[1, 8, 8]).to("meta")
    job = Workload(model=meta, devices=1, world=1, nodes=1, global_batch=6, accumulate=accumulate)
    counted = {c.what: c.counted for c in ddp_communication(DdpConfig(), job=job)}
    assert sum(counted.values()) == sum(nbytes.values()) / steps, counted


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("every", [1, 4])
def test_ddp_times_only_the_sampled_steps_and_counts_every_steps_bytes(every: int, monkeypatch):
    """DDP's comm hook adds its completion callback only on the timed steps (the cost sampling saves),
    while comm/bytes_per_step stays exact and comm/time_per_step_s is estimated from the timed ones."""
    from ddpexp.data import loaders
    from ddpexp.data.synthetic import synthetic
    from ddpexp.engine import Engine, LoopSettings
    from ddpexp.recorder import NullRecorder
    from ddpexp.strategies.comm import parameter_bytes
    from ddpexp.strategies.ddp import Ddp, DdpConfig

    completions: list[float] = []
    interval = CommMeter.interval

    def spy(self: CommMeter, start: float, end: float) -> None:
        completions.append(end - start)
        interval(self, start, end)

    monkeypatch.setattr(CommMeter, "interval", spy)
    splits = synthetic(num_train=320, num_eval=32).load(Path("."))
    kw: dict[str, Any] = dict(batch_size=32, rank=0, world=1, seed=0, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
    ctx: Any = SimpleNamespace(device=torch.device("cpu"))
    wrapped = Ddp(DdpConfig()).wrap(model, ctx=ctx, measure_comm=True)
    settings = LoopSettings(
        epochs=1, max_steps=None, log_every_steps=50, eval_every_epochs=1, global_batch=32,
        time_comm_every_steps=every,
    )  # fmt: skip
    engine = Engine(
        model=wrapped,
        optimizer=torch.optim.SGD(wrapped.module.parameters(), lr=0.01),
        train_loader=loaders.build(splits.train, mode="device", train=True, **kw),
        eval_loader=loaders.build(splits.eval, mode="device", train=False, **kw),
        recorder=NullRecorder(),
        settings=settings,
        device=torch.device("cpu"),
    )
    values = engine.train_epoch(0)
    steps = 320 // 32
    assert len(completions) == math.ceil(steps / every)  # one bucket per step: the model is small
    assert values["comm/bytes_per_step"] == parameter_bytes(model)
    assert values["comm/time_per_step_s"] == pytest.approx(sum(completions) / len(completions), rel=1e-6)


@pytest.mark.usefixtures("world_of_one")
def test_the_meter_cost_script_measures_every_variant_against_plain_ddp(monkeypatch):
    """scripts/comm_meter_cost.py (the README's per-step cost of the meter), a smoke run in-process."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import comm_meter_cost

    out = comm_meter_cost.measure(rounds=1, steps=3)
    assert out["hand_us_per_step"] > 0 and out["time_comm_every_steps"] == 10
    assert {"every_extra_us", "sampled_extra_us", "pyhook_extra_us", "quiet_extra_us"} <= set(out)


@pytest.mark.usefixtures("world_of_one")
def test_the_ddp_step_breakdown_script_runs_every_variant(monkeypatch):
    """scripts/ddp_step_breakdown.py (the README's breakdown of where the cost model misses): each
    variant's step, in-process in a world of one."""
    import queue

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import ddp_step_breakdown

    out: queue.Queue[tuple[int, float, list]] = queue.Queue()
    for variant in ddp_step_breakdown.VARIANTS:
        ddp_step_breakdown.rank_main(0, 1, 4, variant, "unused", 5, out)
        rank, step, stamps = out.get_nowait()
        assert rank == 0 and step > 0, variant
        timed = variant in ddp_step_breakdown.TIMED_ALLREDUCE
        assert len(stamps) == (4 if timed else 0) and all(0 < a <= b for a, b in stamps), variant
    # Two ranks' stamps on one clock: rank 1 arrives 2 ms after rank 0, both leave 1 ms after it.
    two = [[(0.000, 0.003), (0.010, 0.013)], [(0.002, 0.003), (0.012, 0.013)]]
    skew, itself = ddp_step_breakdown.arrivals(two)
    assert skew == pytest.approx(2.0) and itself == pytest.approx(1.0)

"""The cost model (ddpexp.predict, and each strategy's `communication` / `compute_share`): byte counts
that equal what ddpexp measures, the ring/all-gather/funnel/bubble formulas, predictions that stay
monotone and bounded, a commbench.json read back into the times it was fitted on, and bad input
refused with one line and exit 2. Pure and fast: no process group, models on the meta device."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ddpexp import predict, strategies
from ddpexp.commbench import bus_factor
from ddpexp.models.convnet import convnet
from ddpexp.predict import Predictor, interconnect
from ddpexp.predict.interconnect import Link, collective_time, fabric, hops
from ddpexp.predict.model import hidden_s
from ddpexp.strategies.comm import COLLECTIVE_OPS, Collective, Overlap, Workload

strategies.load_builtins()

CONVNET = {"_target_": "ddpexp.models.convnet.convnet", "channels": [16, 32], "batch_norm": True}
DIGITS = {"_target_": "ddpexp.data.digits.digits", "image_size": 28, "eval_fraction": 0.2, "split_seed": 0}
S = 116_136  # the ConvNet's parameter bytes (29,034 fp32 parameters)


def meta_convnet() -> torch.nn.Module:
    with torch.device("meta"):
        return convnet(num_classes=10, input_shape=[1, 28, 28])


def job(world: int, *, nodes: int = 1, device_type: str = "cpu", batch: int = 48, model=None) -> Workload:
    return Workload(
        model=model if model is not None else meta_convnet(),
        devices=world,
        world=world,
        nodes=nodes,
        global_batch=batch,
        device_type=device_type,
        input_shape=(1, 28, 28),
    )


def communication(name: str, world: int, **settings) -> list[Collective]:
    return strategies.resolve({"name": name, **settings}).communication(job=job(world))


def counted(name: str, world: int, **settings) -> float:
    return sum(c.counted for c in communication(name, world, **settings))


def make_run(
    tmp_path: Path,
    *,
    strategy: str = "single",
    devices: int = 1,
    step_s: float = 0.020,
    comm_s: float | None = None,
    device_type: str = "cpu",
    cores: int = 2,
    threads: int | None = 1,
    batch: int = 48,
    config: bool = True,
    **facts_extra,
) -> Path:
    """A run directory as ddpexp leaves one: metrics.json (facts, final, history) and config.yaml
    (without it, the model is one flat tensor of facts.parameters)."""
    run = tmp_path / f"run-{strategy}-{devices}-{config}"
    run.mkdir()
    epoch = {"perf/step_time_s": step_s, "perf/samples_per_s": batch / step_s}
    if comm_s is not None:
        epoch["comm/time_per_step_s"] = comm_s
    facts = {
        "strategy": strategy,
        "world_size": devices,
        "devices": devices,
        "nnodes": 1,
        "nprocs_per_node": devices,
        "global_batch_size": batch,
        "accumulate": 1,
        "device_type": device_type,
        "host_cpus": cores,
        "threads": threads or 1,
        "parameters": 29_034,
        **facts_extra,
    }
    history = [{**epoch, "perf/step_time_s": 10 * step_s}, epoch]  # the first epoch is left out
    (run / "metrics.json").write_text(json.dumps({"facts": facts, "final": epoch, "history": history}))
    if not config:
        return run
    config = {
        "strategy": {"name": strategy},
        "model": CONVNET,
        "data": DIGITS,
        "trainer": {"threads": threads},
    }
    OmegaConf.save(OmegaConf.create(config), run / "config.yaml")
    return run


# ------------------------------------------------------------------------------------------ (1) bytes


def test_byte_counts_equal_what_ddpexp_measured_for_the_convnet():
    """Against comm/bytes_per_step of real runs of the default experiment (the ConvNet on digits, gloo,
    this VM, 2 epochs): at W=2 ddp 116,536 (the gradients' 116,136 + the BatchNorm buffers' 400 DDP
    broadcasts before each step), with fp16/bf16 58,468 and PowerSGD's rank-1 factors 9,220 (8,820 +
    400), zero 232,672 (ddp's + every parameter broadcast from its owner); fsdp at W=3 (global batch 48,
    1 epoch) 174,032 without and 217,540 with reshard_after_forward (FSDP2 pads dim 0 to a multiple of
    W: more than 1.5 and 2 x S/... of the unpadded); ps at W=3 155,371 (README: 4/3 of 116,528 bytes of
    parameters and buffers)."""
    measured = {
        ("ddp", 2, ()): 116_536,
        ("zero", 2, ()): 232_672,
        ("ddp", 2, (("comm_hook", "bf16"),)): 58_468,
        ("ddp", 2, (("comm_hook", "fp16"),)): 58_468,
        ("ddp", 2, (("comm_hook", "powersgd"),)): 9_220,
        ("zero", 2, (("comm_hook", "bf16"),)): 174_604,
        ("fsdp", 3, (("reshard_after_forward", False),)): 174_032,
        ("fsdp", 3, (("reshard_after_forward", True),)): 217_540,
        ("ps", 3, ()): 155_371,
    }
    for (name, world, settings), value in measured.items():
        assert counted(name, world, **dict(settings)) == pytest.approx(value, rel=0.01), (name, settings)


def test_ring_counts_what_each_rank_sends_and_collective_the_buffer():
    for world in (2, 3, 4):
        assert counted("naive_allreduce", world) == S
        assert counted("naive_allreduce", world, algorithm="ring") == pytest.approx(
            2 * (world - 1) / world * S
        )


def test_ddp_s_buffer_broadcast_and_zero_s_parameter_broadcast_are_counted():
    """zero broadcasts every parameter from its owner after the step, and DDP rank 0's BatchNorm
    buffers before the step's forward: both are metered, so both are in the count."""
    buffers = sum(b.numel() * b.element_size() for b in meta_convnet().buffers())
    ddp = communication("ddp", 4)
    assert [c.op for c in ddp] == ["all_reduce", "broadcast"]
    assert ddp[1].counted == ddp[1].bytes == buffers > 0
    assert counted("ddp", 4) == S + buffers
    zero = communication("zero", 4)
    assert [c.op for c in zero] == ["all_reduce", "broadcast", "broadcast"]
    assert zero[2].bytes == zero[2].counted == S and zero[2].calls == 4  # every parameter, from its owner
    assert counted("zero", 4) == counted("ddp", 4) + S
    # with sync_bn the statistics are global already: DDP broadcasts no buffers
    assert [c.op for c in communication("ddp", 4, sync_bn=True)] == ["all_reduce", "all_reduce"]


# ------------------------------------------------------------------------------------------ (3) formulas


def test_ring_all_reduce_moves_2_w_minus_1_over_w_of_the_buffer_per_link():
    bandwidth_only, latency_only = Link(0.0, 1.0), Link(1.0, 0.0)
    for w in (1, 2, 3, 8, 64):
        c = Collective("g", "all_reduce", 1000.0, w)
        assert collective_time(c, bandwidth_only) == pytest.approx(2 * (w - 1) / w * 1000)
        assert collective_time(c, latency_only) == 2 * (w - 1)
        gather = Collective("g", "all_gather", 1000.0, w)  # 1000 gathered: each rank gets (W-1)/W of it
        assert collective_time(gather, bandwidth_only) == pytest.approx((w - 1) / w * 1000)


def test_fsdp_moves_its_all_gathers_plus_one_reduce_scatter():
    for world in (2, 3, 4):
        reshard = communication("fsdp", world)
        keep = communication("fsdp", world, reshard_after_forward=False)
        assert [c.op for c in reshard] == ["all_gather", "all_gather", "reduce_scatter"]
        assert [c.op for c in keep] == ["all_gather", "reduce_scatter"]
        shard = keep[0].counted  # one rank's shard of every unit
        assert keep[0].bytes == world * shard and keep[1].bytes == world * shard  # gathered / reduced: W x
        assert sum(c.counted for c in keep) == pytest.approx((1 + world) * shard)
        assert sum(c.counted for c in reshard) == pytest.approx((2 + world) * shard)
        assert S / world <= shard < S / world * 1.25  # padding: ceil(d0/W) rows (10 classes over 3: 12%)
        assert [c.overlaps for c in reshard] == [Overlap.forward, Overlap.backward, Overlap.backward]


def test_ps_funnels_every_push_and_pull_through_the_servers_link():
    link = Link(0.0, 1.0)
    times = {w: sum(collective_time(c, link) for c in communication("ps", w)) for w in (2, 3, 5, 9)}
    flat = 116_528  # parameters and BatchNorm buffers, fp32
    for w, t in times.items():
        assert t == pytest.approx(2 * (w - 1) * flat)  # serialised: grows with W, not bounded like a ring
    strategy = strategies.resolve({"name": "ps"})
    two_nodes = strategy.communication(job=job(8, nodes=2))
    assert [(c.calls, c.inter_node) for c in two_nodes] == [(6, False), (8, True)]  # 3 local, 4 remote
    assert strategy.compute_share(job=job(5)) == 1 / 4  # the server computes nothing


def test_pipeline_compute_carries_the_bubble_and_activations_cross_stages():
    strategy = strategies.resolve({"name": "pipeline", "stages": 2, "microbatches": 4})
    p, m = 2, 4
    assert strategy.compute_share(job=job(2)) == pytest.approx((m + p - 1) / (m * p))
    assert strategy.compute_share(job=job(4)) == pytest.approx((m + p - 1) / (m * p * 2))
    one, two = strategy.communication(job=job(2)), strategy.communication(job=job(4))
    assert [c.op for c in one] == ["sendrecv"] and [c.op for c in two] == ["sendrecv", "all_reduce"]
    activations = one[0]
    # 48 samples / 4 micro-batches = 12; the ConvNet's stages balanced by parameters are layer1 + layer2
    # | head, so 12 x 32 x 7 x 7 floats cross, each slot, forward and back
    assert activations.calls == 2 * (m + p - 1)
    assert activations.bytes == 2 * (m + p - 1) * 12 * 32 * 7 * 7 * 4
    with pytest.raises(strategies.UserError, match="whole pipelines"):
        strategy.compute_share(job=job(3))


def test_nd_s_pipeline_stages_carry_the_same_bubble_as_pipeline():
    """nd with pp stages computes 1/(dp x tp x pp) of the batch in m + pp - 1 micro-batch slots, as
    pipeline does (ddpexp plan --verify found nd pp2 ranked ahead of ddp without it, and measured 27%
    slower)."""
    for pp, m, world in [(2, 4, 2), (2, 4, 4), (2, 8, 4), (4, 8, 4)]:
        nd = strategies.resolve({"name": "nd", "pp": pp, "microbatches": m, "dp_shard": -1})
        pipe = strategies.resolve({"name": "pipeline", "stages": pp, "microbatches": m})
        expected = (m + pp - 1) / (m * pp * (world // pp))
        assert nd.compute_share(job=job(world)) == pytest.approx(expected), (pp, m, world)
        assert pipe.compute_share(job=job(world)) == pytest.approx(expected), (pp, m, world)
    tp = strategies.resolve({"name": "nd", "tp": 2, "dp_shard": -1})
    assert tp.compute_share(job=job(4)) == pytest.approx(1 / 4)  # no stages: no bubble


def test_nd_s_groups_cross_the_network_only_where_their_ranks_lie_on_two_machines():
    """2 nodes of 4: ranks lie tp innermost, then dp_shard, dp_replicate, pp (torchtitan's order), so
    HSDP's shard group stays in a node and only its replicas' all-reduce crosses; FSDP over all 8 does
    cross; a pipeline's stages of 4 ranks each sit on a machine and send to the other."""

    def links(**degrees) -> list[tuple[str, bool]]:
        nd = strategies.resolve({"name": "nd", **degrees})
        return [(c.op, c.inter_node) for c in nd.communication(job=job(8, nodes=2))]

    hsdp = links(dp_replicate=2, dp_shard=-1)
    assert {op: inter for op, inter in hsdp} == {
        "all_gather": False,
        "reduce_scatter": False,
        "all_reduce": True,
    }
    assert {inter for _, inter in links(dp_shard=-1)} == {True}  # 8 shards on two machines
    staged = links(pp=2, dp_shard=-1, microbatches=4)
    assert {op: inter for op, inter in staged} == {
        "all_gather": False,
        "reduce_scatter": False,
        "sendrecv": True,
    }


def test_a_commbench_fit_comes_back_at_its_own_size(tmp_path: Path):
    """Per-op fits divided into a link's alpha and beta, then costed again by the ring formulas at the
    benchmark's world size, give back the fitted time exactly."""
    fits = {
        "all_reduce": {"alpha_s": 4e-4, "beta_s_per_byte": 2e-9},
        "all_gather": {"alpha_s": 3e-4, "beta_s_per_byte": 1e-9},
        "sendrecv": {"alpha_s": 1e-4, "beta_s_per_byte": 5e-10},
    }
    for f in fits.values():
        f.update(rel_error_mean=0.1, rel_error_max=0.2)
    facts = {
        "backend": "gloo",
        "world_size": 4,
        "nnodes": 1,
        "nprocs_per_node": 4,
        "device_type": "cpu",
        "host": "test",
        "torch": "2",
        "started_at": 0,
    }
    path = tmp_path / "commbench.json"
    path.write_text(json.dumps({"facts": facts, "results": [], "fits": fits}))
    fabric = interconnect.fabric(commbench=path)
    for op, fit in fits.items():
        for size in (4.0, 1e6):
            c = Collective("x", op, size, 4)
            assert fabric.time_s(c) == pytest.approx(fit["alpha_s"] + size * fit["beta_s_per_byte"]), op
    with pytest.raises(strategies.UserError, match="between nodes"):
        fabric.time_s(Collective("x", "all_reduce", 1.0, 8, inter_node=True))


def test_one_rank_costs_nothing_but_a_sendrecv_costs_one_hop():
    """The cost model's formulas on one rank: no latency term and no byte crosses a link for a
    collective (bus_factor is commbench's, tests/test_commbench.py checks its values); a sendrecv is
    one message over one link at any W."""
    link = Link(1e-5, 1e-9)
    for op in COLLECTIVE_OPS:
        one = collective_time(Collective("x", op, 1e6, 1), link)
        assert one == (pytest.approx(1e-5 + 1e-3) if op == "sendrecv" else 0.0), op
    assert hops("all_reduce", 4) == 6 and hops("all_gather", 4) == 3 and hops("sendrecv", 4) == 1
    assert collective_time(Collective("x", "all_reduce", 1e6, 4), link) == pytest.approx(
        6 * 1e-5 + bus_factor("all_reduce", 4) * 1e-3
    )


def test_cpu_processes_share_the_hosts_cores(tmp_path: Path):
    """A 1-thread single run on 2 cores: W processes of 1 thread each get min(1, 2/W) cores, so compute
    per step halves at W=2 and stays there at W=4 (4 processes on 2 cores)."""
    run = make_run(tmp_path, step_s=0.020, cores=2, threads=1)
    predictor = Predictor.build(run, interconnect="localhost_gloo", strategy="ddp")
    assert [predictor.point(w).compute_s for w in (1, 2, 4)] == pytest.approx([0.020, 0.010, 0.010])


def _bench(path: Path, world: int, alpha: float, stretch: float | None) -> Path:
    """A commbench.json at `world` processes on one node: all_reduce = alpha + 1e-9 s/byte, and, if
    `stretch`, the compute record of a run after compute (1 thread per process)."""
    fit = {"alpha_s": alpha, "beta_s_per_byte": 1e-9, "rel_error_mean": 0.0, "rel_error_max": 0.0}
    facts = {"backend": "gloo", "world_size": world, "nnodes": 1, "nprocs_per_node": world, "host": "t"}
    record: dict = {"facts": facts, "results": [], "fits": {"all_reduce": fit}}
    if stretch is not None:  # back to back, the calls cost a quarter of the latency
        facts.update(after_compute_ms=10, threads=1)
        record["compute"] = {"alone_s": 0.01, "together_s": 0.01 * stretch, "stretch": stretch}
        record["fits_back_to_back"] = {"all_reduce": {**fit, "alpha_s": alpha / 4}}
    path.write_text(json.dumps(record))
    return path


def test_commbench_results_at_several_process_counts_are_each_used_at_their_own(tmp_path: Path):
    """On a CPU host W processes' collectives and compute do not follow from another W's: given a
    commbench after compute at W = 2 and at W = 4, each W's all-reduce (one bucket, after the backward)
    costs what was measured there after compute; each process's compute is one process's stretched by
    what W of them computing at once measured (not the division of the cores). A count not measured
    falls back to the first result and the cores."""
    run = make_run(tmp_path, step_s=0.020, cores=2, threads=1)
    two = _bench(tmp_path / "two.json", 2, 1e-3, 1.1)
    four = _bench(tmp_path / "four.json", 4, 5e-3, 2.6)
    predictor = Predictor.build(run, commbench=[two, four], strategy="ddp")
    points = {w: predictor.point(w) for w in (2, 3, 4)}
    buffer = sum(c.bytes for c, _ in points[2].timed if c.op == "all_reduce")
    for w, alpha in ((2, 1e-3), (4, 5e-3)):
        (t,) = [t for c, t in points[w].timed if c.op == "all_reduce"]
        assert t == pytest.approx(alpha + 1e-9 * buffer), w
    ((c, t),) = [(c, t) for c, t in points[3].timed if c.op == "all_reduce"]
    assert t == pytest.approx(interconnect.fabric(commbench=two).time_s(c))  # the ring formulas from W=2
    # the single run's 20 ms is one core's; ddp at W gives each process 1/W of it
    assert points[2].compute_s == pytest.approx(0.020 / 2 * 1.1)
    assert points[4].compute_s == pytest.approx(0.020 / 4 * 2.6)
    assert points[3].compute_s == pytest.approx(0.020 / 3 * 1.5)  # 3 processes on 2 cores: 2/3 core each
    with pytest.raises(strategies.UserError, match="two commbench results after the same compute at 2 "):
        Predictor.build(run, commbench=[two, two], strategy="ddp")


def test_a_call_waits_after_compute_as_long_as_measured_after_a_burst_as_long_as_its_compute():
    """Two commbench results after compute (bursts of 1 and 10 ms): a call costs its back-to-back time
    plus the wait measured on top, interpolated in the logarithm of the compute before it. Calls that
    interleave with the backward pass (4 buckets) each follow a quarter of its 2/3 of the compute;
    the calls of a collective between compute (3 broadcasts) wait once, after the whole compute."""
    quick = {"all_reduce": Link(1e-4, 0.0)}
    same = interconnect.Stretch(1.0, 1)
    short = interconnect.AfterCompute(1e-3, {"all_reduce": Link(2e-4, 0.0)}, quick, same)  # waits 1e-4 a hop
    long = interconnect.AfterCompute(1e-2, {"all_reduce": Link(5e-4, 0.0)}, quick, same)  # waits 4e-4 a hop
    fabric = interconnect.Fabric("t", quick, None, waits=(short, long))
    buckets = Collective("g", "all_reduce", 0.0, 2, calls=4, overlaps=Overlap.backward)
    broadcasts = Collective("p", "broadcast", 0.0, 2, calls=3)
    hop = {"all_reduce": 2, "broadcast": 1}  # at W = 2
    for compute, wait_per_hop in [(0.006, 1e-4), (0.06, 4e-4), (0.0, 1e-4), (1.0, 4e-4)]:
        (_, b), (_, p) = fabric.timed([buckets, broadcasts], compute)
        # 0.006 s x 2/3 / 4 = 1 ms before each bucket; 0.06: 10 ms; beyond the bursts: the nearest
        assert b == pytest.approx(4 * hop["all_reduce"] * (1e-4 + wait_per_hop)), compute
    (_, b), (_, p) = fabric.timed([buckets, broadcasts], 0.003 * 10**0.5 * 6 / 3)  # sqrt(1 x 10) ms
    assert b == pytest.approx(4 * 2 * (1e-4 + 2.5e-4))  # halfway in the logarithm
    (_, p) = fabric.timed([broadcasts], 0.01)[0]
    assert p == pytest.approx(3 * 1e-4 + 4e-4)  # three calls back to back, one wait after 10 ms


def test_overlap_hides_all_but_the_last_bucket_on_accelerators():
    """One bucket: nothing hides (its all-reduce starts when backward ends); many: all but the last,
    up to the backward pass's time."""
    c1 = Collective("g", "all_reduce", 1.0, 2, calls=1, overlaps=Overlap.backward)
    c4 = Collective("g", "all_reduce", 1.0, 2, calls=4, overlaps=Overlap.backward)
    assert hidden_s([(c1, 0.006)], 0.030, 1.0) == 0
    assert hidden_s([(c4, 0.006)], 0.030, 1.0) == pytest.approx(0.0045)
    assert hidden_s([(c4, 0.006)], 0.003, 1.0) == pytest.approx(0.002)  # 2/3 of the compute
    assert hidden_s([(c4, 0.006)], 0.030, 0.0) == 0  # a CPU host with every core busy


# ------------------------------------------------------------------------------------------ (2) bounds


@pytest.mark.parametrize("name", ["ddp", "zero", "fsdp", "naive_allreduce", "ps", "ddp_mp"])
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("parameters", [None, 25_000_000])  # the ConvNet (latency-bound), a flat 100 MB
def test_predictions_are_monotone_and_bounded(tmp_path: Path, name: str, device_type: str, parameters):
    if parameters and name == "ddp_mp":
        pytest.skip("ddp_mp needs the model's stages(): a flat tensor has none")
    run = make_run(
        tmp_path,
        step_s=0.050,
        device_type=device_type,
        cores=64,
        threads=None,
        batch=4096,
        config=parameters is None,
        **({"parameters": parameters} if parameters else {}),
    )
    predictor = Predictor.build(run, interconnect="nvlink4,ib400", strategy=name)
    for nodes in (1, 2):
        points = [p for p in predictor.points([1, 2, 4, 8, 16, 32, 64], [nodes]) if p.note is None]
        assert len(points) >= 5
        for p in points:
            assert 0 < p.efficiency <= 1 + 1e-12, (p.devices, p.efficiency)
            assert p.step_s >= p.compute_s > 0 and 0 <= p.exposed_s <= p.comm_s
        # A ring in a node: more ranks never send less per link (activations, per rank, shrink).
        # Across nodes more ranks a node also mean more adapters at once (test_rails_...).
        if name != "ps" and nodes == 1:
            comms = [sum(t for c, t in p.timed if c.op != "sendrecv") for p in points]
            assert comms == sorted(comms), comms
    one = predictor.point(4, 1)
    assert one.efficiency <= (3 / 4 if name == "ps" else 1)


def test_every_builtin_strategy_describes_itself_or_refuses_a_size():
    for name in strategies.builtin_names():
        strategy = strategies.resolve({"name": name})
        for world in (1, 2, 3, 4):
            try:
                out = strategy.communication(job=job(world, device_type="cuda"))
                share = strategy.compute_share(job=job(world, device_type="cuda"))
            except strategies.UserError:
                continue
            assert 0 < share <= 1 and all(c.bytes >= 0 and c.calls >= 0 for c in out), name


def test_predict_curve_gives_the_reports_points(tmp_path: Path):
    run = make_run(tmp_path, step_s=0.050, device_type="cuda", cores=64, threads=None, batch=4096)
    curve = predict.predict_curve(run, [1, 2, 3, 4], interconnect="nvlink4", strategy="ddp")
    assert [d for d, _ in curve] == [1, 2, 3, 4] and curve[0][1] == pytest.approx(1.0)
    facts_only = {
        "facts": json.loads((run / "metrics.json").read_text())["facts"],
        "final": {"perf/step_time_s": 0.05},
    }
    assert predict.predict_curve(facts_only, [2], interconnect="nvlink4", strategy="ddp")[0][
        1
    ] == pytest.approx(curve[1][1], rel=1e-3)  # a flat tensor of facts.parameters: the same bytes


# ------------------------------------------------------------------------------------------ (4) bad input


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert predict.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "(fix: " in err, err
    return err


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = make_run(tmp_path)
    assert "RUN_DIR" in _refused(capsys, str(tmp_path / "nowhere"), "--interconnect", "nvlink4")
    assert "no interconnect 'nvlink9' (fix: one of eth10, " in _refused(
        capsys, str(run), "--interconnect", "nvlink9"
    )
    assert "--commbench" in _refused(capsys, str(run))  # no interconnect at all
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.json").write_text(json.dumps({"final": {"perf/step_time_s": 0.1}}))
    assert "no facts" in _refused(capsys, str(bare), "--interconnect", "nvlink4")
    assert "commbench" in _refused(capsys, str(run), "--commbench", str(run / "metrics.json"))
    assert "strategy" in _refused(capsys, str(run), "--interconnect", "nvlink4", "--strategy", "nope")


def test_the_table_prints_a_row_per_size_and_the_assumptions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    run = make_run(tmp_path)
    assert (
        predict.main(
            [str(run), "--interconnect", "localhost_gloo", "--strategy", "ddp", "--devices", "1,2,4"]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[:2] for r in rows] == [["1", "1"], ["2", "1"], ["4", "1"]]
    assert rows[0][7] == "100.0%" and "assumptions:" in out
    assert not math.isnan(float(rows[2][5].replace(",", "")))


def test_a_single_run_is_predicted_for_the_strategies_that_fit_its_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """The README's first example on the usual baseline, a `single` run, without --strategy: a table
    for each strategy that runs on that host, the first line naming them; `dp` (one process over
    several GPUs) only where the run had GPUs. --strategy predicts that one alone."""
    cpu = make_run(tmp_path)
    assert predict.main([str(cpu), "--interconnect", "localhost_gloo", "--devices", "1,2,4"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("ddpexp-predict: single runs on one device: predicting ddp, fsdp, zero"), first
    assert "dp needs GPUs" in first and "--strategy" in first
    assert [line.split(" on ")[0] for line in out.splitlines() if line.startswith("predicting:")] == [
        "predicting: ddp",
        "predicting: fsdp",
        "predicting: zero",
    ]
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 9 and all("-" not in row[2:] for row in rows), rows  # numbers, not dashes
    (tmp_path / "gpu").mkdir()
    gpu = make_run(tmp_path / "gpu", device_type="cuda", cores=64, threads=None, batch=4096)
    assert predict.main([str(gpu), "--interconnect", "nvlink4", "--devices", "1,2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "predicting ddp, fsdp, zero, dp" in first and "needs GPUs" not in first, first
    assert predict.main([str(cpu), "--interconnect", "nvlink4", "--devices", "1,2", "--strategy", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "ddpexp-predict:" not in out and out.count("predicting:") == 1
    # a CPU baseline onto GPU links: the table's first lines say whose compute it is
    said = out.splitlines()[2]
    assert said.startswith("compute: this run's CPU host (") and "ddpexp plan --cluster" in said, out


def test_dp_is_not_predicted_on_more_than_one_device_of_a_cpu_host(tmp_path: Path):
    """On a CPU, DataParallel runs one replica: a size above 1 is refused with the reason, and the
    report's curve for it is empty."""
    from ddpexp.predict.model import predict_curve

    run = make_run(tmp_path)
    point = Predictor.build(run, interconnect="localhost_gloo", strategy="dp").point(2)
    assert point.note is not None and "GPU" in point.note
    assert predict_curve(run, [1, 2, 4], interconnect="localhost_gloo", strategy="dp") == [(1, 1.0)]


def test_a_run_of_the_strategy_at_one_size_calibrates_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """--calibrate: a single run predicts fsdp; an fsdp run at 2 devices, 6 ms a step slower than
    predicted there (FSDP's own work each step, which the single run cannot show), adds those 6 ms at
    every size, so the prediction at 2 is what that run measured. The wrong strategy, or another batch,
    is refused in one line."""
    single = make_run(tmp_path)
    argv = [str(single), "--interconnect", "localhost_gloo", "--devices", "2,4"]
    plain = Predictor.build(single, interconnect="localhost_gloo", strategy="fsdp")
    at2, at4 = (plain.point(w).step_s for w in (2, 4))
    fsdp = make_run(tmp_path, strategy="fsdp", devices=2, step_s=at2 + 0.006, comm_s=0.0)
    assert predict.main([*argv, "--calibrate", str(fsdp)]) == 0  # the strategy: the calibration run's
    out = capsys.readouterr().out
    assert "predicting: fsdp " in out and "so every size pays +6 ms a step" in out
    assert "exposed ms  overhead ms  step ms" in out
    rows = {r[0]: r for r in (line.split() for line in out.splitlines() if line[:1].isdigit())}
    step = 6  # W, N, compute, comm, exposed, overhead, step
    assert float(rows["4"][5]) == pytest.approx(6.0)
    assert float(rows["2"][step]) == pytest.approx((at2 + 0.006) * 1e3, abs=0.01)
    assert float(rows["4"][step]) == pytest.approx((at4 + 0.006) * 1e3, abs=0.01)
    assert "--calibrate: the calibration run is fsdp, the prediction is for ddp" in _refused(
        capsys, *argv, "--strategy", "ddp", "--calibrate", str(fsdp)
    )
    other = tmp_path / "other"
    other.mkdir()
    assert "global batch is 96" in _refused(
        capsys, *argv, "--calibrate", str(make_run(other, strategy="fsdp", devices=2, batch=96))
    )


def test_a_ring_across_nodes_moves_as_many_adapters_bytes_as_it_has_ranks_on_a_node():
    """Rail-optimised nodes (an adapter per device, conf/interconnect per_device: true): a ring of k
    ranks a node crosses between nodes on k adapters at once, so its bandwidth is k adapters' (as
    nccl-tests' bus bandwidth between 8-GPU nodes is 8 adapters'), never above the links inside a node;
    a shared adapter (Ethernet's) moves one's whatever k is."""

    def seconds(interconnect: str, per_node: int) -> float:
        c = Collective("x", "all_gather", 8e9, 16, inter_node=True, per_node=per_node)
        return fabric(interconnect).time_s(c) - fabric(interconnect).time_s(
            Collective("x", "all_gather", 0.0, 16, inter_node=True, per_node=per_node)
        )

    assert seconds("nvlink4,ib400", 1) == pytest.approx(4 * seconds("nvlink4,ib400", 4))
    # 8 adapters of 45 GB/s (ib400 x 0.9) would be 360; NVLink 4's 360 GB/s (450 x 0.8) bounds it.
    assert seconds("nvlink4,ib400", 8) == pytest.approx(seconds("nvlink4,ib400", 16))
    assert seconds("pcie4,eth25", 1) == pytest.approx(seconds("pcie4,eth25", 4))


OWN_MODEL = """import math
from torch import nn


class Net(nn.Module):
    def __init__(self, *, num_classes, input_shape, width=32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(), nn.Linear(width, num_classes)
        )

    def forward(self, x):
        return self.body(x)
"""


def test_the_prediction_tools_rebuild_a_model_of_your_own(tmp_path: Path, monkeypatch, capsys):
    """#50 item 16: a run of model._target_=ownmodel.Net (its module beside the run) is rebuilt by
    ddpexp-predict started there, as ddpexp ran it; started elsewhere it says in one line, first, that
    the model's code does not import and how to fix it, instead of Hydra's raw lines and a flat tensor
    mentioned only under the table. python -m ddpexp.predict.memory drops the replaced option's
    settings, as ddpexp does, and answers --help."""
    import sys

    from ddpexp.predict import memory
    from ddpexp.predict.cli import main as predict_main

    from .conftest import run_here

    home = tmp_path / "home"
    home.mkdir()
    (home / "ownmodel.py").write_text(OWN_MODEL)
    args = ["model._target_=ownmodel.Net", "trainer.max_steps=2", "trainer.epochs=1", "hydra.run.dir=run"]
    result = run_here(home, *args, "trainer.progress=false")
    assert result.returncode == 0, result
    sys.modules.pop("ownmodel", None)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(home))])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert predict_main([str(home / "run"), "--interconnect", "localhost_gloo"]) == 0
    out = capsys.readouterr()
    assert out.err.splitlines()[0].startswith("ddpexp-predict: model taken as one flat tensor")
    assert "ownmodel.Net, does not import here" in out.err and "directory the run was started in" in out.err
    assert "Error getting callable" not in out.out + out.err
    monkeypatch.chdir(home)
    assert predict_main([str(home / "run"), "--interconnect", "localhost_gloo"]) == 0
    out = capsys.readouterr()
    assert "flat tensor" not in out.out + out.err
    assert memory.main(["model._target_=ownmodel.Net"]) == 0
    out = capsys.readouterr()
    assert "memory per rank predicted" in out.out and "error" not in out.err
    assert (
        memory.main(["--help"]) == 0 and "usage: python -m ddpexp.predict.memory" in capsys.readouterr().out
    )
    sys.modules.pop("ownmodel", None)

"""The collective benchmark (`python -m ddpexp.commbench`): a smoke run of what the command runs, at
W=2 on gloo records every op at doubling sizes with nccl-tests' bandwidths; the bus factors and the
alpha-beta fit are checked against their formulas and synthetic times; bad settings are refused in
one line before anything starts; and a collective that returns wrong data fails the run instead of
giving a number."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.distributed as dist

from ddpexp.commbench import Op, bus_factor, fit_alpha_beta, sizes
from ddpexp.commbench.cli import CONFIG_NAME
from ddpexp.commbench.cli import main as commbench_main

from .conftest import run_here, start_ranks

# nccl-tests' bus factors, written out here rather than taken from the code under test; in the order
# the benchmark measures the ops by default.
FACTORS = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "broadcast": lambda w: 1.0,
    "all_to_all": lambda w: (w - 1) / w,
    "sendrecv": lambda w: 1.0,
}


@pytest.mark.multiproc
def test_a_smoke_run_records_every_op_at_doubling_sizes_with_nccl_tests_bandwidths(tmp_path: Path):
    # the command exists; the run itself goes through what it calls after its help, in this process
    entry = subprocess.run([sys.executable, "-m", "ddpexp.commbench", "-h"], capture_output=True, text=True)
    assert entry.returncode == 0 and entry.stdout.startswith("ddpexp.commbench: "), entry.stderr[-3000:]
    args = ["backend=gloo", "dist.nprocs=2", "commbench.smoke=true", "hydra.run.dir=run"]
    result = run_here(tmp_path, "--config-name", CONFIG_NAME, *args)
    assert result.returncode == 0, result
    run = tmp_path / "run"
    record = json.loads((run / "commbench.json").read_text())
    facts = record["facts"]
    assert {k: facts[k] for k in ("backend", "world_size", "nnodes", "nprocs_per_node", "device_type")} == {
        "backend": "gloo",
        "world_size": 2,
        "nnodes": 1,
        "nprocs_per_node": 2,
        "device_type": "cpu",
    }
    assert set(facts) == {
        "backend",
        "world_size",
        "nnodes",
        "nprocs_per_node",
        "device_type",
        "host",
        "torch",
        "started_at",
    }
    results = record["results"]
    assert [r["op"] for r in results] == sorted((r["op"] for r in results), key=list(FACTORS).index)
    assert {r["op"] for r in results} == set(FACTORS)
    for op, factor in FACTORS.items():
        rows = [r for r in results if r["op"] == op]
        sizes_seen = [r["bytes"] for r in rows]
        # 4 bytes (one float) up to smoke mode's 64 KiB; the ops that split their buffer over the 2 ranks
        # start at one float per rank.
        first = 8 if op in ("all_gather", "reduce_scatter", "all_to_all") else 4
        assert sizes_seen[0] == first and sizes_seen[-1] == 64 * 2**10, (op, sizes_seen)
        assert all(b == 2 * a for a, b in itertools.pairwise(sizes_seen)), (op, sizes_seen)
        for r in rows:
            assert r["time_s"] > 0 and r["iters"] == 3
            assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-12)
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor(2), rel=1e-12)
    assert set(record["fits"]) == set(FACTORS)
    for fit in record["fits"].values():
        assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0
        assert 0 <= fit["rel_error_mean"] <= fit["rel_error_max"]
    assert (run / "commbench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [line.split() for line in result.stdout.splitlines()]
    assert ["all_to_all", "65536"] in [line[:2] for line in table]  # the table reached the console
    assert (run / "config.yaml").exists() and (run / "logs" / "rank1.log").exists()


@pytest.mark.multiproc
def test_after_compute_each_call_follows_a_burst_and_the_bursts_stretch_is_recorded(tmp_path: Path):
    """commbench.after_compute_ms: each timed call comes after that much compute on every rank (what
    the cost model needs: a collective after a backward costs more than back to back on a CPU host),
    and the burst's time with both ranks computing against one rank alone is recorded."""
    args = ["backend=gloo", "dist.nprocs=2", "trainer.threads=1", "commbench.smoke=true", "hydra.run.dir=run"]
    args += ["commbench.ops=[all_reduce]", "commbench.after_compute_ms=3"]
    result = run_here(tmp_path, "--config-name", CONFIG_NAME, *args)
    assert result.returncode == 0, result
    record = json.loads((tmp_path / "run" / "commbench.json").read_text())
    assert record["facts"]["after_compute_ms"] == 3 and record["facts"]["threads"] == 1
    compute = record["compute"]
    assert compute["alone_s"] > 1.5e-3  # the burst was counted to take about the time asked, alone
    assert compute["stretch"] == pytest.approx(compute["together_s"] / compute["alone_s"])
    rows = record["results"]
    assert rows and all(r["compute_s"] > 0 and r["time_s"] > 0 for r in rows)
    assert "all_reduce" in record["fits"]
    assert "each call after 3 ms of compute" in result.stdout and "stretch" in result.stdout


@pytest.mark.parametrize("world", [2, 3, 4, 8, 64])
def test_bus_factors_are_nccl_tests_formulas(world: int):
    for op, formula in FACTORS.items():
        assert bus_factor(op, world) == pytest.approx(formula(world), rel=1e-15), (op, world)
        assert bus_factor(str(op), world) == bus_factor(Op(op), world)  # a name or the enum alike
    assert bus_factor(Op.all_reduce, 4) == 1.5 and bus_factor(Op.all_gather, 4) == 0.75  # by hand


def test_on_one_rank_no_byte_crosses_a_link_but_a_sendrecv_still_sends_one_message():
    """The edge cases of the one bus_factor (the benchmark's and the cost model's): at W=1 every
    collective's factor is 0, broadcast's too (nccl-tests keeps 1 there, but the benchmark refuses one
    rank, and a cost model must not charge a one-rank broadcast); sendrecv is 1 at any W; a world
    below 1 or an unknown op is an error, not a number."""
    for op in Op:
        assert bus_factor(op, 1) == (1.0 if op == Op.sendrecv else 0.0), op
    for world in (0, -2):
        with pytest.raises(ValueError, match="world size"):
            bus_factor(Op.all_reduce, world)
    with pytest.raises(ValueError):
        bus_factor("all_reduce_coalesced", 4)


def test_the_cost_models_collectives_are_the_benchmarks_ops():
    """One vocabulary: what strategies describe their communication with is commbench's Op."""
    from ddpexp.strategies.comm import COLLECTIVE_OPS, Collective

    assert tuple(op.value for op in Op) == COLLECTIVE_OPS and list(FACTORS) == list(COLLECTIVE_OPS)
    assert all(type(op) is str for op in COLLECTIVE_OPS)
    with pytest.raises(ValueError, match="unknown collective"):
        Collective("x", "gather", 1.0, 2)


def test_sizes_round_to_whole_parts_per_rank_and_are_measured_once():
    assert sizes("all_reduce", min_bytes=4, max_bytes=64, world=3, itemsize=4) == [4, 8, 16, 32, 64]
    # One float per rank at least, then multiples of 3 floats; 8 and 16 bytes round to the same 12.
    assert sizes("all_gather", min_bytes=4, max_bytes=64, world=3, itemsize=4) == [12, 24, 60]
    assert sizes("sendrecv", min_bytes=1, max_bytes=8, world=2, itemsize=4) == [4, 8]


SIZES = [4 * 2**k for k in range(25)]  # 4 bytes .. 64 MiB, as the default settings measure


def test_the_fit_recovers_alpha_and_beta_from_exact_times():
    alpha, beta = 30e-6, 1 / 2.5e9
    fit = fit_alpha_beta(SIZES, [alpha + n * beta for n in SIZES])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    assert fit.rel_error_max < 1e-9 and fit.time_s(2**20) == pytest.approx(alpha + 2**20 * beta)


def test_the_fit_weighs_small_sizes_as_much_as_large_ones_and_reports_its_error():
    """5% noise on every time: a fit on absolute error would follow the large sizes' noise (5% of
    27 ms is 45x alpha) and lose alpha; the fit on relative error keeps both within a few percent."""
    alpha, beta = 30e-6, 1 / 2.5e9
    noise = [0.05 if i % 2 else -0.05 for i in range(len(SIZES))]
    times = [(alpha + n * beta) * (1 + e) for n, e in zip(SIZES, noise, strict=True)]
    fit = fit_alpha_beta(SIZES, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.05)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.05)
    errors = [abs(fit.time_s(n) - t) / t for n, t in zip(SIZES, times, strict=True)]
    assert fit.rel_error_max == pytest.approx(max(errors)) and 0.03 < fit.rel_error_max < 0.1
    assert fit.rel_error_mean == pytest.approx(math.fsum(errors) / len(errors))
    # Times that fall with size have no positive beta: all latency, never a negative bandwidth.
    flat = fit_alpha_beta([4, 8, 16], [3e-5, 2e-5, 1e-5])
    assert flat.beta_s_per_byte == 0 and flat.alpha_s > 0


REFUSALS = [
    # (overrides, words the one-line error must contain)
    (["commbench.min_bytes=1024", "commbench.max_bytes=512"], ["commbench.max_bytes", "512", "1024"]),
    (["commbench.ops=[all_reduce,allreduce]"], ["commbench.ops", "allreduce", "all_reduce, all_gather"]),
    (["dist.nprocs=1"], ["dist.nprocs", "one process", "dist.nprocs=2"]),
    (["strategy=single"], ["strategy", "single", "process group"]),
    (["commbench.iters=0"], ["commbench.iters", "positive"]),
    (["commbench.after_compute_ms=-1"], ["commbench.after_compute_ms", "between 0 and"]),
]


@pytest.mark.parametrize(("args", "words"), REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_bad_settings_are_refused_in_one_line_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args, words
):
    monkeypatch.chdir(tmp_path)
    before = set(psutil.Process().children())
    with pytest.raises(SystemExit) as exited:
        commbench_main(["backend=gloo", *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpexp: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert set(psutil.Process().children()) <= before and list(tmp_path.iterdir()) == []


def _check_every_op(rank: int, tmp: str, broken: bool) -> None:
    from ddpexp.commbench import bench

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=2)
    ctx = SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
    if broken:  # an all-reduce that returns at once, leaving each rank's own data: fast and wrong
        dist.all_reduce = lambda tensor, *args, **kwargs: None
    outcome = {}
    for op in Op:
        case = bench.Case.build(op, 2 * 5, ctx=ctx, dtype=torch.float32)  # type: ignore[arg-type]
        try:
            bench.verify(case, op=op, nbytes=40)
            outcome[str(op)] = "ok"
        except bench.WrongResult as exc:
            outcome[str(op)] = str(exc)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("broken", [False, True], ids=["correct", "broken_all_reduce"])
def test_each_op_is_checked_and_a_collective_returning_wrong_data_fails(tmp_path: Path, broken: bool):
    start_ranks(_check_every_op, (str(tmp_path), broken), nprocs=2)
    for rank in range(2):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        wrong = {op for op, said in outcome.items() if said != "ok"}
        assert wrong == ({"all_reduce"} if broken else set()), outcome
        if broken:
            assert "wrong results on rank(s) 0, 1" in outcome["all_reduce"]

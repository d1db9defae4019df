"""The measuring scripts run end to end: the benchmark (smoke mode: tiny, no timing claims) and the
cost model's validation against measured runs (two small rounds)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddpexp.predict import validation

from .conftest import REPO, start_ranks

# A script's own time limit (SCRIPT_TIMEOUT_S, a guard against a hang: scripts have no event to wait
# on) sits inside pytest's for the test, so a script slowed by a busy machine fails with its own
# output, not killed mid-way by pytest-timeout (which cut the transformer smoke test at 300 s).
SCRIPT_TIMEOUT_S = 1200
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(SCRIPT_TIMEOUT_S + 300)]


def script_output(name: str, *args: str, timeout: float = SCRIPT_TIMEOUT_S) -> list[str]:
    """The lines scripts/<name> prints, run from the repository as the README runs it; it must succeed."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_benchmark_smoke_prints_a_row_per_strategy():
    lines = script_output("bench.py", "--smoke")
    speeds = lines[1 : lines.index("")]
    assert lines[0] == "samples/s" and speeds[0].split()[:4] == [
        "model",
        "strategy",
        "ddpexp:device",
        "ddpexp:loader",
    ]
    assert [r.split()[:2] for r in speeds[1:]] == [["mlp", "single"], ["mlp", "ddp"]]
    ratios = lines[lines.index("ratios and costs") + 1 :]
    head = ratios[0].split()
    assert head[2:6] == ["loader/loader", "device/index", "device/loader", "device/bare"]
    for row in (r.split() for r in ratios[1:3]):
        values = dict(zip(head, row, strict=True))
        assert float(values["device/index"]) > 0
        assert float(values["start_s"]) > 0 and float(values["peak_MB"].replace(",", "")) > 0
    single = dict(zip(head, ratios[1].split(), strict=True))
    assert float(single["loader/loader"]) > 0 and float(single["device/bare"]) > 0  # every variant ran
    overhead = lines[lines.index(next(ln for ln in lines if ln.startswith("loop overhead"))) + 1].split()
    assert overhead[0] == "mlp" and float(overhead[overhead.index("=") + 1]) > 0
    assert float(overhead[overhead.index("ddpexp", 1) + 1].rstrip(",")) > 0  # ddpexp vs bare
    assert float(overhead[overhead.index("hand", 1) + 1].rstrip(";")) > 0  # hand vs bare
    assert float(overhead[overhead.index("loop") + 1].rstrip(",")) > 0  # ddpexp vs the DataLoader loop
    assert float(overhead[-1]) > 0  # ddpexp's own DataLoader path vs that loop
    ddp = lines[lines.index(next(ln for ln in lines if ln.startswith("ddp loop overhead"))) + 1].split()
    assert ddp[0] == "mlp" and float(ddp[ddp.index("=") + 1]) > 0  # the default: comm time sampled
    assert float(ddp[-3]) > 0 and float(ddp[-1]) > 0  # comm timed every step; meter off


def test_transformer_benchmark_smoke_compares_ddpexp_with_its_twin_for_each_strategy():
    """docs/performance.md's `bench.py --transformer` (its block is "run by" this file), with --smoke:
    ddpexp and scripts/plain_gpt.py (plain PyTorch, DDP, FSDP2) train gpt_tiny, one pair of processes
    per strategy. Its rows parse, and the twin trained what ddpexp trained: the same per-epoch training
    losses (the same model, initial weights, batches and AdamW steps), so the speeds compare like for
    like. Nothing here is about speed."""
    page = (REPO / "docs/performance.md").read_text()
    # The block under this file's marker (the page also shows the command for a GPU, not run here).
    blocks = [part.split("```")[1] for part in page.split("<!-- test: run by tests/test_bench.py -->")[1:]]
    lines = [ln for block in blocks for ln in block.splitlines()]
    (line,) = [ln for ln in lines if ln.startswith("python scripts/bench.py --transformer")]
    name, *args = shlex.split(line.partition("#")[0])[1:]
    lines = script_output(Path(name).name, *args, "--smoke")
    assert lines[0].startswith("tokens/s, gpt_tiny: global batch 16 x 64 tokens")
    head = lines[1].split()
    assert head[:4] == ["strategy", "ddpexp", "twin", "ddpexp/twin"]
    rows = {line.split()[0]: dict(zip(head, line.split(), strict=True)) for line in lines[2:5]}
    assert list(rows) == ["single", "ddp", "fsdp"]
    for row in rows.values():
        number = {k: float(v.replace(",", "")) for k, v in row.items() if k not in ("strategy", "load")}
        assert number["ddpexp"] > 0 and number["twin"] > 0
        assert number["pair_min"] <= number["ddpexp/twin"] <= number["pair_max"]
        assert number["start_s"] > 0 and number["peak_MB"] > 0 and number["twin_MB"] > 0
        assert number["loss_gap"] < 1e-5, row  # FSDP and DDP reduce as their twins do: the same sums
        low, high = (float(v) for v in row["load"].split("-"))
        assert 0 <= low <= high
    assert lines[5].startswith("(median of 1 pairs of processes")
    assert lines[7].startswith("in turn inside the same processes (scripts/gpt_overhead.py), 1 rounds")
    in_turn = [line.split() for line in lines[8:11]]
    assert [row[0] for row in in_turn] == ["single", "ddp", "fsdp"]
    for row in in_turn:  # strategy, ddpexp / twin = ratio (min-max)  loss_gap g  load a-b
        ours, twin, ratio = (float(row[i].replace(",", "")) for i in (1, 3, 5))
        assert ours > 0 and twin > 0 and ratio == pytest.approx(ours / twin, rel=1e-2)
        assert row[7] == "loss_gap" and float(row[8]) < 1e-5, row  # the same training, epoch by epoch


def _twins_rank(rank: int, ports: list[int], out_dir: str) -> None:
    """Both twins in one pair of processes (half the start-up of two plain_loop.py runs)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import plain_loop

    results = {}
    for strategy, port in zip(("fsdp", "zero"), ports, strict=True):
        args = argparse.Namespace(
            model="mlp", hidden=None, world=2, num_train=256, batch_size=64, epochs=1, loader="dataloader",
            strategy=strategy,
        )  # fmt: skip
        out: dict = {}
        plain_loop.train(rank, args, port, out)
        results[strategy] = out
    if rank == 0:
        Path(out_dir, "twins.json").write_text(json.dumps(results))


def test_plain_fsdp_and_zero_twins_train_the_same_model(tmp_path: Path):
    """bench.py's hand-written twins (plain_loop.py --strategy fsdp|zero, 2 gloo ranks) train what
    ddpexp's fsdp and zero train: the same SGD steps on the same batches from the same weights, so the
    trained models score the same loss (FSDP reduce-scatters where DDP all-reduces: equal to 1e-5)."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    start_ranks(_twins_rank, (ports, str(tmp_path)), nprocs=2)
    results = json.loads((tmp_path / "twins.json").read_text())
    for result in results.values():
        assert result["samples_per_s"] > 0 and result["peak_mb"] > 0
    assert results["fsdp"]["final_loss"] == pytest.approx(results["zero"]["final_loss"], rel=1e-5)


def test_predict_vs_measured_prints_the_model_against_two_rounds_of_runs(tmp_path: Path):
    """scripts/predict_vs_measured.py, as the README runs it but small: a single run and ddp at W=2
    and 3 per round, two rounds (medians, ranges, per-round errors), an interconnect profile instead of
    a commbench. Its bytes column must agree with the measured one: the cost model counts what DDP
    sends. W = 3 is also predicted calibrated on ddp's own run at 2."""
    lines = script_output(
        "predict_vs_measured.py",
        "--worlds=2,3",
        "--epochs=2",
        "--strategies=ddp",
        "--interconnect=localhost_gloo",
        "--repeats=2",
        f"--out={tmp_path / 'runs'}",
        f"--record={tmp_path / 'record.json'}",
        "--machine=the test's host",
    )
    assert lines[0].startswith("host: ") and lines[1].startswith("fabric: ")
    (row,) = [ln for ln in lines if ln.split()[:2] == ["ddp", "2"]]
    # W, predicted ms, measured median (min-max), error of the medians (each round's smallest to largest)
    shape = r"\s*ddp\s+2\s+[\d.]+\s+[\d.]+ \([\d.]+-[\d.]+\)\s+[+-]\d+% \([+-]\d+% to [+-]\d+%\)\s"
    assert re.match(shape, row), row
    bytes_pred, bytes_meas = (int(v.replace(",", "")) for v in row.split()[-6:-4])
    assert bytes_pred == bytes_meas == 116_536  # the ConvNet's gradients + DDP's buffer broadcast
    assert row.split()[-2:] == ["-", "-"]  # the calibration's own size is not predicted calibrated
    (at3,) = [ln for ln in lines if ln.split()[:2] == ["ddp", "3"]]
    assert re.fullmatch(r"[\d.]+ [+-]\d+%", " ".join(at3.split()[-2:])), at3
    (calibrated,) = [ln for ln in lines if ln.startswith("calibrated on each strategy's own run at W = 2")]
    assert "(2 predictions at the other sizes): |error| median " in calibrated
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == ["ddp-2-r0", "ddp-2-r1", "ddp-3-r0", "ddp-3-r1", "single-r0", "single-r1"]
    # The record the planner's ranges come from: each round's prediction against its measurement.
    record = validation.load(tmp_path / "record.json")
    cases = [(c.strategy, c.world, c.round) for c in record.cases]
    assert cases == [("ddp", 2, 0), ("ddp", 3, 0), ("ddp", 2, 1), ("ddp", 3, 1)]
    assert record.machine == "the test's host" and "--repeats=2" in record.command
    low, high = (f"{v:+.0%}" for v in sorted((1 / c.ratio - 1) for c in record.cases if c.world == 2))
    assert f"({low} to {high})" in row  # the same errors the table printed


def test_activation_checkpointing_benchmark_prints_memory_and_time_against_none():
    lines = script_output("ac_bench.py", "--smoke")
    assert lines[1].split() == ["strategy", "mode", "act_MB", "step_s", "act/none", "step/none"]
    rows = {row.split()[1]: row.split() for row in lines[2:]}
    assert list(rows) == ["none", "full", "selective"]
    assert float(rows["none"][4]) == 1.0  # against itself
    assert float(rows["full"][4]) < 1.0 and float(rows["full"][2]) < float(rows["none"][2])
    assert float(rows["full"][5]) > 0  # a time ratio, whatever it is on a busy machine


def test_the_gpu_check_runs_its_path_on_a_cpu_and_keeps_every_number(tmp_path: Path):
    """scripts/on_gpu.py (docs/memory_model.md's GPU table) on a CPU: each case's run, its prediction
    and the table; the categories a run measures are what the prediction says."""
    out = tmp_path / "gpu.json"
    lines = script_output(
        "on_gpu.py", "--device", "cpu", "--only", "gpt_small fp32", "--steps", "1",
        "--out", str(tmp_path / "runs"), "--json", str(out),
    )  # fmt: skip
    assert lines[-2].split()[:3] == ["case", "step", "ms"], lines
    (row,) = json.loads(out.read_text())["rows"]
    assert row["case"] == "gpt_small fp32 b16x128" and row["tokens_per_s"] > 0, row
    for key in ("mem/params_mb", "mem/grads_mb", "mem/optim_state_mb", "mem/activations_mb"):
        assert row[key]["predicted"] == pytest.approx(row[key]["measured"], rel=1e-3), key
    assert (
        row["peak_mb"]["predicted"] > row["mem/activations_mb"]["predicted"] + row["predicted_transient_mb"]
    )


def test_busy_host_smoke_prints_every_contender_idle_and_busy():
    lines = script_output("busy_host.py", "--smoke")
    assert lines[1].split() == ["contender", "idle", "busy", "busy/idle"]
    rows = [line for line in lines[2:] if not line.startswith("host:")]
    assert [r.rsplit(maxsplit=5)[0] for r in rows] == [
        "single",
        "single, spin",
        "single, 1 thread",
        "ddp, 2 ranks",
        "single, ddpexp.run",
        "single, torch first",
    ]

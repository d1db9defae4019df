"""The benchmark script runs end to end (smoke mode: tiny, no timing claims)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.multiproc


def test_benchmark_smoke_prints_a_row_per_strategy():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
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
    assert float(overhead[-1]) > 0  # ddpexp vs the DataLoader loop

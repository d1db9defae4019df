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
    assert lines[0].split()[:5] == ["model", "strategy", "ddpexp/s", "plain/s", "ratio"]
    rows = [ln.split() for ln in lines[1:] if ln.startswith("mlp")]
    assert [r[1] for r in rows] == ["single", "ddp"]
    for r in rows:
        assert float(r[2].replace(",", "")) > 0 and float(r[4]) > 0

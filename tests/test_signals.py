"""Stopping a run from outside: Ctrl-C / SIGTERM to the launcher stop every worker and mark the run
interrupted; a launcher killed outright takes its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .conftest import QUICK, metrics

pytestmark = pytest.mark.multiproc


def _start_long_ddp_run(cwd: Path) -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    cmd = [sys.executable, "-m", "ddpexp", "strategy=ddp", *QUICK, "trainer.epochs=500", "hydra.run.dir=run"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline:  # until training is under way
        if (cwd / "run" / "metrics.json").exists() and metrics(cwd / "run")["history"]:
            break
        time.sleep(0.2)
    workers = [p for p in psutil.Process(launcher.pid).children() if "ddpexp.worker" in " ".join(p.cmdline())]
    assert len(workers) == 2
    return launcher, workers


def _all_gone(procs: list[psutil.Process], timeout: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_stops_every_worker(tmp_path: Path, sig: int, code: int):
    launcher, workers = _start_long_ddp_run(tmp_path)
    try:
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == code, err
    assert _all_gone(workers, timeout=10)
    m = metrics(tmp_path / "run")
    assert m["status"] == "interrupted"
    assert m["history"]  # what was recorded before the signal is still there


def test_a_killed_launcher_takes_its_workers_with_it(tmp_path: Path):
    launcher, workers = _start_long_ddp_run(tmp_path)
    try:
        launcher.kill()  # SIGKILL: no handler runs in the launcher
        launcher.wait(timeout=30)
        assert _all_gone(workers, timeout=15)
    finally:
        for w in workers:
            if w.is_running():
                w.kill()

"""What the fault-injection suite (tests/test_faults*.py) runs its cases with: a ddpexp command started in
the background with every process of its tree recorded (`Watched`), and an autouse fixture that kills
whatever a case started and left running, after its assertions. A test module uses it with
`from .fault_harness import _nothing_outlives_its_test  # noqa: F401` (pytest finds fixtures by name in
the module)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from ddpexp import checkpoint
from ddpexp.launch.rendezvous import free_port, port_is_free

from .conftest import QUICK, metrics

LONG = [*QUICK, "trainer.epochs=500", "checkpoint.every_steps=5", "hydra.run.dir=run"]
WATCHED: list[Watched] = []


@pytest.fixture(autouse=True)
def _nothing_outlives_its_test():
    """After each test (its assertions done), kill what it started and left running: a failing case
    must not leave a sweep running into the next ones (a timed-out one did, for 20 minutes)."""
    before = set(psutil.Process().children(recursive=True))
    yield
    left = set(psutil.Process().children(recursive=True)) - before
    # multiprocessing's resource tracker, started on first use by this pytest process (or xdist
    # worker), is meant to outlive the test that started it
    left = {p for p in left if "resource_tracker" not in " ".join(_cmdline(p))}
    for run in WATCHED:
        left |= {p for p in run.seen.values() if not _gone(p)}
    WATCHED.clear()
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()


class Watched:
    """A ddpexp command started in the background, with every process of its tree recorded."""

    def __init__(
        self,
        cwd: Path,
        args: list[str],
        *,
        fault: str | None = None,
        torchrun: bool = False,
        restarts: int = 1,  # torchrun's --max-restarts
    ) -> None:
        self.cwd = cwd
        self.port = free_port("127.0.0.1")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if fault:
            env["DDPEXP_FAULT"] = fault
        if torchrun:
            prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
            cmd = [*prefix, "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}"]
            cmd += [f"--max-restarts={restarts}", "-m", "ddpexp", *args]
        else:
            cmd = [sys.executable, "-m", "ddpexp", *args, f"dist.master_port={self.port}"]
        self.started = time.time()
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.seen: dict[int, psutil.Process] = {}
        self.rank_of: dict[int, str] = {}  # worker pid -> its rank, read while it was alive
        self.gone_at: dict[int, float] = {}
        self._watching = True
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        WATCHED.append(self)

    def _watch(self) -> None:
        root = psutil.Process(self.proc.pid)
        while self._watching:
            try:
                for p in root.children(recursive=True):
                    self.seen.setdefault(p.pid, p)
                    if p.pid not in self.rank_of:  # a worker names itself ddpexp-rank<N> as it starts
                        self._note_rank(p)
            except psutil.NoSuchProcess:
                pass
            now = time.time()
            for pid, p in self.seen.items():
                if pid not in self.gone_at and _gone(p):
                    self.gone_at[pid] = now
            time.sleep(0.05)

    def _note_rank(self, p: psutil.Process) -> None:
        """Workers show up as ddpexp-rank<N>. A worker's short-lived child (a shell an import runs, say)
        carries that name between fork and exec, so a process whose parent is a worker is not one."""
        try:
            name = p.name()
            if name.startswith("ddpexp-rank") and not p.parent().name().startswith("ddpexp-rank"):
                self.rank_of[p.pid] = name.removeprefix("ddpexp-rank")
        except psutil.Error:
            pass

    def ranks_seen(self) -> set[str]:
        return set(self.rank_of.values())

    def exit_time_of_rank(self, rank: int) -> float:
        (pid,) = [pid for pid, r in self.rank_of.items() if r == str(rank)]
        return self.gone_at[pid]

    def wait_until_training(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            path = self.cwd / "run" / "metrics.json"
            if (
                path.exists()
                and metrics(self.cwd / "run")["history"]
                and (self.cwd / "run/checkpoints").is_dir()
            ):
                return
            time.sleep(0.2)
        raise AssertionError("training never got under way")

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            self.proc.kill()
            self.ended = time.time()
            time.sleep(0.2)
            self._watching = False
            self._thread.join()
        return self.proc.returncode, out, err

    def assert_nothing_left(self) -> None:
        """No process of the run survives; the rendezvous port can be bound again."""
        procs = list(self.seen.values())
        assert procs, "no process of the run was ever seen"
        _, alive = psutil.wait_procs(procs, timeout=10)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, _cmdline(p)) for p in alive]
        assert port_is_free("127.0.0.1", self.port)


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # it went between the two questions
        return True


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def last_checkpoint_step(run_dir: Path) -> int:
    """The step trainer.resume=auto continues from: a kill between writing a step file and pointing
    last.pt at it leaves last.pt one checkpoint behind."""
    found = checkpoint.newest_valid(run_dir)
    assert found is not None, f"no valid checkpoint in {run_dir}"
    return found[1]["step"]


def pid_of_rank(run: Watched, rank: int, timeout: float = 30) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [pid for pid, r in run.rank_of.items() if r == str(rank)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never showed up")


def run_dirs(sweep: Path) -> list[Path]:
    return [p.parent for p in sweep.glob("*/metrics.json")]

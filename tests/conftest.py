"""Helpers that drive ddpexp the way a user does: through its command line, in a scratch directory."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# As the command line does before torch loads (ddpexp/host.py quiet_waits): in-process runs of the
# tests are then what they are from the command line, not spawned for spinning OpenMP threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from .tiers import (  # noqa: F401 (pytest_addoption and pytest_configure: hooks pytest finds here)
    load_record,
    longest_files_first,
    mark_fast,
    pytest_addoption,
    pytest_configure,
    show_timeouts,
)

REPO = Path(__file__).resolve().parents[1]

# A shell that starts a command in the background without job control (`make test &` in a script)
# starts it with SIGINT ignored, and every process it starts inherits that: the tests that send
# SIGINT to a run (as Ctrl-C would) would see it ignored. A handled signal is reset on exec, so the
# processes the tests start get SIGINT's default, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Small, fast, BatchNorm-free experiment used by the multi-process tests.
QUICK = ["model=mlp", "data=synthetic", "trainer.progress=false"]
# QUICK with checkpoints every 20 steps; 32 steps per epoch at batch 64, so step 45 is mid-epoch 2.
RESUME = [*QUICK, "checkpoint.every_steps=20", "optim.lr=0.05"]
# The parity experiment: every strategy trains STEPS steps at the same global batch (see parity_sweep).
STEPS = 5
PARITY = [*QUICK, f"trainer.max_steps={STEPS}", "trainer.batch_size=64"]
PARITY_STRATEGIES = ["single", "dp", "ddp", "ddp_mp", "naive_allreduce"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    record = load_record()
    longest_files_first(items, record)
    mark_fast(items, record)
    show_timeouts(items)


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str, cwd: Path) -> None:
        self.cwd = cwd
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr

    def __repr__(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"

    def run_dirs(self) -> list[Path]:
        """Every directory holding a config.yaml under the scratch directory: one per job."""
        return sorted(p.parent for p in self.cwd.rglob("config.yaml") if ".hydra" not in p.parts)


def run_ddpexp(
    cwd: Path,
    *args: str,
    launcher: list[str] | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> Result:
    cmd = [*(launcher or [sys.executable, "-m"]), "ddpexp", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return Result(proc.returncode, proc.stdout, proc.stderr, cwd)


def run_here(cwd: Path, *args: str) -> Result:
    """The command line, run in this process (`ddpexp.cli.main`): what a subprocess would do, without
    paying ~3 s to start Python and import torch again. Workers of multi-process strategies are still
    real processes. For what needs a process of its own (signals, exit codes of the interpreter, the
    process tree), use run_ddpexp. `ddpexp plan` runs in a process of its own: its predictions split
    models over a fake process group, and DTensor state left in this process by earlier tests has
    made a later prediction send on a mesh whose groups were gone."""
    if args and args[0] == "plan":
        return run_ddpexp(cwd, *args, timeout=900)
    from ddpexp import cli

    out, err = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(list(args))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(previous)
    return Result(code, out.getvalue(), err.getvalue(), cwd)


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """fn(rank, *args) in nprocs processes forked from the forkserver ddpexp's own workers come from
    (one per pytest process, torch already imported), as torch.multiprocessing.start_processes would
    with spawn, less a fresh interpreter and `import torch` per rank (about 5 s of CPU each)."""
    from ddpexp.launch import warmup

    warmup.forkserver_context()
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def metrics(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "metrics.json").read_text())


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar a run wrote: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture
def hydra_conf():
    """Hydra's compose API on ddpexp's own config tree, with the schema registered."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ddpexp.composition import conf_dir, register_schema

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


@pytest.fixture(autouse=True)
def no_prediction_process_group() -> Iterator[None]:
    """A memory prediction leaves its fake process group in this process for the next prediction
    (predict/memory.py); a later test on the same pytest-xdist worker that starts a process group of
    its own (world_of_one) then found one in force. Each test ends without it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


@pytest.fixture
def world_of_one(tmp_path: Path):
    """A gloo process group of one rank in this process, for in-process tests of collective code."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def made_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A directory `make` fills once per test session, shared by every pytest-xdist worker: the first
    to ask makes it while the others wait on a lock, instead of each worker training it again."""
    base = factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, above gw0..
    made = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (made / ".made").exists():
            shutil.rmtree(made, ignore_errors=True)  # what a worker that failed left
            made.mkdir()
            make(made)
            (made / ".made").touch()
    return made


@pytest.fixture(scope="session")
def parity_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every shipped strategy on the PARITY experiment, one sweep, made once per session: the reference
    that other strategies and settings (accumulation, bucketing, init methods, launchers) must match."""

    def make(cwd: Path) -> None:
        result = run_here(
            cwd, "-m", f"strategy={','.join(PARITY_STRATEGIES)}", *PARITY, "hydra.sweep.dir=sweep"
        )
        assert result.returncode == 0, result

    return made_once(tmp_path_factory, "parity", make) / "sweep"


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    """`uninterrupted(strategy)`: the run dir of an uninterrupted 70-step RESUME run, made once per
    session; runs that were stopped, killed or restarted on the way to step 70 must end identical."""

    def get(strategy: str) -> Path:
        def make(cwd: Path) -> None:
            result = run_here(
                cwd, f"strategy={strategy}", *RESUME, "trainer.max_steps=70", "hydra.run.dir=run"
            )
            assert result.returncode == 0, result

        return made_once(tmp_path_factory, f"uninterrupted-{strategy}", make) / "run"

    return get


def same_weights(a: Path, b: Path) -> bool:
    """Whether two runs' final model.pt files are bitwise equal."""
    import torch

    wa, wb = (torch.load(d / "model.pt", weights_only=True) for d in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(v, wb[k]) for k, v in wa.items())


def scored_by_single(cwd: Path, run_dir: Path) -> dict[str, Any]:
    """The final metrics of `strategy=single` evaluating `run_dir`'s last checkpoint (in cwd/eval):
    every strategy's checkpoint is the common full state, which a plain model scores identically."""
    last = run_dir / "checkpoints" / "last.pt"
    result = run_here(
        cwd, "strategy=single", *RESUME, "trainer.mode=eval", f'trainer.resume="{last}"', "hydra.run.dir=eval"
    )
    assert result.returncode == 0, result
    return metrics(cwd / "eval")["final"]


# Float tolerance for "the same weights": sums over ranks, micro-batches or shards in another order
# than one process adds them.
TOLERANCE: dict[str, float] = {"rtol": 1e-5, "atol": 1e-6}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_close_weights(a: Path, b: Path) -> None:
    """The two runs' model.pt hold the same tensors within TOLERANCE. A control shows the check can
    fail: a change of 1e-4 in one element, far less than one SGD step moves it, is caught."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name, value in wa.items():
        torch.testing.assert_close(value, wb[name], **TOLERANCE, msg=name)
    name, value = next(iter(wa.items()))
    nudged = value.clone()
    nudged.view(-1)[0] += 1e-4
    with pytest.raises(AssertionError):
        torch.testing.assert_close(nudged, wb[name], **TOLERANCE)

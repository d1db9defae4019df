"""The launcher's hang detection as pure logic: which rank is hung, and when (no processes needed); and
how a stop signal reaches the code it interrupts."""

from __future__ import annotations

import io
import json
import logging
import signal
from pathlib import Path

import pytest

from ddpexp import interrupts
from ddpexp.heartbeat import BEATS, SIZE, SLOW, Heartbeat, Pulse
from ddpexp.interrupts import Interrupted
from ddpexp.launch import blame
from ddpexp.launch.supervise import Supervisor, Watch, Worker, sigterm_raises


class _Running:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode = None

    def poll(self) -> None:
        return None


def _workers(n: int) -> tuple[list[Worker], list[list[float]]]:
    cells = [[0.0] * SIZE for _ in range(n)]
    workers = [
        Worker(rank=r, proc=_Running(2**22 + r), log_path=Path(f"/x/logs/rank{r}.log"), pulse=Pulse(c, 0.0))
        for r, c in enumerate(cells)
    ]
    return workers, cells


def _supervisor(workers: list[Worker]) -> Supervisor:
    return Supervisor(Path("/x"), workers, facts={}, watch=Watch(hang_s=10, patience_s=100))


def test_the_rank_whose_heartbeat_stopped_first_is_the_hung_one():
    workers, cells = _workers(2)
    sup = _supervisor(workers)
    for cell in cells:
        Heartbeat(cell).beat(4)
    assert sup._hung(workers, now=1.0) is None
    Heartbeat(cells[0]).beat(5)  # rank 0 goes on to wait for rank 1 a moment later
    assert sup._hung(workers, now=3.0) is None
    assert sup._hung(workers, now=10.5) is None  # rank 1 quiet for 9.5 s: not yet
    hang = sup._hung(workers, now=11.5)
    assert hang is not None and hang.worker.rank == 1 and hang.step == 5 and hang.quiet_s == 10.5


def test_of_ranks_that_stopped_together_the_one_still_in_its_own_forward_is_the_hung_one():
    """Rank 1's forward never returns; rank 0 passed its forward and waits for rank 1 in the gradients'
    all-reduce. Their last beats came together (rank 0's seen first, even), yet rank 1 is the one."""
    workers, cells = _workers(2)
    sup = _supervisor(workers)
    Heartbeat(cells[0]).beat(4)
    Heartbeat(cells[0]).forward_done()
    sup._hung(workers, now=0.0)
    Heartbeat(cells[1]).beat(4)
    sup._hung(workers, now=0.5)
    hang = sup._hung(workers, now=11.0)
    assert hang is not None and hang.worker.rank == 1


def test_a_rank_the_os_stopped_is_the_hung_one_even_when_its_peer_went_quiet_first(monkeypatch):
    """SIGSTOP rank 1 just after its beat; rank 0 had beaten a moment earlier and now waits for it in
    the all-reduce, both past their forwards. Rank 0 crosses hang_s first, yet rank 1 is the one (seen
    in CI under load: rank 0 was blamed)."""
    monkeypatch.setattr("ddpexp.launch.supervise.is_stopped", lambda pid: pid == 2**22 + 1)
    workers, cells = _workers(2)
    sup = _supervisor(workers)
    Heartbeat(cells[0]).beat(35)
    sup._hung(workers, now=0.0)
    Heartbeat(cells[1]).beat(35)
    for cell in cells:
        Heartbeat(cell).forward_done()
    sup._hung(workers, now=0.5)
    assert sup._hung(workers, now=10.2) is None  # wait for the stopped rank's own hang_s
    hang = sup._hung(workers, now=10.6)
    assert hang is not None and hang.worker.rank == 1 and hang.step == 36


def test_start_up_and_checkpoints_get_patience_not_the_hang_timeout():
    workers, cells = _workers(2)
    sup = _supervisor(workers)
    assert sup._hung(workers, now=50.0) is None  # no beat yet: start-up (data, compile, resume)
    for cell in cells:
        Heartbeat(cell).beat(1)
    sup._hung(workers, now=50.0)
    for cell in cells:
        cell[SLOW] = 1  # writing a checkpoint
    assert sup._hung(workers, now=90.0) is None
    assert sup._hung(workers, now=151.0) is not None
    assert cells[0][BEATS] == 1


def test_a_tie_the_stacks_cannot_break_names_every_rank_it_could_be(tmp_path: Path):
    """Equal progress and no stack to read (here: the processes are gone): no rank is picked silently."""
    workers, cells = _workers(2)
    for w in workers:
        w.log_path = tmp_path / "logs" / f"rank{w.rank}.log"
    sup = Supervisor(tmp_path, workers, facts={}, watch=Watch(hang_s=10, patience_s=100))
    for cell in cells:
        Heartbeat(cell).beat(56)
    sup._hung(workers, now=0.0)
    sup.hang = sup._hung(workers, now=12.0)
    cause = sup._root_cause()
    assert (cause.who, cause.user_error) == ("ranks 0 and 1", False)
    assert cause.summary == (
        "hung at step 57 (no progress for 12 s); which of them hung first cannot be told: no stack could "
        "be read, and they are equally far along; their stacks are in logs/rank0.log, logs/rank1.log"
    )


SITE = "/venv/lib/python3.11/site-packages"
STDLIB = f"{blame._STDLIB}/lib/python3.11"
WORKER_BASE = [  # the outer frames of every worker's main thread
    ("/src/ddpexp/engine/__init__.py", 215, "train_epoch"),
    ("/src/ddpexp/launch/worker.py", 260, "main"),
    (f"{STDLIB}/multiprocessing/forkserver.py", 274, "main"),
    ("<string>", 1, "<module>"),
]
OTHER_THREAD = [  # tensorboard's writer thread, say
    (f"{STDLIB}/threading.py", 331, "wait"),
    (f"{STDLIB}/queue.py", 180, "get"),
    (f"{STDLIB}/threading.py", 1002, "_bootstrap"),
]
HUNG_IN_OWN_CODE = [
    (f"{STDLIB}/threading.py", 327, "wait"),
    ("/src/tests/user_models.py", 72, "forward"),
    (f"{SITE}/torch/nn/modules/module.py", 1794, "_call_impl"),
    ("/src/ddpexp/engine/__init__.py", 343, "forward_backward"),
]
WAITING = {
    "ddp's all-reduce, inside the backward": [
        (f"{SITE}/torch/autograd/graph.py", 1072, "_engine_run_backward"),
        (f"{SITE}/torch/_tensor.py", 623, "backward"),
    ],
    "a tensor-parallel all-gather (under ddpexp's meter)": [
        (f"{SITE}/torch/_ops.py", 1350, "__call__"),
        (f"{SITE}/torch/distributed/_functional_collectives.py", 142, "wait_tensor"),
        ("/src/ddpexp/strategies/nd/tensor_parallel.py", 206, "__torch_dispatch__"),
    ],
    "a pipeline's receive": [
        (f"{SITE}/torch/distributed/pipelining/schedules.py", 849, "_wait_batch_p2p"),
        ("/src/ddpexp/strategies/pipeline/stage.py", 326, "train_step"),
    ],
    "ddpexp's own asynchronous collective": [
        ("/src/ddpexp/distributed.py", 70, "wait_for"),
        ("/src/ddpexp/strategies/naive_allreduce.py", 215, "_exchange"),
    ],
}


def _dump(main: list[tuple[str, int, str]], *, other: bool = True) -> str:
    """What faulthandler writes for a worker: other threads first, the main thread last."""

    def block(header: str, frames: list[tuple[str, int, str]]) -> str:
        return header + "".join(f'  File "{p}", line {n} in {f}\n' for p, n, f in frames)

    text = (
        block("Thread 0x00007f8d090526c0 (most recent call first):\n", OTHER_THREAD) + "\n" if other else ""
    )
    return (text if other else "") + block(
        "Current thread 0x00007f8ddb5ecb80 (most recent call first):\n", main + WORKER_BASE
    )


@pytest.mark.parametrize("case", list(WAITING))
def test_a_rank_waiting_for_its_peers_is_told_from_one_stuck_in_its_own_code(case: str):
    waiting = blame.where(blame.main_thread("log lines\n" + _dump(WAITING[case])))
    assert waiting.waiting, case
    hung = blame.where(blame.main_thread(_dump(HUNG_IN_OWN_CODE)))
    assert not hung.waiting and str(hung.frame) == "forward (/src/tests/user_models.py:72)"
    # a data read stuck in torch's loader is the rank's own business too
    reading = [(f"{SITE}/torch/utils/data/dataloader.py", 1200, "_next_data")]
    assert not blame.where(blame.main_thread(_dump(reading))).waiting


def test_only_a_whole_main_thread_is_read():
    text = _dump(HUNG_IN_OWN_CODE)
    assert blame.main_thread(text[: text.index("<module>")]) is None  # still being written
    assert blame.main_thread(_dump(HUNG_IN_OWN_CODE, other=False).replace("<module>", "run")) is None
    older, newer = _dump(WAITING["a pipeline's receive"]), _dump(HUNG_IN_OWN_CODE)
    frames = blame.main_thread(older + "\n" + newer)
    assert frames is not None and frames[1].path == "/src/tests/user_models.py"  # the last dump counts


def test_the_rank_in_its_own_code_is_blamed_whatever_the_counts_say(tmp_path: Path, monkeypatch):
    """Rank 1 hangs in a gradient hook (its forward returned, as rank 0's did): equal progress, but its
    stack is in its own code while rank 0's waits in the all-reduce."""
    workers, cells = _workers(2)
    for w in workers:
        w.log_path = tmp_path / "logs" / f"rank{w.rank}.log"
        w.log_path.parent.mkdir(exist_ok=True)
        w.log_path.write_text("earlier lines\n")
    stacks = {
        2**22: _dump(WAITING["ddp's all-reduce, inside the backward"]),
        2**22 + 1: _dump(HUNG_IN_OWN_CODE),
    }

    def kill(pid: int, sig: int) -> None:  # each rank's faulthandler answers into its log
        if sig == signal.SIGUSR2:
            with open(tmp_path / "logs" / f"rank{pid - 2**22}.log", "a") as f:
                f.write(stacks[pid])

    monkeypatch.setattr("ddpexp.launch.supervise.os.kill", kill)
    sup = Supervisor(tmp_path, workers, facts={}, watch=Watch(hang_s=10, patience_s=100))
    for cell in cells:
        Heartbeat(cell).beat(56)
        Heartbeat(cell).forward_done()
    sup._hung(workers, now=0.0)
    sup.hang = sup._hung(workers, now=12.0)
    cause = sup._root_cause()
    assert cause.who == "rank 1"
    assert cause.summary == (
        "hung at step 57 (no progress for 12 s): in forward (/src/tests/user_models.py:72), while every "
        "other rank waits in a collective; its stack is in logs/rank1.log, its peers' in theirs"
    )


@pytest.mark.parametrize(
    ("places", "progress", "blamed"),
    [
        (["wait", "own"], [3, 3], 1),
        (["own", "wait", "wait"], [5, 3, 3], 0),  # in its own code beats being behind
        (["own", "own"], [2, 3], 0),  # both in their own code: the one behind
        (["wait", "wait"], [3, 2], 1),  # every one waits: the one behind
        (["wait", "wait"], [3, 3], None),  # nothing tells them apart
        (["own", "own", "wait"], [3, 3, 1], None),
        ([None, None], [3, 3], None),
    ],
)
def test_the_verdict(places: list[str | None], progress: list[int], blamed: int | None):
    own = blame.Where(waiting=False, frame=None)
    wait = blame.Where(waiting=True, frame=None)
    suspects = [
        blame.Suspect(r, p, False, {"own": own, "wait": wait, None: None}[w])
        for r, (w, p) in enumerate(zip(places, progress, strict=True))
    ]
    verdict = blame.choose(suspects)
    assert verdict.rank == blamed
    if blamed is None:
        assert len(verdict.among) >= 2 and "equally far along" in verdict.reason
    stopped = [blame.Suspect(0, 1, False, own), blame.Suspect(1, 5, True, wait)]
    assert blame.choose(stopped).rank == 1  # the OS says which


class _Exited:
    def __init__(self, pid: int, code: int) -> None:
        self.pid = pid
        self.returncode = code

    def poll(self) -> int:
        return self.returncode


def test_a_rank_that_exits_without_a_record_is_the_cause_not_the_peer_that_recorded_the_reset(tmp_path: Path):
    """Rank 1 leaves by os._exit(3); rank 0's collective fails with "Connection reset by peer" and it
    records that (before the launcher, polling, has even seen rank 1 go). Rank 1 is the cause."""
    from ddpexp.launch.error_records import error_file

    workers = [
        Worker(rank=r, proc=_Exited(2**22 + r, code), log_path=tmp_path / f"rank{r}.log", exit_time=t)
        for r, (code, t) in enumerate([(1, 10.05), (3, 10.05)])
    ]
    error_file(tmp_path, 0).parent.mkdir()
    reset = {"rank": 0, "time": 10.01, "type": "RuntimeError", "message": "Connection reset by peer"}
    error_file(tmp_path, 0).write_text(json.dumps({**reset, "user_error": False, "traceback": ""}))
    sup = Supervisor(tmp_path, workers, facts={})
    sup.stopping_since = 10.06
    cause = sup._root_cause()
    assert (cause.who, cause.summary) == ("rank 1", "failed: exited with code 3")


def test_a_rank_s_own_error_beats_a_peer_s_lost_connection_recorded_before_it(tmp_path: Path):
    """Rank 0 runs out of disk writing a dp 2 x tp 2 checkpoint; its peers' collectives see the
    connection close some 30 ms before rank 0 records its OSError. Every rank exited 1 with a record:
    the earliest was rank 1's "Connection closed by peer". Rank 0's own failure is the cause."""
    from ddpexp.launch.error_records import error_file

    workers = [
        Worker(rank=r, proc=_Exited(2**22 + r, 1), log_path=tmp_path / f"rank{r}.log", exit_time=10.1)
        for r in range(4)
    ]
    error_file(tmp_path, 0).parent.mkdir()
    closed = "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41231"
    full = "[Errno 28] No space left on device"
    for rank, t, kind, message in [
        (1, 10.010, "DistBackendError", closed),
        (3, 10.012, "DistBackendError", closed),
        (2, 10.015, "DistBackendError", closed),
        (0, 10.040, "OSError", full),
    ]:
        record = {"rank": rank, "time": t, "type": kind, "message": message, "user_error": False}
        error_file(tmp_path, rank).write_text(json.dumps({**record, "traceback": ""}))
    sup = Supervisor(tmp_path, workers, facts={})
    sup.stopping_since = 10.2
    cause = sup._root_cause()
    assert (cause.who, cause.summary) == ("rank 0", f"failed: OSError: {full}")


def test_a_second_sigterm_inside_the_first_s_handler_cannot_give_ranks_different_stop_steps(capsys):
    """Slurm signals every process and the workers pass theirs on, so SIGTERMs reach the launcher in a
    burst, and Python may run the handler again inside itself. Each run of it picked its own stop step
    from the ranks' progress: on a loaded machine one rank was told step 36 and the other 37, they
    saved at different steps and the run hung (seen under pytest-xdist). One decision per run."""
    import signal

    from ddpexp.heartbeat import SIZE, STOP

    cells = [[0.0] * SIZE for _ in range(2)]
    workers = [
        Worker(rank=r, proc=_Running(2**22 + r), log_path=Path(f"/x/logs/rank{r}.log"), pulse=Pulse(c, 0.0))
        for r, c in enumerate(cells)
    ]
    sup = Supervisor(Path("/x"), workers, facts={}, checkpoint_on_signal=True)
    for cell in cells:
        Heartbeat(cell).beat(34)
    first = workers[0].pulse
    assert first is not None
    told = first.request_stop

    nested: list[int] = []

    def interrupted(value: int, signum: int = 0) -> None:
        told(value, signum)
        if not nested:
            nested.append(value)
            for cell in cells:
                Heartbeat(cell).beat(35)  # the ranks went on meanwhile
            sup._on_signal(signal.SIGTERM, None)  # the next SIGTERM, handled inside this one

    first.request_stop = interrupted  # type: ignore[method-assign]
    sup._on_signal(signal.SIGTERM, None)
    assert cells[0][STOP] == cells[1][STOP] > 34
    assert capsys.readouterr().err.count("every rank saves a checkpoint") == 1


def test_a_sigterm_while_a_log_line_is_written_stops_the_run():
    """SIGTERM landing while a log record is written (a closed terminal makes every write fail and
    print a long error: a wide window) must stop the run: `logging` swallows an Exception raised
    inside a handler, and an orphaned sweep went on to its next job so."""

    class Stream(io.StringIO):
        def write(self, text: str) -> int:
            signal.raise_signal(signal.SIGTERM)  # its handler runs before this call returns
            return super().write(text)

    log = logging.getLogger("test_supervise.sigterm")
    log.propagate = False
    log.addHandler(logging.StreamHandler(Stream()))
    try:
        with pytest.raises(Interrupted), sigterm_raises():
            log.warning("a line")
    finally:
        log.handlers.clear()
        interrupts.clear()  # the stop the handler left asked for: not for the next test in this process


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped raise
def test_a_sigterm_that_lands_in_a_finalizer_is_not_lost():
    """CPython drops an exception raised while a `__del__` runs ("Exception ignored in"): a SIGTERM
    landing there raised nothing, and a sweep went on to its next jobs. The signal stays asked for,
    and the training loop's and the sweep's next check raise it."""

    class Finalized:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, inside the finalizer

    try:
        with sigterm_raises():
            Finalized()  # dropped at once: its __del__ runs, the handler's Interrupted is dropped
            with pytest.raises(Interrupted) as stopped:
                interrupts.raise_if_requested()
        assert stopped.value.code == 143
    finally:
        interrupts.clear()

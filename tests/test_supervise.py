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


def test_the_report_names_the_hung_rank_its_step_and_its_log(tmp_path: Path):
    workers, cells = _workers(2)
    for w in workers:
        w.log_path = tmp_path / "logs" / f"rank{w.rank}.log"
    sup = Supervisor(tmp_path, workers, facts={}, watch=Watch(hang_s=10, patience_s=100))
    for cell in cells:
        Heartbeat(cell).beat(56)
    sup._hung(workers, now=0.0)
    sup.hang = sup._hung(workers, now=12.0)
    cause = sup._root_cause()
    assert (cause.who, cause.user_error) == ("rank 0", False)
    assert cause.summary == (
        "hung at step 57 (no progress for 12 s); its stack is in logs/rank0.log, its peers' in theirs"
    )


class _Exited:
    def __init__(self, pid: int, code: int) -> None:
        self.pid = pid
        self.returncode = code

    def poll(self) -> int:
        return self.returncode


def test_a_rank_that_exits_without_a_record_is_the_cause_not_the_peer_that_recorded_the_reset(tmp_path: Path):
    """Rank 1 leaves by os._exit(3); rank 0's collective fails with "Connection reset by peer" and it
    records that (before the launcher, polling, has even seen rank 1 go). Rank 1 is the cause."""
    from ddpexp.launch.supervise import error_file

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
    from ddpexp.launch.supervise import error_file

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

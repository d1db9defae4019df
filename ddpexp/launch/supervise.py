"""Watching worker processes, and the one SIGTERM helper every kind of process uses.

Supervision is what keeps a distributed run from hanging or leaking processes:
- a worker that fails (exception or signal) gets the others stopped at once, and the user sees the
  failing rank's own error first, not the echoes it caused in the other ranks;
- Ctrl-C / SIGTERM (or SIGHUP, SIGUSR1, SIGUSR2: STOP_SIGNALS) to the launcher stops every worker
  (SIGTERM, then SIGKILL after a grace period) and exits 128 + the signal (130 / 143 ...);
- a worker ended by a signal the launcher did not send (SIGTERM, SIGINT, SIGKILL from outside) is the
  cause, reported as such, never the peers that lost their connection to it;
- a worker that exits without an error record (os._exit, exit() in an extension) is the cause, with
  its exit code, never the peer whose connection it reset;
- a rank whose heartbeat stops (ddpexp/heartbeat.py) is declared hung after dist.hang_timeout_s:
  every rank's stack goes to its log (faulthandler, on STACK_SIGNAL), and of the ranks that stopped
  together the one in code of its own while its peers wait in a collective for it is named (see
  launch/blame.py), or, where their stacks cannot tell, the ranks it could be; the run stops;
- the forkserver the workers are forked from, if it dies, takes every worker with it: it is named.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from .. import interrupts
from ..errors import UserError
from ..heartbeat import STOP_NOW, Heartbeat, Pulse
from ..procstat import how_it_ended, is_stopped, start_time
from ..recorder import METRICS_FILE, finish_metrics
from . import blame
from .error_records import error_summary, first_cause, read_error

POLL_S = 0.05
GRACE_S = 5.0
STACK_SIGNAL = signal.SIGUSR2  # a worker dumps every thread's Python stack into its log on it
STACK_WAIT_S = 10.0  # at most, for every rank's stack to reach its log (each takes milliseconds)
# Exit codes of a worker whose sigterm_raises/KeyboardInterrupt handling ended it (128 + signal).
SIGNAL_EXITS = {128 + signal.SIGTERM: signal.SIGTERM, 128 + signal.SIGINT: signal.SIGINT}


def stopped_from_outside(signum: int) -> str:
    """How a rank that a signal from outside stopped is named, by the launcher and by torchrun's rank 0."""
    return f"stopped by {signal.Signals(signum).name} (not sent by ddpexp)"


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    interrupts.stop(signum)


@contextlib.contextmanager
def sigterm_raises(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[None]:
    """Within the block SIGTERM (or each of `signals`) raises `Interrupted` in the main thread, so the
    run unwinds through its `finally` blocks and records itself as interrupted; the previous handlers
    come back afterwards."""
    with handling(signals, _raise_interrupted):
        yield


@contextlib.contextmanager
def stops_raise() -> Iterator[None]:
    """A command's handlers between and around its jobs: every STOP_SIGNALS but SIGINT (which raises
    KeyboardInterrupt already) raises `Interrupted`, where the default action would kill the command
    mid-way (Hydra going from one job to the next, a job not yet launched). A job's launcher installs
    its own for the job's length. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with sigterm_raises(STOP_SIGNALS[1:]):
        yield


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM are ignored within the block: a run already stopping records how it ended
    without a second Ctrl-C (a terminal and submitit's local controller each send one) cutting that
    short and leaving metrics.json saying `running`. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with handling((signal.SIGINT, signal.SIGTERM), signal.SIG_IGN):
        yield


# trainer.checkpoint_on_signal: what Slurm (SIGTERM, --signal=USR1) and submitit (USR2) send.
CHECKPOINT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# What stops a launcher's run from outside, each by its own name (a signal whose default action would
# kill the launcher at once, leaving its run recorded as running): Ctrl-C, SIGTERM, a closed
# terminal (SIGHUP), and SIGUSR1/SIGUSR2 when they are not asking for a checkpoint.
STOP_SIGNALS = (signal.SIGINT, signal.SIGHUP, *CHECKPOINT_SIGNALS)
PREEMPT_MARGIN_STEPS = 2  # a rank may finish one more step between the launcher's read and its write


@contextlib.contextmanager
def checkpoint_then_stop(heartbeat: Heartbeat) -> Iterator[None]:
    """An in-process run with trainer.checkpoint_on_signal: the first such signal asks the engine to
    save and stop after the step it is in; a second one stops it at once."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if heartbeat.stop_requested:
            interrupts.stop(signum)
        at = heartbeat.step + 1
        heartbeat.request_stop(at, signum)
        name = signal.Signals(signum).name
        print(f"ddpexp: {name}: saving a checkpoint after this step, then stopping", file=sys.stderr)

    with handling(CHECKPOINT_SIGNALS, on_signal):
        yield


@contextlib.contextmanager
def forward_to_launcher(heartbeat: Heartbeat, launcher_pid: int) -> Iterator[None]:
    """A self-launched worker with trainer.checkpoint_on_signal: a signal that reaches it (Slurm signals
    every process of the job) goes to its launcher, which picks one step for every rank to save at. A
    SIGTERM from the launcher itself, which is stopping the run, ends the worker at once."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if heartbeat.stopping_now():
            interrupts.stop(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(launcher_pid, signum)

    with handling((signal.SIGTERM, signal.SIGUSR1), on_signal):
        yield


@contextlib.contextmanager
def handling(signals: tuple[int, ...], handler: Any) -> Iterator[None]:
    """`handler` for these signals within the block; the previous handlers come back afterwards."""
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Child(Protocol):
    """The members of a child process the supervisor uses (subprocess.Popen has them too)."""

    pid: int

    def poll(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...


@dataclass
class Worker:
    rank: int
    proc: Child
    log_path: Path
    exit_time: float | None = None
    tee: threading.Thread | None = None  # copies rank 0's output to the console as it comes
    pulse: Pulse | None = None  # its heartbeat, when the launcher watches for hangs
    log_from: int = 0  # where this attempt's lines begin in its log (every attempt appends to it)


@dataclass(frozen=True)
class Watch:
    """Hang detection: a rank without a heartbeat for hang_s (patience_s before its first beat and
    while it writes a checkpoint) is hung."""

    hang_s: float
    patience_s: float


@dataclass(frozen=True)
class Preempt:
    signum: int
    step: int  # where every rank saves and stops
    since: float


@dataclass(frozen=True)
class Hang:
    verdict: blame.Verdict
    worker: Worker | None  # the rank blamed; None where the stacks cannot tell which
    step: int
    quiet_s: float


@dataclass(frozen=True)
class Cause:
    """What the report blames: `who` ("rank 1", or a process of the launcher's side) and how it failed."""

    who: str
    summary: str  # "failed: ...", "stopped by ...", "hung at ..."
    detail: str = ""
    user_error: bool = False
    line: str = ""  # the console's line, where "<who> of <world size> <summary>" does not fit


class Supervisor:
    def __init__(
        self,
        run_dir: Path,
        workers: list[Worker],
        facts: dict[str, object],
        *,
        records: bool = True,
        watch: Watch | None = None,
        checkpoint_on_signal: bool = False,
        forkserver: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.workers = workers
        self.facts = facts  # what metrics.json says about the run if rank 0 never wrote it
        self.records = records  # False on nodes other than node 0: metrics.json is node 0's to write
        self.watch = watch
        self.signal_received: int | None = None
        self.stopping_since: float | None = None
        self.hang: Hang | None = None
        self.checkpoint_on_signal = checkpoint_on_signal
        # The pid of the forkserver the workers were forked from (their parent): if it dies, they do.
        self.forkserver = forkserver
        self.forkserver_started = start_time(forkserver) if forkserver is not None else None
        self.preempt: Preempt | None = None  # a checkpoint-then-stop under way
        # Taken by the first checkpoint signal, never released: the stop step is decided once, even
        # when the next signal of a burst runs the handler again inside itself (Python allows that;
        # acquiring is one C call, so there is no gap between testing and taking it).
        self._stop_decided = threading.Lock()

    def wait(self) -> int:
        handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            return self._loop()
        finally:
            self._kill_all(signal.SIGKILL)
            for s, h in handlers.items():
                signal.signal(s, h)
            for w in self.workers:  # the last lines a worker printed reach the console before we go on
                if w.tee is not None:
                    w.tee.join(timeout=GRACE_S)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.checkpoint_on_signal and signum in CHECKPOINT_SIGNALS and self.signal_received is None:
            # again (Slurm signals every process, workers pass theirs on): once
            if self._stop_decided.acquire(blocking=False):
                self._checkpoint_then_stop(signum)
            return
        if self.signal_received is not None:  # second Ctrl-C: no more grace
            self._kill_all(signal.SIGKILL)
        self.signal_received = signum

    def _checkpoint_then_stop(self, signum: int) -> None:
        """Every rank saves a checkpoint at the same step, a little after the furthest one's, and stops."""
        pulses = [w.pulse for w in self.workers if w.pulse is not None and w.exit_time is None]
        if not pulses:
            self.signal_received = signum
            return
        at = max(p.step for p in pulses) + PREEMPT_MARGIN_STEPS
        for pulse in pulses:
            pulse.request_stop(at, signum)
        self.preempt = Preempt(signum=signum, step=at, since=time.time())
        name = signal.Signals(signum).name
        print(
            f"ddpexp: {name}: every rank saves a checkpoint at step {at}, then the run stops", file=sys.stderr
        )

    def _loop(self) -> int:
        failed: Worker | None = None
        while True:
            now = time.time()
            preempted_code = 128 + self.preempt.signum if self.preempt is not None else None
            for w in self.workers:
                if w.exit_time is None and w.proc.poll() is not None:
                    w.exit_time = now
                    code = w.proc.returncode
                    if code not in (0, preempted_code) and failed is None and self.signal_received is None:
                        failed = w
            running = [w for w in self.workers if w.exit_time is None]
            if not running:
                break
            if failed is None and self.signal_received is None and self.hang is None:
                self.hang = self._hung(running, now)
                if self.hang is not None:
                    failed = self.hang.worker or running[0]
            if self.preempt is not None and now - self.preempt.since > self._preempt_patience():
                self.signal_received = self.preempt.signum  # the checkpoint never came: stop now
            if (failed is not None or self.signal_received is not None) and self.stopping_since is None:
                self.stopping_since = now
                for w in self.workers:
                    if w.pulse is not None:
                        w.pulse.request_stop(STOP_NOW)  # a worker's SIGTERM handler ends it, not passes it on
                self._kill_all(signal.SIGTERM)
            if self.stopping_since is not None and now - self.stopping_since > GRACE_S:
                self._kill_all(signal.SIGKILL)
            time.sleep(POLL_S)
        if self.signal_received is not None:
            name = signal.Signals(self.signal_received).name
            self._finish_metrics("interrupted", f"stopped by signal {name}")
            return 128 + self.signal_received
        if failed is None and self.preempt is not None and any(w.proc.returncode for w in self.workers):
            return 128 + self.preempt.signum  # rank 0 said where it saved and how to continue
        if failed is None:
            return 0
        return self._report_failure()

    def _preempt_patience(self) -> float:
        return self.watch.patience_s if self.watch is not None else 600.0

    def _hung(self, running: list[Worker], now: float) -> Hang | None:
        """Whether some rank's heartbeat has stopped for longer than allowed, and whom to blame: its
        peers soon stop too (they wait for it in a collective), so every rank's stack is read and
        blame.choose decides. A rank the OS shows as stopped (SIGSTOP, a debugger) is hung whatever
        phase it was in, and the one to blame even while a peer that beat a moment before it crosses
        hang_s first."""
        if self.watch is None:
            return None
        pulses = [(w, w.pulse) for w in running if w.pulse is not None]
        for _, pulse in pulses:
            pulse.read(now)
        hang_s, patience_s = self.watch.hang_s, self.watch.patience_s
        quiet = [(w, p) for w, p in pulses if p.quiet_for(now) > hang_s]
        if not quiet:
            return None
        stopped = [(w, p) for w, p in pulses if is_stopped(w.proc.pid)]
        if stopped:
            stopped = [(w, p) for w, p in stopped if p.quiet_for(now) > hang_s]
            if not stopped:
                return None
        elif not any(p.quiet_for(now) > p.limit(hang_s, patience_s) for _, p in quiet):
            return None
        progress = {w.rank: p.progress for w, p in pulses}  # before the stacks: SIGCONT lets one go on
        stopped_ranks = {w.rank for w, _ in stopped}
        places = self._dump_stacks(running)
        verdict = blame.choose(
            [blame.Suspect(r, progress[r], r in stopped_ranks, places.get(r)) for r in progress]
        )
        worker = next((w for w in running if w.rank == verdict.rank), None)
        pulse = next((p for w, p in pulses if w is worker), None) or min(
            (p for _, p in pulses), key=lambda p: p.step
        )
        return Hang(verdict=verdict, worker=worker, step=pulse.step + 1, quiet_s=pulse.quiet_for(now))

    def _dump_stacks(self, running: list[Worker]) -> dict[int, blame.Where | None]:
        """Ask every rank for its Python stack (a stopped one is continued to answer) and read where
        each one's main thread is, as soon as all have written it (None for a rank that could not)."""
        offsets = {w.rank: _size(w.log_path) for w in running}
        places: dict[int, blame.Where | None] = {}
        for w in running:
            try:
                os.kill(w.proc.pid, STACK_SIGNAL)
                os.kill(w.proc.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                places[w.rank] = None  # gone (or not ours): no stack will come
        deadline = time.time() + STACK_WAIT_S
        while True:
            for w in running:
                if w.rank in places:
                    continue
                frames = blame.main_thread(_read(w.log_path, offsets[w.rank]))
                if frames is not None:
                    places[w.rank] = blame.where(frames)
                elif w.proc.poll() is not None:
                    places[w.rank] = None
            if len(places) == len(running) or time.time() > deadline:
                return places
            time.sleep(POLL_S)

    def _kill_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.proc.pid, sig)

    def _report_failure(self) -> int:
        cause = self._root_cause()
        world = self.facts.get("world_size", len(self.workers))  # every node's ranks
        if cause.user_error:
            print(f"ddpexp: error: {cause.summary}", file=sys.stderr)
        else:
            print(f"ddpexp: {cause.line or f'{cause.who} of {world} {cause.summary}'}", file=sys.stderr)
            if cause.detail:
                print(cause.detail.rstrip(), file=sys.stderr)
            logs = self.run_dir / "logs"
            print(f"ddpexp: the other ranks were stopped; every rank's log is in {logs}", file=sys.stderr)
            if world != len(self.workers):  # dist.nnodes > 1: peers broken by a remote failure look alike
                print(
                    "ddpexp: a rank on another node may have failed first (see its log there)",
                    file=sys.stderr,
                )
        self._finish_metrics("failed", f"{cause.who}: {cause.summary}")
        return UserError.exit_code if cause.user_error else 1

    def _finish_metrics(self, status: str, error: str) -> None:
        """metrics.json says how the run ended; where it cannot be written (a full disk), the launcher
        says so once and goes on: the run's exit code and its run dir line matter more."""
        if not self.records:
            return
        try:
            finish_metrics(self.run_dir, status, error, facts=self.facts)
        except OSError as exc:
            problem = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            path = self.run_dir / METRICS_FILE
            print(f"ddpexp: {problem}: could not record that the run {status} in {path}", file=sys.stderr)

    def _root_cause(self) -> Cause:
        """Which rank failed first, and how ("failed: ...", "stopped by ...", "hung at ..."). A dead
        forkserver took every worker with it. A hung rank is the cause; so is a rank that ended without
        an error record (its peers only see a broken connection): killed by a signal nobody here sent,
        stopped through its SIGTERM/SIGINT handling (exit 143/130), or gone by os._exit. Otherwise the
        earliest error record wins. Ranks that died after the supervisor began stopping them were
        stopped by it (a rank already on its way out when the SIGTERM came dies of it), so they are
        never the cause."""
        if self.forkserver is not None:
            how = how_it_ended(self.forkserver, self.forkserver_started)
            if how is not None:
                said = f"was {how}" if how.startswith("killed") else how
                who = f"forkserver (pid {self.forkserver})"
                return Cause(who, how, line=f"the workers' {who} {said}, and every rank with it")
        if self.hang is not None:
            h = self.hang
            hung = f"hung at step {h.step} (no progress for {h.quiet_s:.0f} s)"
            if h.worker is None:
                among = h.verdict.among
                logs = ", ".join(f"logs/rank{r}.log" for r in among)
                return Cause(
                    f"ranks {', '.join(map(str, among[:-1]))} and {among[-1]}",
                    f"{hung}; which of them hung first cannot be told: {h.verdict.reason}; "
                    f"their stacks are in {logs}",
                )
            log = h.worker.log_path.relative_to(self.run_dir)
            return Cause(
                f"rank {h.worker.rank}",
                f"{hung}: {h.verdict.reason}; its stack is in {log}, its peers' in theirs",
            )
        records = {w.rank: r for w in self.workers if (r := read_error(self.run_dir, w.rank)) is not None}
        stop = self.stopping_since if self.stopping_since is not None else float("inf")
        preempted = 128 + self.preempt.signum if self.preempt is not None else None
        unexplained = [
            w
            for w in self.workers
            if w.proc.returncode not in (None, 0, preempted)
            and (w.proc.returncode < 0 or w.proc.returncode in SIGNAL_EXITS or w.rank not in records)
            and (w.exit_time or 0.0) <= stop
        ]
        if unexplained:
            w = min(unexplained, key=lambda w: w.exit_time or 0.0)
            code = w.proc.returncode or 0
            if code < 0:
                summary = f"failed: killed by {signal.Signals(-code).name}"
            elif code in SIGNAL_EXITS:
                summary = stopped_from_outside(SIGNAL_EXITS[code])
            else:
                summary = f"failed: exited with code {code}"
            return Cause(f"rank {w.rank}", summary, tail(w.log_path, start=w.log_from))
        if records:
            r = first_cause(list(records.values()))
            return Cause(
                f"rank {r['rank']}",
                error_summary(r),
                r["traceback"],
                r["user_error"],
            )
        w = min((w for w in self.workers if w.proc.returncode), key=lambda w: w.exit_time or 0.0)
        summary = f"failed: exited with code {w.proc.returncode}"
        return Cause(f"rank {w.rank}", summary, tail(w.log_path, start=w.log_from))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read(path: Path, start: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail(path: Path, lines: int = 30, *, start: int = 0) -> str:
    """The last `lines` lines of a log from byte `start` on (where this attempt's lines begin)."""
    return "\n".join(_read(path, start).splitlines()[-lines:])

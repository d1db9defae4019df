"""launch/senders.py: a watched signal's sender is known, and the process behaves as if it had been
delivered as usual (its handler runs even in a blocking wait; SIG_DFL ends it; SIG_IGN drops it)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from .conftest import REPO

CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading
    from ddpexp.launch import senders

    senders.watch((signal.SIGTERM,))

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        print("waiting", flush=True)
        threading.Event().wait()  # a lock wait: only a real signal to this thread ends it
    except KeyboardInterrupt:
        print("stopped, sent by", senders.sender(signal.SIGTERM), flush=True)
    pid = os.fork()
    if pid == 0:  # a forked child has no thread taking SIGTERM: it gets it as usual (blocked, it lived)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(0)
    print("child", os.waitpid(pid, 0)[1], flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring", flush=True)
    sys.stdin.readline()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print("default", flush=True)
    threading.Event().wait()
    """
)


def wait_for_futex(pid: int) -> None:
    """Until the main thread sleeps in the lock's futex (x86-64's syscall 202; elsewhere: go on)."""
    if os.uname().machine != "x86_64":
        return
    deadline = time.monotonic() + 60
    while not Path(f"/proc/{pid}/syscall").read_text().startswith("202 "):
        assert time.monotonic() < deadline, "the child never waited"
        time.sleep(0.01)


def wait_until_taken(pid: int, signum: int) -> None:
    """Until the watching thread has taken the signal (no longer pending for the process): taken
    later, after the process changed its disposition, it is handled under the new one (see
    launch/senders.py)."""
    bit = 1 << (signum - 1)
    deadline = time.monotonic() + 60
    while True:
        status = Path(f"/proc/{pid}/status").read_text()
        pending = int(next(line for line in status.splitlines() if line.startswith("ShdPnd:")).split()[1], 16)
        if not pending & bit:
            return
        assert time.monotonic() < deadline, "the signal was never taken"
        time.sleep(0.01)


def test_a_watched_signal_is_handled_as_delivered_and_its_sender_known():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()

    def line() -> str:
        return lines.get(timeout=60)  # a signal that did not do its part fails the test, never hangs it

    try:
        assert line() == "waiting\n"
        wait_for_futex(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert line() == f"stopped, sent by {os.getpid()}\n"
        assert line() == f"child {signal.SIGTERM}\n"  # killed by it: wait status 15
        assert line() == "ignoring\n"
        proc.send_signal(signal.SIGTERM)  # dropped: the process goes on to the next line
        wait_until_taken(proc.pid, signal.SIGTERM)  # handled under SIG_IGN, not the next disposition
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert line() == "default\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()

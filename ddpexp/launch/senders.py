"""Who sent a signal. Under torchrun the agent sends SIGTERM to every rank both when it is told to stop
(Slurm's preemption: the run was interrupted) and when one rank has ended (the others stop because of
it), and a SIGTERM from outside to one rank alone reads the same to its peers. Only the sender tells
these apart, and Python's handlers are not given it: here one thread takes the watched signals with
`sigwaitinfo` (the siginfo names the sending pid), notes the sender, and has the main thread's handler
run as a delivery would (`_thread.interrupt_main`), or the default action happen. A delivery also
cuts short what the main thread waits in (a sleep, a lock, a socket): WAKE, sent to the main thread
alone, does that part.

One difference from a delivery: a watched signal is pending until the thread takes it, and is handled
under the disposition of that moment, so one sent while the process ignores it but taken after the
process set a handler (a loaded host can delay the thread) runs that handler instead of being dropped.

The signal disposition is the process's, so what was watched is too: `watch` once, as the process
starts and before any other thread exists (threads inherit the blocked mask; a thread started earlier
could still take a signal, which then only loses its sender). Children are given the mask back.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading

_senders: dict[int, int] = {}  # signal -> pid that last sent it (0: the kernel, or not known)
_watched: frozenset[int] = frozenset()
WAKE = signal.SIGURG  # ignored by default, so nothing else of ours or torch's expects it


def watch(signals: tuple[int, ...]) -> None:
    """Take `signals` in a thread of their own from now on, noting each one's sender."""
    global _watched
    if _watched:
        return
    _watched = frozenset(signals)
    signal.signal(WAKE, _woken)
    signal.pthread_sigmask(signal.SIG_BLOCK, _watched)
    os.register_at_fork(after_in_child=_unblock_in_child)
    main = threading.get_ident()
    threading.Thread(target=_take, args=(main,), name="ddpexp-signals", daemon=True).start()


def sender(signum: int) -> int | None:
    """The pid that sent the last `signum` this process took, None if none was taken or not watched."""
    return _senders.get(signum)


def _take(main: int) -> None:
    while True:
        info = signal.sigwaitinfo(_watched)
        signum = info.si_signo
        _senders[signum] = info.si_pid
        handler = signal.getsignal(signum)
        if callable(handler):
            _thread.interrupt_main(signal.Signals(signum))
            signal.pthread_kill(main, WAKE)  # its handler runs once a wait it is in returns EINTR
        elif handler in (signal.SIG_DFL, None):  # the default action: end this process as it would have
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            signal.raise_signal(signum)
        # SIG_IGN: taken and dropped, as the kernel would have; its sender is still known


def _woken(signum: int, frame: object) -> None:
    """Nothing: WAKE is there to end the main thread's wait; the watched signal's handler does the rest."""


def _unblock_in_child() -> None:
    """A forked child (a DataLoader worker) has no thread to take them: it gets them as usual."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _watched)

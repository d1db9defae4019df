"""When a signal reached the process (launch/arrivals.py): torchrun's rank 0 compares it with when a
peer recorded its end, so it must be when the signal arrived, not when Python got round to its handler."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from ddpexp.launch import arrivals


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's timestamps are Linux's")
def test_the_first_arrival_of_each_signal_is_kept_and_the_wakeup_fd_given_back():
    handled: list[float] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(time.time()))
    try:
        with arrivals.timed() as signals:
            assert signals.first(signal.SIGTERM) is None
            before = time.time()
            os.kill(os.getpid(), signal.SIGTERM)
            arrived = signals.first(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # a second one: the first arrival is what is kept
            assert signals.first(signal.SIGTERM) == arrived
        assert len(handled) == 2, "the handlers never ran"
        assert arrived is not None and before - 0.001 <= arrived <= handled[0], (before, arrived, handled)
        os.kill(os.getpid(), signal.SIGTERM)  # outside the block nothing is kept, and the fd is given back
        assert signal.set_wakeup_fd(-1) == -1
    finally:
        signal.signal(signal.SIGTERM, previous)

"""Imported first by the workers' forkserver (warmup.PRELOAD), before its seconds of imports: the server
dies the moment the process that started it does, however that ends (SIGKILL included).

multiprocessing's server only notices that its parent is gone once its imports are done and it reads
EOF from its pipe, then exits through the interpreter's teardown: an orphan for seconds (up to the
whole import of torch). PR_SET_PDEATHSIG has the kernel kill it instead. It fires when the *thread*
that started the server ends: warmup starts it from the thread that runs the command or `ddpexp.run`,
and multiprocessing starts a new one if it finds the old one gone.

The starter names itself in TETHER_ENV (warmup.py); importing this module anywhere else does nothing.
Standard library only: it runs before anything else the server imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

TETHER_ENV = "DDPEXP_FORKSERVER_PARENT"
_PR_SET_PDEATHSIG = 1


def _tether() -> None:
    parent = os.environ.pop(TETHER_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # the starter died before the line above: nothing would fire
        os._exit(0)


_tether()

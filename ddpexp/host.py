"""What the host looks like right now: cores this process may use, and how busy they are. Recorded in
metrics.json's facts so that the report can tell a clean measurement from one taken on a busy machine."""

from __future__ import annotations

import os
import sys


def cpus() -> int:
    """The cores this process may run on (its affinity mask: a Slurm or taskset limit counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average (None where the OS keeps none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def available_memory() -> int:
    """Bytes of memory that new processes can take without swapping (the kernel's MemAvailable)."""
    import psutil

    return int(psutil.virtual_memory().available)


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def machine_id() -> str | None:
    """Which machine this is, whatever the host name says: the running kernel's boot id, which every
    container on one machine (or VM) shares while their host names differ. None off Linux."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
_policy_loaded: str | None = None  # what this process's OpenMP read, where torch was loaded before us


def quiet_waits() -> None:
    """Make OpenMP threads sleep, not spin, between parallel regions, in this process (if torch is not
    loaded yet: OpenMP reads it once, as torch loads it) and in every process it starts. A spinning
    thread burns the core its sibling needs whenever anything else runs on the host: a one-process run
    with 2 threads on 2 cores then crawls at a fraction of its fair share. A user's own setting wins."""
    global _policy_loaded
    if "torch" in sys.modules and _policy_loaded is None:
        _policy_loaded = wait_policy()
    if WAIT_POLICY_ENV not in os.environ and SPIN_COUNT_ENV not in os.environ:
        os.environ[WAIT_POLICY_ENV] = "PASSIVE"


def wait_policy() -> str:
    """How this process's OpenMP threads wait (facts.wait_policy): OMP_WAIT_POLICY, GOMP_SPINCOUNT,
    or OpenMP's default, which spins a while before it sleeps."""
    return _policy_loaded if _policy_loaded is not None else _policy_of_environment()


def waits_unlike_its_workers() -> bool:
    """Whether this process's OpenMP threads wait otherwise than those of the processes it starts:
    torch was loaded before ddpexp set the policy (a notebook, a script that imported torch first), so
    a run in this process would spin where a run from the command line sleeps."""
    return _policy_loaded is not None and _policy_loaded != _policy_of_environment()


def _policy_of_environment() -> str:
    if WAIT_POLICY_ENV in os.environ:
        return os.environ[WAIT_POLICY_ENV].lower()
    if SPIN_COUNT_ENV in os.environ:
        return f"spin {os.environ[SPIN_COUNT_ENV]}"
    return "default"


AUTOGROUP = "/proc/sys/kernel/sched_autogroup_enabled"


def autogroup() -> bool | None:
    """Whether Linux shares a busy CPU between sessions before processes (autogroup; None where it does
    not exist): a process in a session of its own then gets a whole share, the processes of one
    session split one."""
    try:
        with open(AUTOGROUP) as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def own_session() -> bool:
    """Whether this process runs in a session apart from its parent's (torchrun starts each worker so)."""
    try:
        return os.getsid(0) != os.getsid(os.getppid())
    except OSError:  # the parent is gone
        return False

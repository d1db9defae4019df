"""What the host looks like right now: cores this process may use, and how busy they are. Recorded in
metrics.json's facts so that the report can tell a clean measurement from one taken on a busy machine."""

from __future__ import annotations

import os


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

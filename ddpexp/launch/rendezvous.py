"""Where the ranks of a self-launched run meet: a free port, whether a pinned one is usable, and the
init URL for each init method. Light on purpose: pre-flight imports this module and nothing else of
the launcher."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

from ..errors import UserError

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(addr: str) -> int:
    """A port no one listens on, picked below the kernel's ephemeral range: the kernel hands ports of
    that range to every outgoing connection (gloo's between ranks, any program's), so one found free
    there can be taken before rank 0 listens on it (EADDRINUSE, seen with two test workers launching
    runs side by side). Where the range is unknown, or nothing below it is free, the kernel's pick."""
    low = _ephemeral_low()
    if low is not None and low > 2048:
        pick = random.SystemRandom()
        for _ in range(64):
            port = pick.randrange(low // 2, low)
            if port_is_free(addr, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int | None:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def port_is_free(addr: str, port: int) -> bool:
    """Whether a rendezvous server could listen on the port now. SO_REUSEADDR, as torch's TCPStore sets
    it: connections of a finished run linger in TIME_WAIT for a minute and must not count as "in use"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def init_file(dist_cfg: Any, run_dir: Path) -> Path:
    """init=file: the rendezvous file every rank opens (dist.init_file, or a fresh one in the run dir)."""
    configured = dist_cfg.init_file
    return Path(configured).resolve() if configured else run_dir / "rendezvous"


def init_url(init: str, *, addr: str, port: int, rendezvous_file: Path, joining: bool = False) -> str:
    """How the workers find each other: env:// (MASTER_ADDR/PORT), tcp://addr:port, or file:///path.
    `joining`: a node other than node 0, whose workers may have made the file already."""
    if init == "tcp":
        return f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"
    if init == "file":
        if rendezvous_file.exists() and not joining:  # pre-flight checked; another run may have made it since
            raise UserError(
                f"rendezvous file {rendezvous_file} already exists (a stale file would join the wrong run)",
                setting="dist.init_file",
                fix="delete it if no run uses it, or choose another dist.init_file",
            )
        return f"file://{rendezvous_file}"
    return "env://"

"""Crash-safe file writing: a reader sees either the old file or the complete new one, never half."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write through `write(file)` into a temporary file beside `path`, fsync it, then rename it over
    `path`. If anything fails (a full disk, a crash), `path` keeps its previous content and the
    temporary file is removed."""
    tmp = _temporary_beside(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_all(files: dict[Path, str]) -> None:
    """Write several text files, each whole, all or none: every one is written beside its path first,
    and only once all are on disk do they replace what was there. A full disk part-way leaves every
    file as it was (a set that belongs together, such as a resumed run's config and plan)."""
    written: dict[Path, Path] = {}
    try:
        for path, text in files.items():
            written[path] = _temporary_beside(path, _writing(text.encode()))
        for path, tmp in written.items():
            os.replace(tmp, path)
    except BaseException:
        for tmp in written.values():
            tmp.unlink(missing_ok=True)
        raise
    for directory in {path.parent for path in files}:
        _fsync_dir(directory)


def _writing(data: bytes) -> Callable[[IO[bytes]], object]:
    return lambda f: f.write(data)


def _temporary_beside(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """A temporary file in `path`'s directory holding what `write` wrote, on disk; none if that fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files; results should read like any other file
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    def write(f: IO[bytes]) -> None:
        f.write(data)

    atomic_write(path, write)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


CLAIM_FILE = ".ddpexp.lock"


class Claim:
    """An exclusive claim on a directory: an flock on <dir>/.ddpexp.lock, which holds the claimant's
    PID. The kernel drops the lock when the process ends however it ends (even SIGKILL), so a crashed
    run never leaves a stale claim behind; `release` drops it earlier (in-process runs)."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def first_missing(path: Path) -> Path | None:
    """The outermost directory that making `path` would create (None if it exists): what to remove
    to leave nothing behind."""
    path = path.absolute()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def claim(directory: Path) -> Claim | int:
    """Claim `directory` (made if missing) for this process; the PID of the process holding it instead
    (0 if it cannot be read) when another has claimed it."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / CLAIM_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = int(os.read(fd, 32).decode().strip() or 0)
        except ValueError:
            holder = 0
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return Claim(directory, fd)


def held(directory: Path) -> bool:
    """Whether a live process holds the claim on `directory` (see `claim`)."""
    import fcntl

    try:
        fd = os.open(directory / CLAIM_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False

"""The Python standard library's own source files as a language-modelling corpus: present wherever
Python is, nothing to download. Its `.py` files are read where this interpreter keeps them (sysconfig's
`stdlib` path), as bytes (vocabulary 256, each file ended by a NUL byte), split into train and eval
by file: a file is in eval when a hash of its path below the stdlib puts it there, so a file's split
does not depend on which others exist.

Left out by default (`exclude`): folders that distributions ship separately or leave out (the test
suites, idlelib, tkinter, turtledemo, lib2to3, distutils, ensurepip), installed packages, and the
interpreter's build configuration (config-*, _sysconfigdata_*), which differs between builds of one
version. `max_bytes` keeps a deterministic part: files in an order fixed by their paths' hashes, as
many as fit, eval_fraction of the bytes for eval.

Another Python version reads other files: the run records the version, the files' count, bytes and
a hash of their list (facts.data_facts) and the tokens' fingerprint, so such runs are never silently
compared (the report warns) and ranks that read different files refuse to train together.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sysconfig
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .source import resolve_root
from .tokens import BYTE_VOCAB, TokenStream, file_key, read_bytes, split_by_file

EXCLUDE = (
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "distutils",
    "ensurepip",
    "site-packages",
    "dist-packages",
    "__pycache__",
)

File = tuple[str, int]  # (path below the stdlib, bytes)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, exclude: tuple[str, ...]) -> list[File]:
    """Every .py file below root, outside folders named in `exclude` and the build configuration."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in exclude and not d.startswith("config-"))
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(folder, name)
                found.append((path.relative_to(root).as_posix(), path.stat().st_size))
    return sorted(found)


def capped(files: list[File], limit: int | None) -> list[File]:
    """As many files as fit in `limit` bytes, taken in an order fixed by their paths' hashes."""
    if limit is None:
        return files
    kept, total = [], 0
    for name, size in sorted(files, key=lambda f: file_key(f[0])[1]):
        if total + size <= limit:
            kept.append((name, size))
            total += size
    return sorted(kept)


class PythonStdlib(TokenStream):
    name = "python_stdlib"

    def __init__(
        self,
        *,
        block_size: int,
        max_bytes: int | None,
        eval_fraction: float,
        exclude: list[str],
        root: str | None,
    ) -> None:
        super().__init__(block_size=block_size, vocab_size=BYTE_VOCAB)
        self.max_bytes = max_bytes
        self.eval_fraction = eval_fraction
        self.exclude = tuple(exclude)
        self.root = resolve_root(root) if root is not None else stdlib_root()

    @functools.cached_property
    def selection(self) -> tuple[list[File], list[File]]:
        """(train files, eval files), each sorted by path."""
        files = dict(list_files(self.root, self.exclude))
        train, held = split_by_file(files, self.eval_fraction)
        if self.max_bytes is None:
            return [(n, files[n]) for n in train], [(n, files[n]) for n in held]
        eval_cap = round(self.max_bytes * self.eval_fraction)
        return (
            capped([(n, files[n]) for n in train], self.max_bytes - eval_cap),
            capped([(n, files[n]) for n in held], eval_cap),
        )

    def check(self) -> None:
        if not 0 < self.eval_fraction < 1:
            raise UserError(f"is {self.eval_fraction}", setting="data.eval_fraction", fix="use 0 < x < 1")
        if not self.root.is_dir():
            raise UserError(
                f"{self.root} is not a folder",
                setting="data.root",
                fix="set data.root=null (this Python's own standard library) or a folder of .py files",
            )
        super().check()

    def token_counts(self) -> tuple[int, int]:
        # one END_OF_FILE token after every file
        train, held = self.selection
        return sum(s for _, s in train) + len(train), sum(s for _, s in held) + len(held)

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        train, held = self.selection
        return read_bytes(self.root / n for n, _ in train), read_bytes(self.root / n for n, _ in held)

    def corpus_facts(self) -> dict[str, Any]:
        train, held = self.selection
        listing = "".join(
            f"{split}\t{n}\t{s}\n" for split, fs in (("train", train), ("eval", held)) for n, s in fs
        )
        return {
            "python": platform.python_version(),
            "files": {"train": len(train), "eval": len(held)},
            "bytes": {"train": sum(s for _, s in train), "eval": sum(s for _, s in held)},
            "file_list_sha256": hashlib.sha256(listing.encode()).hexdigest()[:16],
        }


def python_stdlib(
    *,
    block_size: int = 128,
    max_bytes: int | None = 1_000_000,
    eval_fraction: float = 0.1,
    exclude: list[str] | None = None,
    root: str | None = None,
) -> PythonStdlib:
    return PythonStdlib(
        block_size=block_size,
        max_bytes=max_bytes,
        eval_fraction=eval_fraction,
        exclude=list(EXCLUDE) if exclude is None else exclude,
        root=root,
    )

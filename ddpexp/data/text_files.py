"""Your own corpus for language modelling: `data=text_files data.path=...`, a folder (every file below
it, hidden ones left out), one file, or a glob (`'corpus/**/*.txt'`). Files are split into train and
eval by a hash of their path (data/tokens.split_by_file), at least one file each; a single file is
split by position instead (its last eval_fraction of tokens is eval).

Tokens are the files' UTF-8 bytes (vocabulary 256, each file ended by a NUL byte), or the ids of
`data.tokenizer`, given as `_target_` (instantiated with its other keys): an object with
  vocab_size: int                   ids it gives are in [0, vocab_size)
  __call__(text: str) -> list[int]  one file's text, tokenised
  eos_id: int (optional)            appended after every file

Checked before anything starts, each a line with its fix: a path that is not there, no text (no
files, or all empty), a file that is not text (not UTF-8, or holding NUL bytes: a binary file), and a
split shorter than one sample (block_size + 1 tokens).
"""

from __future__ import annotations

import functools
import glob
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from .source import resolve_root
from .tokens import BYTE_VOCAB, TokenStream, file_key, read_bytes, split_by_file, storage_dtype

MAGIC = frozenset("*?[")


class TextFiles(TokenStream):
    name = "text_files"

    def __init__(self, *, path: str | None, block_size: int, eval_fraction: float, tokenizer: Any) -> None:
        vocab = BYTE_VOCAB if tokenizer is None else getattr(tokenizer, "vocab_size", 0)  # check() checks it
        super().__init__(block_size=block_size, vocab_size=vocab)
        self.path = path or ""
        self.eval_fraction = eval_fraction
        self.tokenizer = tokenizer

    @functools.cached_property
    def files(self) -> tuple[Path, list[Path]]:
        """(the folder names are relative to, every file found in a fixed order)."""
        given = resolve_root(self.path)
        if given.is_file():
            return given.parent, [given]
        if given.is_dir():
            return given, sorted(p for p in given.rglob("*") if p.is_file() and not _hidden(p, given))
        if MAGIC & set(self.path):
            parts = given.parts
            fixed = next(i for i, part in enumerate(parts) if MAGIC & set(part))
            base = Path(*parts[:fixed])
            return base, sorted(Path(p) for p in glob.glob(str(given), recursive=True) if Path(p).is_file())
        return given, []

    def splits(self) -> tuple[list[Path], list[Path]]:
        """(train files, eval files); a single file is in both (split by position in tokens())."""
        base, files = self.files
        if len(files) == 1:
            return files, files
        by_name = {p.relative_to(base).as_posix(): p for p in files}
        train, held = split_by_file(by_name, self.eval_fraction)
        if not held:  # few files: the one whose key is lowest is eval's
            held = [min(train, key=lambda n: file_key(n)[0])]
            train.remove(held[0])
        elif not train:
            train = [max(held, key=lambda n: file_key(n)[0])]
            held.remove(train[0])
        return [by_name[n] for n in train], [by_name[n] for n in held]

    def check(self) -> None:
        if not self.path:
            raise UserError(
                "is not set",
                setting="data.path",
                fix="give data.path=<a folder, a file or a glob of text files>",
            )
        if self.tokenizer is not None:
            _check_tokenizer(self.tokenizer)
        if not 0 < self.eval_fraction < 1:
            raise UserError(f"is {self.eval_fraction}", setting="data.eval_fraction", fix="use 0 < x < 1")
        given = resolve_root(self.path)
        files = self.files[1]
        if not files and not given.exists() and not MAGIC & set(self.path):
            raise UserError(
                f"{given} does not exist",
                setting="data.path",
                fix="point data.path at a folder, a file or a glob of text files ('corpus/**/*.txt')",
            )
        if not any(p.stat().st_size for p in files):
            what = f"{len(files)} empty file{'s' * (len(files) != 1)}" if files else "no files"
            raise UserError(
                f"{self.path} holds no text ({what})",
                setting="data.path",
                fix="point data.path at a folder, a file or a glob of non-empty text files",
            )
        for path in files:
            problem = _not_text(path.read_bytes())
            if problem:
                raise UserError(
                    f"{path} is not text: {problem}",
                    setting="data.path",
                    fix="leave it out: point data.path at the text files only (a glob such as "
                    "'corpus/**/*.txt')",
                )
        super().check()
        if self.tokenizer is not None:  # counts are known only once tokenised: enough to fill a block?
            self.check_long_enough(*self._enough_tokens())

    def token_counts(self) -> tuple[int, int] | None:
        if self.tokenizer is not None:
            return None
        train, held = self.splits()
        if train == held:  # one file: split by position
            n = train[0].stat().st_size + 1
            return n - self._eval_part(n), self._eval_part(n)
        return sum(p.stat().st_size + 1 for p in train), sum(p.stat().st_size + 1 for p in held)

    def _eval_part(self, n: int) -> int:
        return min(max(round(n * self.eval_fraction), 1), n - 1)

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        train, held = self.splits()
        if train == held:
            both = self._encode(train)
            cut = len(both) - self._eval_part(len(both))
            return both[:cut], both[cut:]
        return self._encode(train), self._encode(held)

    def _encode(self, paths: list[Path]) -> torch.Tensor:
        if self.tokenizer is None:
            return read_bytes(paths)
        dtype = storage_dtype(self.vocab_size)
        parts = [torch.from_numpy(self._ids(p)).to(dtype) for p in paths]
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)

    def _ids(self, path: Path) -> np.ndarray:
        ids = np.asarray(self.tokenizer(path.read_text(encoding="utf-8")), dtype=np.int64).reshape(-1)
        eos = getattr(self.tokenizer, "eos_id", None)
        if eos is not None:
            ids = np.append(ids, eos)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise UserError(
                f"the tokenizer gave id {bad} for {path}, outside its vocab_size {self.vocab_size}",
                setting="data.tokenizer",
                fix="make vocab_size larger than every id it gives",
            )
        return ids

    def _enough_tokens(self) -> tuple[int, int]:
        """Each split's tokens, counted until one sample's worth (pre-flight need not tokenise all)."""
        train, held = self.splits()
        need = self.block_size + 1
        if train == held:
            n = len(self._ids(train[0]))
            return n - self._eval_part(n), self._eval_part(n)
        counts = []
        for paths in (train, held):
            total = 0
            for path in paths:
                total += len(self._ids(path))
                if total >= need:
                    break
            counts.append(total)
        return counts[0], counts[1]

    def corpus_facts(self) -> dict[str, Any]:
        base = self.files[0]
        train, held = self.splits()
        listing = "".join(
            f"{split}\t{p.relative_to(base).as_posix()}\t{p.stat().st_size}\n"
            for split, ps in (("train", train), ("eval", held))
            for p in ps
        )
        return {
            "files": {"train": len(train), "eval": len(held)},
            "bytes": {
                "train": sum(p.stat().st_size for p in train),
                "eval": sum(p.stat().st_size for p in held),
            },
            "file_list_sha256": hashlib.sha256(listing.encode()).hexdigest()[:16],
            "tokenizer": None if self.tokenizer is None else type(self.tokenizer).__qualname__,
        }


def _hidden(path: Path, base: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(base).parts)


def _not_text(data: bytes) -> str | None:
    """Why these bytes are not text, or None."""
    if b"\0" in data:
        return f"a NUL byte at offset {data.index(0)} (a binary file)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})"
    return None


def _check_tokenizer(tokenizer: Any) -> None:
    vocab = getattr(tokenizer, "vocab_size", None)
    if not callable(tokenizer) or not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise UserError(
            f"{type(tokenizer).__qualname__} is not a tokenizer ddpexp can use",
            setting="data.tokenizer",
            fix="give an object with vocab_size (an int) that is called as tokenizer(text) -> list of ids",
        )


def text_files(
    *, path: str | None = None, block_size: int = 128, eval_fraction: float = 0.1, tokenizer: Any = None
) -> TextFiles:
    return TextFiles(path=path, block_size=block_size, eval_fraction=eval_fraction, tokenizer=tokenizer)

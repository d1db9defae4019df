"""Token streams for language modelling (`task=lm`): a corpus is one sequence of token ids per split,
and a sample is a window of block_size + 1 consecutive tokens: the model reads the first block_size,
the targets are the same window shifted by one. Windows start every block_size tokens, so each token
is predicted once per epoch; to the sampler and the exact eval shards a window is a sample like any
other, and the eval loss is the mean over every eval token scored.

Tokens are kept in the narrowest integer type that holds the vocabulary (uint8 for bytes) and both
the inputs and the targets are views of that one tensor: a byte corpus costs each rank 1 byte a token.
Batches are widened to int64 on the device (`Split.batch_dtype`), which nn.Embedding and
cross_entropy take.

Sources here: `TokenStream`, what every token corpus shares (info, the one-block check, loading into
windows, the fingerprint), and `synthetic_tokens`. Files: `python_stdlib.py`, `text_files.py`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from .source import DataInfo, DataSource, Split, Splits

BYTE_VOCAB = 256
# Byte-level corpora end every file with this byte: text (UTF-8, no NUL, checked) never holds it, so
# a model learns where a file ends and the next begins.
END_OF_FILE = 0


def storage_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest integer type that holds every id below vocab_size."""
    if vocab_size <= 2**8:
        return torch.uint8
    if vocab_size <= 2**15:
        return torch.int16
    return torch.int32


def window_count(tokens: int, block_size: int) -> int:
    """Samples of block_size + 1 tokens, starting every block_size tokens."""
    return max(0, (tokens - 1) // block_size)


def windows(tokens: torch.Tensor, block_size: int) -> Split:
    """The split's samples: inputs tokens[i*b : i*b+b], targets one further, both views of `tokens`."""
    n = window_count(len(tokens), block_size)
    x = tokens[: n * block_size].view(n, block_size)
    y = tokens[1 : n * block_size + 1].view(n, block_size)
    split = Split.from_tensors(x, y)
    split.batch_dtype = torch.long
    return split


def fingerprint(*streams: torch.Tensor) -> str:
    """Of the tokens themselves: ranks (and machines) that loaded different text never train together."""
    digest = hashlib.sha256()
    for tokens in streams:
        digest.update(str(tokens.dtype).encode() + len(tokens).to_bytes(8, "little"))
        digest.update(tokens.contiguous().numpy().view(np.uint8).data)
    return digest.hexdigest()[:16]


def file_key(name: str) -> tuple[float, float]:
    """Two independent uniform numbers in [0, 1) from a file's name: which split it is in (the first),
    and its place in line when a size cap keeps only some files (the second). From the name alone, so
    a file's split does not depend on which other files exist (another Python version's stdlib)."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64, int.from_bytes(digest[8:16], "big") / 2**64


def split_by_file(names: Iterable[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """(train, eval) file names, each sorted: a file is in eval when its key is below eval_fraction."""
    train: list[str] = []
    held: list[str] = []
    for name in sorted(names):
        (held if file_key(name)[0] < eval_fraction else train).append(name)
    return train, held


def read_bytes(paths: Iterable[Path]) -> torch.Tensor:
    """The files' bytes, each followed by END_OF_FILE, as one uint8 tensor (no copy of the buffer)."""
    buffer = bytearray()
    for path in paths:
        buffer += path.read_bytes()
        buffer.append(END_OF_FILE)
    return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)


def short_split_error(name: str, split: str, tokens: int, block_size: int) -> UserError:
    longest = f"data.block_size<={tokens - 1} or " if tokens > 1 else ""
    return UserError(
        f"the {split} split of {name} holds {tokens:,} tokens, fewer than one sample of block_size + 1 "
        f"= {block_size + 1:,}",
        setting="data.block_size",
        fix=f"use {longest}more text",
    )


class TokenStream(DataSource):
    """A corpus as a train and an eval sequence of token ids, served as windows (module docstring).
    Subclasses give `tokens()` and, where they know them without loading, `token_counts()`."""

    name = "tokens"

    def __init__(self, *, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size

    def token_counts(self) -> tuple[int, int] | None:
        """(train, eval) tokens, where known without loading (pre-flight counts steps from them)."""
        return None

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The train and eval token sequences, each as one 1-D tensor of storage_dtype(vocab_size)."""
        raise NotImplementedError

    def corpus_facts(self) -> dict[str, Any]:
        """What the run records about the corpus (facts.data_facts), besides the fingerprint."""
        return {}

    def info(self) -> DataInfo:
        counts = self.token_counts()
        train, held = (window_count(c, self.block_size) for c in counts) if counts else (None, None)
        return DataInfo(
            num_classes=self.vocab_size,
            input_shape=(self.block_size,),
            vocab_size=self.vocab_size,
            targets="token",
            train_samples=train,
            eval_samples=held,
            tokens_per_sample=self.block_size,
        )

    def check(self) -> None:
        if self.block_size < 1:
            raise UserError(f"is {self.block_size}", setting="data.block_size", fix="use 1 or more")
        counts = self.token_counts()
        if counts is not None:
            self.check_long_enough(*counts)

    def check_long_enough(self, train: int, held: int) -> None:
        for split, tokens in (("train", train), ("eval", held)):
            if tokens < self.block_size + 1:
                raise short_split_error(self.name, split, tokens, self.block_size)

    def load(self, work_dir: Path) -> Splits:
        train, held = self.tokens()
        self.check_long_enough(len(train), len(held))
        info = replace(
            self.info(),
            train_samples=window_count(len(train), self.block_size),
            eval_samples=window_count(len(held), self.block_size),
        )
        facts = {"train_tokens": len(train), "eval_tokens": len(held), **self.corpus_facts()}
        return Splits(
            train=windows(train, self.block_size),
            eval=windows(held, self.block_size),
            info=info,
            fingerprint=fingerprint(train, held),
            facts=facts,
        )


class SyntheticTokens(TokenStream):
    """Uniformly random token ids from a seed: nothing to learn below ln(vocab_size), for throughput
    and the planner's measurements."""

    name = "synthetic_tokens"

    def __init__(self, *, vocab_size: int, train_tokens: int, eval_tokens: int, block_size: int, seed: int):
        super().__init__(block_size=block_size, vocab_size=vocab_size)
        self.counts = (train_tokens, eval_tokens)
        self.seed = seed

    def check(self) -> None:
        if self.vocab_size < 1 or self.vocab_size > 2**31:
            raise UserError(f"is {self.vocab_size}", setting="data.vocab_size", fix="use 1 to 2**31")
        super().check()

    def token_counts(self) -> tuple[int, int]:
        return self.counts

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        dtype = storage_dtype(self.vocab_size)
        both = torch.randint(self.vocab_size, (sum(self.counts),), generator=g, dtype=dtype)
        return both[: self.counts[0]], both[self.counts[0] :]


def synthetic_tokens(
    *,
    vocab_size: int = 256,
    train_tokens: int = 262144,
    eval_tokens: int = 32768,
    block_size: int = 128,
    seed: int = 0,
) -> SyntheticTokens:
    return SyntheticTokens(
        vocab_size=vocab_size,
        train_tokens=train_tokens,
        eval_tokens=eval_tokens,
        block_size=block_size,
        seed=seed,
    )

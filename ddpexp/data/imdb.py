"""IMDB movie-review sentiment (positive/negative), read from the published layout
`aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt`.

Text pipeline:
- `tokenize`: our own small tokenizer (lower-case, HTML line breaks removed, words and punctuation
  split by one regular expression). No dependency to keep up to date, deterministic everywhere, fast
  enough for 50k reviews; see the README for why not torchtext or a subword library.
- `Vocab`: built from the training split only, on rank 0, once per run, and written to the run
  directory (`vocab.json`); every rank loads that file, so all ranks share one vocabulary by
  construction (and the run records its fingerprint). Tokens below `min_freq` are dropped, the most
  frequent `max_size` kept; id 0 is padding, id 1 the unknown token.
- every review is truncated or padded to `max_len` ids, so a review is encoded the same way whatever
  batch or rank it lands in, and splits are plain tensors served by the device-resident loader.
  (EmbeddingBag models skip the padding id; the gated CNN sees padding as zero vectors.)
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import torch

from ..fsutil import atomic_write_text
from .source import DataInfo, DataSource, Download, Split, Splits, fetched, missing_files_error, resolve_root

PAD, UNK = "<pad>", "<unk>"
VOCAB_FILE = "vocab.json"
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")
_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(_BREAK.sub(" ", text).lower())


class Vocab:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.index = {t: i for i, t in enumerate(tokens)}

    @classmethod
    def build(cls, texts: list[str], *, min_freq: int, max_size: int) -> Vocab:
        counts = Counter(t for text in texts for t in tokenize(text))
        ranked = sorted((t for t, c in counts.items() if c >= min_freq), key=lambda t: (-counts[t], t))
        return cls([PAD, UNK, *ranked[:max_size]])

    def encode(self, text: str, max_len: int) -> list[int]:
        unk = self.index[UNK]
        ids = [self.index.get(t, unk) for t in tokenize(text)[:max_len]]
        return ids + [0] * (max_len - len(ids))

    def fingerprint(self) -> str:
        return hashlib.sha256("\n".join(self.tokens).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.tokens)


class IMDB(DataSource):
    name = "imdb"

    def __init__(self, *, root: str, download: bool, min_freq: int, max_size: int, max_len: int) -> None:
        self.root = root
        self.download = download
        self.min_freq = min_freq
        self.max_size = max_size
        self.max_len = max_len

    def tree(self) -> Path:
        return resolve_root(self.root) / "aclImdb"

    def info(self) -> DataInfo:
        # The embedding table has room for max_size words + <pad> + <unk> whatever the corpus holds,
        # so models can be built (and checked) before the vocabulary exists.
        return DataInfo(num_classes=2, input_shape=(self.max_len,), vocab_size=self.max_size + 2, pad_index=0)

    def missing(self) -> list[Path]:
        splits = [self.tree() / s / c for s in ("train", "test") for c in ("pos", "neg")]
        return [folder for folder in splits if not folder.is_dir()]

    def to_download(self) -> Download | None:
        if not (self.download and self.missing()):
            return None
        return Download(
            name=self.name,
            urls=(IMDB_URL,),
            into=resolve_root(self.root),
            setting_root=self.root,
            layout="aclImdb/{train,test}/{pos,neg}/*.txt (the archive, unpacked)",
        )

    def check(self) -> None:
        if self.missing() and not self.download:
            raise missing_files_error("imdb", self.tree(), self.root)

    def prepare(self, work_dir: Path) -> None:
        download = self.to_download()
        if download is not None:
            with fetched(download):
                download_imdb(resolve_root(self.root))
        self.check()
        texts, _ = read_split(self.tree() / "train")
        vocab = Vocab.build(texts, min_freq=self.min_freq, max_size=self.max_size)
        atomic_write_text(work_dir / VOCAB_FILE, json.dumps(vocab.tokens))

    def load(self, work_dir: Path) -> Splits:
        vocab = Vocab(json.loads((work_dir / VOCAB_FILE).read_text()))
        splits = []
        for name in ("train", "test"):
            texts, labels = read_split(self.tree() / name)
            ids = torch.tensor([vocab.encode(t, self.max_len) for t in texts], dtype=torch.long)
            splits.append(Split.from_tensors(ids.reshape(len(texts), self.max_len), torch.tensor(labels)))
        return Splits(train=splits[0], eval=splits[1], info=self.info(), fingerprint=vocab.fingerprint())


def read_split(folder: Path) -> tuple[list[str], list[int]]:
    """Reviews of one split in a fixed order (sorted file names): neg = 0, pos = 1."""
    texts, labels = [], []
    for label, sub in enumerate(("neg", "pos")):
        for path in sorted((folder / sub).glob("*.txt")):
            texts.append(path.read_text(encoding="utf-8"))
            labels.append(label)
    return texts, labels


IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
IMDB_MD5 = "7c2ac02c03563afcf9b574c7e56c153a"


def download_imdb(root: Path) -> None:
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(IMDB_URL, str(root), md5=IMDB_MD5)


def imdb(
    *,
    root: str = "data",
    download: bool = False,
    min_freq: int = 2,
    max_size: int = 20000,
    max_len: int = 256,
) -> IMDB:
    return IMDB(root=root, download=download, min_freq=min_freq, max_size=max_size, max_len=max_len)

"""The types every data source shares: what a model needs to know, the splits, the source contract,
and the one-line errors for missing or damaged files and for downloads that cannot happen."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from ..errors import UserError


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know to fit the data (wired into the model's build function)."""

    num_classes: int
    input_shape: tuple[int, ...]  # (C, H, W) for images; (L,) token ids for text
    vocab_size: int | None = None  # text only: rows of the embedding table
    pad_index: int | None = None  # text only: the padding token's id
    # What the targets are: "class" indices (num_classes = classes), float "value"s for regression
    # (num_classes = outputs per sample), or "token" ids, one per input position (language modelling:
    # num_classes = vocab_size). The task must match (ddpexp/tasks.py).
    targets: str = "class"
    # Split sizes, where the source knows them without loading (pre-flight refuses a run that would
    # take no optimizer step); None: checked by each worker once the data is loaded.
    train_samples: int | None = None
    eval_samples: int | None = None
    # Tokens each sample trains on (a token stream's block_size): the engine reports tokens/s and MFU
    # from it. None: not a token stream (padded text classification included).
    tokens_per_sample: int | None = None

    def model_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"num_classes": self.num_classes, "input_shape": list(self.input_shape)}
        if self.vocab_size is not None:
            kwargs.update(vocab_size=self.vocab_size, pad_index=self.pad_index)
        return kwargs


@dataclass
class Split:
    dataset: Dataset[Any]
    # (inputs, targets) when the whole split is in memory with no per-sample transform: lets the
    # device-resident loader skip the DataLoader entirely.
    tensors: tuple[torch.Tensor, torch.Tensor] | None = None
    collate: Callable[[list[Any]], Any] | None = None
    # Batch-level training augmentation, applied on the device (e.g. CIFAR crop + flip).
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None
    # What every batch's inputs and targets are converted to on the device, both splits: data stored
    # compactly (uint8 tokens) widened to what the model and the loss take. None: as stored.
    batch_dtype: torch.dtype | None = None

    @classmethod
    def from_tensors(cls, x: torch.Tensor, y: torch.Tensor) -> Split:
        return cls(dataset=TensorDataset(x, y), tensors=(x, y))


@dataclass
class Splits:
    train: Split
    eval: Split
    info: DataInfo
    # Identifies derived state that must be identical on every rank (e.g. a vocabulary's hash).
    fingerprint: str | None = None
    # What the run records about its data (metrics.json facts.data_facts): a corpus's size, where it
    # came from, the Python version a corpus of its standard library was read from.
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Download:
    """What a source would fetch now (data.download=true and files missing): from any one of `urls`
    (mirrors, tried in order) into `into`, where the files go in their published `layout`."""

    name: str
    urls: tuple[str, ...]
    into: Path
    setting_root: str  # data.root as given
    layout: str  # the files as they must lie under data.root, for a user who copies them in

    def error(self, url: str, reason: str) -> Exception:
        """The one line for a download that cannot happen (pre-flight) or did not (rank 0's prepare)."""
        others = len(self.urls) - 1
        tried = f" (nor {others} other mirror{'s' * (others > 1)})" if others > 0 else ""
        return UserError(
            f"{self.name} cannot be downloaded into {self.into}: {url}{tried}: {reason}",
            setting="data.download",
            fix=f"download them on a machine with network and copy them into data.root={self.setting_root} "
            f"as {self.layout}, then set data.download=false; or use data=synthetic or data=digits, which "
            "need no files",
        )


@contextlib.contextmanager
def fetched(download: Download) -> Iterator[None]:
    """A download that fails (no route, a refused or dropped connection, a bad checksum: torchvision
    raises URLError, other OSErrors or RuntimeError) ends as the same one line pre-flight gives."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        reason = getattr(exc, "reason", None) or exc
        # torchvision's mirror loop says "Error downloading F: Tried M, got: ..." over several lines.
        raise download.error(download.urls[0], " ".join(str(reason).split())) from exc


class DataSource:
    """A dataset before loading. Subclasses override what applies to them."""

    name = "dataset"

    def to_download(self) -> Download | None:
        """What prepare() would download, or None: nothing (files present, data.download=false, or a
        source with nothing to fetch). Cheap, no network: pre-flight checks its hosts can be reached."""
        return None

    def info(self) -> DataInfo:
        raise NotImplementedError

    def check(self) -> None:
        """Raise UserError if the data cannot be loaded (files missing...). Cheap, no side effects."""

    def prepare(self, work_dir: Path) -> None:
        """Once per run, on rank 0 only, before the others load (downloads, vocabularies)."""

    def load(self, work_dir: Path) -> Splits:
        raise NotImplementedError


def resolve_root(root: str) -> Path:
    """Dataset roots are relative to the directory ddpexp was started from (never the run dir)."""
    return Path(root).expanduser().resolve()


def missing_files_error(
    name: str, expected: Path, setting_root: str, missing: list[str] | None = None
) -> Exception:
    """`missing`: the files that are not there, named when only some are (an interrupted copy)."""
    which = f" ({', '.join(missing)} missing)" if missing else ""
    return UserError(
        f"{name} files not found at {expected}{which} and data.download=false",
        setting="data.root",
        fix=f"set data.download=true (needs network), point data.root={setting_root} elsewhere, "
        "or use data=digits (ships with scikit-learn)",
    )


def corrupt_file_error(
    path: Path,
    problem: str,
    fix: str = "delete the file and run with data.download=true to fetch it again, or copy in an intact one",
) -> Exception:
    """A dataset file that is there but damaged (a cut-off download, another file under its name)."""
    return UserError(f"{path}: {problem}", setting="data.root", fix=fix)

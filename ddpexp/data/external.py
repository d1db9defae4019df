"""Datasets of your own, without writing a DataSource: `data._target_` may name any builder (function
or class) that returns a map-style `torch.utils.data.Dataset` of (input, target) samples, such as
`torchvision.datasets.FakeData` or a function of yours returning `ImageFolder(...)`. It may return

- one Dataset: ddpexp holds out `data.val_fraction` of it (default 0.1) for evaluation, the same
  samples in every run and on every rank (a permutation seeded with `data.split_seed`, default 0);
- a (train, eval) pair, or a dict with `train` and `eval` (or `val`/`validation`/`test`).

What the model is built for (`DataInfo`) is read from the data: `input_shape` from the first sample
(PIL images become tensors with torchvision's ToTensor), `num_classes` from `data.num_classes` if set,
else the dataset's `classes`, `num_classes` or `targets` attribute (a TensorDataset's labels); float
targets are regression values (num_classes = values per sample). Samples go through torch's
DataLoader in the usual DistributedSampler order (loaders.py).

`val_fraction`, `split_seed` and `num_classes` are ddpexp's settings here: they are passed to the
builder only where it declares a parameter of that name (FakeData's `num_classes`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Subset

from ..errors import UserError
from .source import DataInfo, DataSource, Split, Splits

# ddpexp's settings for the datasets it wraps, and their defaults.
SETTINGS: dict[str, Any] = {"val_fraction": 0.1, "split_seed": 0, "num_classes": None}
EVAL_NAMES = ("eval", "val", "validation", "test")


def keyword_parameters(target: Any) -> set[str] | None:
    """The keyword parameters of a builder; None when it takes **kwargs or cannot be inspected."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def is_dataset(made: Any) -> bool:
    return isinstance(made, Dataset) or (hasattr(made, "__getitem__") and hasattr(made, "__len__"))


class External(DataSource):
    """A DataSource around the Dataset(s) a builder of yours returned (see the module docstring)."""

    def __init__(
        self,
        made: Any,
        *,
        target: str,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        num_classes: int | None = None,
    ) -> None:
        self.target = target
        self.name = target.rsplit(".", 1)[-1]
        self.num_classes = num_classes
        self.train, self.eval = self._splits(made, val_fraction, split_seed)
        self._info: DataInfo | None = None

    def _splits(self, made: Any, val_fraction: float, seed: int) -> tuple[Dataset[Any], Dataset[Any]]:
        if isinstance(made, Mapping):
            eval_key = next((k for k in EVAL_NAMES if k in made), None)
            if "train" not in made or eval_key is None:
                raise UserError(
                    f"{self.target} returned a dict with {sorted(made)}",
                    setting="data._target_",
                    fix="return {'train': ..., 'eval': ...}, a (train, eval) pair, or one Dataset",
                )
            pair = [made["train"], made[eval_key]]
        elif isinstance(made, tuple | list) and len(made) == 2:
            pair = list(made)
        elif is_dataset(made) and not isinstance(made, tuple | list):
            pair = self._held_out(made, val_fraction, seed)
        else:
            raise UserError(
                f"{self.target} returned a value of type {type(made).__name__}, not a Dataset",
                setting="data._target_",
                fix="return a torch Dataset, a (train, eval) pair of them, or a ddpexp DataSource",
            )
        for dataset in pair:
            self._check_indexable(dataset)
        return pair[0], pair[1]

    def _check_indexable(self, dataset: Any) -> None:
        if isinstance(dataset, IterableDataset) or not is_dataset(dataset):
            raise UserError(
                f"{self.target} gives a {type(dataset).__name__}, which cannot be indexed: ddpexp shards "
                "data by sample index (DistributedSampler)",
                setting="data._target_",
                fix="return a map-style Dataset (with __getitem__ and __len__)",
            )
        if len(dataset) == 0:
            raise UserError(f"{self.target} gives an empty dataset", setting="data._target_")

    def _held_out(self, dataset: Any, fraction: float, seed: int) -> list[Dataset[Any]]:
        """train / eval parts of one dataset: the same samples for a given seed, whatever else runs."""
        self._check_indexable(dataset)
        n = len(dataset)
        held = round(n * fraction)
        if not 0 < fraction < 1 or not 0 < held < n:
            raise UserError(
                f"is {fraction}, which holds out {held} of {self.target}'s {n} samples for evaluation",
                setting="data.val_fraction",
                fix="set +data.val_fraction to a fraction between 0 and 1 that leaves samples on both sides",
            )
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        return [Subset(dataset, order[held:]), Subset(dataset, order[:held])]

    def info(self) -> DataInfo:
        if self._info is None:
            self._info = self._infer()
        return self._info

    def check(self) -> None:
        self.info()  # reads the first sample: a dataset that cannot say what it holds stops here

    def load(self, work_dir: Path) -> Splits:
        return Splits(
            train=Split(dataset=_Tensors(self.train)),
            eval=Split(dataset=_Tensors(self.eval)),
            info=self.info(),
        )

    def _infer(self) -> DataInfo:
        sample = self.train[0]
        if not (isinstance(sample, tuple | list) and len(sample) == 2):
            raise UserError(
                f"a sample of {self.target} is a {type(sample).__name__}, not an (input, target) pair",
                setting="data._target_",
                fix="make the dataset's __getitem__ return (input, target)",
            )
        x, y = _to_tensor(sample[0]), sample[1]
        if not isinstance(x, torch.Tensor):
            raise UserError(
                f"the inputs of {self.target} are {type(x).__name__}s, not tensors or PIL images",
                setting="data._target_",
                fix="give the dataset a transform that returns tensors (e.g. torchvision's ToTensor())",
            )
        y = torch.as_tensor(y)
        if y.is_floating_point():  # regression: the model outputs one value per target value
            outputs = self.num_classes or max(1, y.numel())
            return DataInfo(num_classes=outputs, input_shape=tuple(x.shape), targets="value")
        return DataInfo(num_classes=self._num_classes(), input_shape=tuple(x.shape))

    def _num_classes(self) -> int:
        if self.num_classes is not None:
            return int(self.num_classes)
        for dataset in (*_layers(self.train), *_layers(self.eval)):
            if isinstance(getattr(dataset, "classes", None), list | tuple):
                return len(dataset.classes)
            if isinstance(getattr(dataset, "num_classes", None), int):
                return int(dataset.num_classes)
        labels = [
            t for d in (self.train, self.eval) for layer in _layers(d) if (t := _targets(layer)) is not None
        ]
        if labels:
            return int(max(int(t.max()) for t in labels)) + 1
        raise UserError(
            f"cannot tell how many classes {self.target} has (no `classes`, `num_classes` or `targets` "
            "attribute)",
            setting="data.num_classes",
            fix="add +data.num_classes=N",
        )


def _layers(dataset: Any) -> list[Any]:
    """A dataset and the ones it wraps (Subset, ConcatDataset's first...), outermost first."""
    out = [dataset]
    while (inner := getattr(out[-1], "dataset", None)) is not None and len(out) < 10:
        out.append(inner)
    return out


def _targets(dataset: Any) -> torch.Tensor | None:
    """Every label of a dataset that keeps them in `targets` (torchvision's) or is a TensorDataset."""
    tensors = getattr(dataset, "tensors", None)  # TensorDataset: (inputs, labels)
    targets = getattr(dataset, "targets", tensors[-1] if isinstance(tensors, tuple) and tensors else None)
    if targets is None:
        return None
    try:
        t = torch.as_tensor(targets)
    except (TypeError, ValueError, RuntimeError):
        return None
    return t if t.numel() and not t.is_floating_point() else None


def _to_tensor(x: Any) -> Any:
    from PIL import Image

    if isinstance(x, Image.Image):
        from torchvision.transforms.functional import to_tensor

        return to_tensor(x)
    if type(x).__module__ == "numpy":
        return torch.as_tensor(x)
    return x


class _Tensors(Dataset[Any]):
    """Samples with PIL-image inputs turned into tensors (what torch's DataLoader can batch)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        x, y = self.dataset[index]
        return _to_tensor(x), y

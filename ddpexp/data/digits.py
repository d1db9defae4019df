"""scikit-learn's handwritten digits: 1,797 real 8x8 scans shipped inside the package, so the default
experiment runs offline. Upsampled to 28x28 so that the classic MNIST ConvNet runs on it unchanged."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UserError
from .source import DataInfo, DataSource, Split, Splits

SAMPLES = 1797  # the scans scikit-learn ships (load() reads them; a test checks the count)


class Digits(DataSource):
    name = "digits"

    def __init__(self, *, image_size: int, eval_fraction: float, split_seed: int) -> None:
        self.image_size = image_size
        self.eval_fraction = eval_fraction
        self.split_seed = split_seed

    def info(self) -> DataInfo:
        n_eval = round(SAMPLES * self.eval_fraction)
        return DataInfo(
            num_classes=10,
            input_shape=(1, self.image_size, self.image_size),
            train_samples=SAMPLES - n_eval,
            eval_samples=n_eval,
        )

    def load(self, work_dir: Path) -> Splits:
        pixels, labels = read_digits()
        x = torch.as_tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        if self.image_size != 8:
            x = F.interpolate(
                x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        y = torch.as_tensor(labels, dtype=torch.long)
        # A fixed split, independent of the run's seed: every run evaluates on the same images.
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.split_seed))
        n_eval = round(len(y) * self.eval_fraction)
        eval_idx, train_idx = order[:n_eval], order[n_eval:]
        mean, std = x[train_idx].mean(), x[train_idx].std()
        x = (x - mean) / std
        return Splits(
            train=Split.from_tensors(x[train_idx], y[train_idx]),
            eval=Split.from_tensors(x[eval_idx], y[eval_idx]),
            info=self.info(),
        )


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits CSV as scikit-learn ships it (64 pixel columns, then the label), read directly:
    importing scikit-learn itself would cost a second of start-up for nothing."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("scikit-learn is not installed", setting="data", fix="pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return table[:, :-1], table[:, -1].astype(np.int64)


def digits(*, image_size: int = 28, eval_fraction: float = 0.2, split_seed: int = 0) -> Digits:
    return Digits(image_size=image_size, eval_fraction=eval_fraction, split_seed=split_seed)

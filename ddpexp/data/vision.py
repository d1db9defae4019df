"""Image datasets through torchvision: MNIST, Fashion-MNIST, CIFAR-10.

Downloads go through torchvision (rank 0 only, checksums verified there). The files are then read in
their published on-disk format: MNIST/Fashion-MNIST IDX files by torchvision's own dataset classes,
CIFAR-10 python pickle batches by `read_cifar10` below (torchvision's class insists on the official
checksums, which would also reject a legitimately re-packed copy). Whole splits become tensors, so the
device-resident loader serves them; CIFAR-10's crop+flip augmentation runs per batch on the device.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import DataInfo, DataSource, Split, Splits, missing_files_error, resolve_root


class TorchvisionMNIST(DataSource):
    """MNIST or Fashion-MNIST: 28x28 grey images, 10 classes, 60k train / 10k test."""

    def __init__(self, *, name: str, root: str, download: bool, mean: float, std: float) -> None:
        self.name = name
        self.root = root
        self.download = download
        self.mean, self.std = mean, std

    @property
    def dataset_class(self) -> type:
        from torchvision import datasets

        return datasets.FashionMNIST if self.name == "fashion_mnist" else datasets.MNIST

    def raw_dir(self) -> Path:
        return resolve_root(self.root) / self.dataset_class.__name__ / "raw"

    def info(self) -> DataInfo:
        return DataInfo(num_classes=10, input_shape=(1, 28, 28))

    def check(self) -> None:
        names = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"]
        if not self.download and not all((self.raw_dir() / n).exists() for n in names):
            raise missing_files_error(self.name, self.raw_dir(), self.root)

    def prepare(self, work_dir: Path) -> None:
        if self.download:
            for train in (True, False):
                self.dataset_class(str(resolve_root(self.root)), train=train, download=True)

    def load(self, work_dir: Path) -> Splits:
        self.check()
        splits = []
        for train in (True, False):
            ds = self.dataset_class(str(resolve_root(self.root)), train=train, download=False)
            x = (ds.data.unsqueeze(1).float() / 255.0 - self.mean) / self.std
            splits.append(Split.from_tensors(x, ds.targets.long()))
        return Splits(train=splits[0], eval=splits[1], info=self.info())


def mnist(*, root: str = "data", download: bool = False) -> TorchvisionMNIST:
    return TorchvisionMNIST(name="mnist", root=root, download=download, mean=0.1307, std=0.3081)


def fashion_mnist(*, root: str = "data", download: bool = False) -> TorchvisionMNIST:
    return TorchvisionMNIST(name="fashion_mnist", root=root, download=download, mean=0.2860, std=0.3530)


CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = ["test_batch"]
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class CIFAR10(DataSource):
    name = "cifar10"

    def __init__(self, *, root: str, download: bool, augment: bool, crop_padding: int) -> None:
        self.root = root
        self.download = download
        self.augment = augment
        self.crop_padding = crop_padding

    def batch_dir(self) -> Path:
        return resolve_root(self.root) / CIFAR_DIR

    def info(self) -> DataInfo:
        return DataInfo(num_classes=10, input_shape=(3, 32, 32))

    def check(self) -> None:
        if not self.download and not all((self.batch_dir() / n).exists() for n in CIFAR_TRAIN + CIFAR_TEST):
            raise missing_files_error("cifar10", self.batch_dir(), self.root)

    def prepare(self, work_dir: Path) -> None:
        if self.download:
            from torchvision import datasets

            datasets.CIFAR10(str(resolve_root(self.root)), train=True, download=True)

    def load(self, work_dir: Path) -> Splits:
        self.check()
        mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        out = []
        for names in (CIFAR_TRAIN, CIFAR_TEST):
            images, labels = read_cifar10([self.batch_dir() / n for n in names])
            x = (torch.from_numpy(images).float() / 255.0 - mean) / std
            out.append(Split.from_tensors(x, torch.from_numpy(labels)))
        if self.augment:
            out[0].augment = RandomCropFlip(self.crop_padding)
        return Splits(train=out[0], eval=out[1], info=self.info())


def read_cifar10(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """The python-pickle batches: each a dict with b"data" (N x 3072 uint8, channel-major 32x32) and
    b"labels" (N ints)."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


class RandomCropFlip:
    """CIFAR-style augmentation for a whole batch at once, on whatever device it sits: zero-pad by p,
    take a random HxW crop per image, flip half the images horizontally."""

    def __init__(self, padding: int) -> None:
        self.padding = padding

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        p = self.padding
        if p > 0:
            padded = F.pad(x, (p, p, p, p))
            dy = torch.randint(0, 2 * p + 1, (n, 1, 1, 1), device=x.device)
            dx = torch.randint(0, 2 * p + 1, (n, 1, 1, 1), device=x.device)
            rows = (torch.arange(h, device=x.device).view(1, 1, h, 1) + dy).expand(n, c, h, w + 2 * p)
            cols = (torch.arange(w, device=x.device).view(1, 1, 1, w) + dx).expand(n, c, h, w)
            x = padded.gather(2, rows).gather(3, cols)
        flip = torch.rand(n, 1, 1, 1, device=x.device) < 0.5
        return torch.where(flip, x.flip(3), x)


def cifar10(
    *, root: str = "data", download: bool = False, augment: bool = True, crop_padding: int = 4
) -> CIFAR10:
    return CIFAR10(root=root, download=download, augment=augment, crop_padding=crop_padding)

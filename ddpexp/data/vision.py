"""Image datasets through torchvision: MNIST, Fashion-MNIST, CIFAR-10.

Downloads go through torchvision (rank 0 only, checksums verified there). The files are then read in
their published on-disk format: MNIST/Fashion-MNIST IDX files by torchvision's own dataset classes,
CIFAR-10 python pickle batches by `read_cifar10` below (torchvision's class insists on the official
checksums, which would also reject a legitimately re-packed copy). Whole splits become tensors, so the
device-resident loader serves them; CIFAR-10's crop+flip augmentation runs per batch on the device.

A damaged file is named with what is wrong with it: IDX headers, counts and sizes in pre-flight (a few
bytes per file), CIFAR-10 batches when they are unpickled (torchvision would assert or raise deep down).
"""

from __future__ import annotations

import math
import pickle
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from .source import (
    DataInfo,
    DataSource,
    Download,
    Split,
    Splits,
    corrupt_file_error,
    fetched,
    missing_files_error,
    resolve_root,
)

if TYPE_CHECKING:  # torchvision is imported when a dataset of its is used
    from torchvision.datasets import MNIST

MNIST_SPLITS = ("train", "t10k")
# IDX magic numbers: 0x08 = unsigned bytes, then the number of dimensions.
IDX_IMAGES, IDX_LABELS = 0x00000803, 0x00000801
CLASSES = 10


class TorchvisionMNIST(DataSource):
    """MNIST or Fashion-MNIST: 28x28 grey images, 10 classes, 60k train / 10k test."""

    def __init__(self, *, name: str, root: str, download: bool, mean: float, std: float) -> None:
        self.name = name
        self.root = root
        self.download = download
        self.mean, self.std = mean, std

    @property
    def dataset_class(self) -> type[MNIST]:
        from torchvision import datasets

        return datasets.FashionMNIST if self.name == "fashion_mnist" else datasets.MNIST

    def raw_dir(self) -> Path:
        return resolve_root(self.root) / self.dataset_class.__name__ / "raw"

    def info(self) -> DataInfo:
        return DataInfo(num_classes=10, input_shape=(1, 28, 28))

    def missing(self) -> list[str]:
        raw = self.raw_dir()
        return [name for split in MNIST_SPLITS for name in idx_names(split) if not (raw / name).exists()]

    def to_download(self) -> Download | None:
        if not (self.download and self.missing()):
            return None
        folder = self.dataset_class.__name__
        return Download(
            name=self.name,
            urls=tuple(self.dataset_class.mirrors),
            into=self.raw_dir(),
            setting_root=self.root,
            layout=f"{folder}/raw/{{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte (IDX files, unzipped)",
        )

    def check(self) -> None:
        raw = self.raw_dir()
        names = [name for split in MNIST_SPLITS for name in idx_names(split)]
        missing = self.missing()
        if missing and not self.download:
            raise missing_files_error(
                self.name, raw, self.root, missing if len(missing) < len(names) else None
            )
        if not missing:  # with download=true, torchvision only fetches files that are not there
            for split in MNIST_SPLITS:
                check_idx_pair(*(raw / name for name in idx_names(split)))

    def prepare(self, work_dir: Path) -> None:
        download = self.to_download()
        if download is not None:
            with fetched(download):
                for train in (True, False):
                    self.dataset_class(str(resolve_root(self.root)), train=train, download=True)

    def load(self, work_dir: Path) -> Splits:
        self.check()
        splits = []
        for train in (True, False):
            ds = self.dataset_class(str(resolve_root(self.root)), train=train, download=False)
            if len(ds.targets) and int(ds.targets.max()) >= CLASSES:
                labels = self.raw_dir() / idx_names(MNIST_SPLITS[0 if train else 1])[1]
                raise corrupt_file_error(labels, f"holds label {int(ds.targets.max())}; classes are 0..9")
            x = (ds.data.unsqueeze(1).float() / 255.0 - self.mean) / self.std
            splits.append(Split.from_tensors(x, ds.targets.long()))
        return Splits(train=splits[0], eval=splits[1], info=self.info())


def idx_names(split: str) -> tuple[str, str]:
    """The images and labels files of one split ("train" or "t10k")."""
    return f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"


def check_idx_pair(images: Path, labels: Path) -> None:
    """Headers and sizes of one split's IDX files: 28x28 images, one label per image, nothing cut off."""
    n, rows, cols = idx_shape(images, IDX_IMAGES, "images of {}x{}")
    if (rows, cols) != (28, 28):
        raise corrupt_file_error(images, f"holds {rows}x{cols} images, expected 28x28")
    (count,) = idx_shape(labels, IDX_LABELS, "labels")
    if count != n:
        raise corrupt_file_error(labels, f"holds {count} labels but {images.name} holds {n} images")


def idx_shape(path: Path, magic: int, unit: str) -> tuple[int, ...]:
    """The dimensions an IDX file's header declares (the magic number's last byte says how many),
    checked against the file's size. `unit` names what the first dimension counts, in messages."""
    dims = magic % 256
    header_size = 4 * (1 + dims)
    with open(path, "rb") as f:
        header = f.read(header_size)
    if len(header) < header_size:
        raise corrupt_file_error(path, f"truncated: {len(header)} bytes, shorter than its IDX header")
    found = int.from_bytes(header[:4], "big")
    if found != magic:
        raise corrupt_file_error(path, f"bad magic number 0x{found:08x} (expected 0x{magic:08x})")
    shape: tuple[int, ...] = struct.unpack(f">{dims}I", header[4:])
    expected = header_size + math.prod(shape)
    size = path.stat().st_size
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        what = f"{shape[0]} {unit.format(*shape[1:])}"
        raise corrupt_file_error(
            path, f"{state}: {size} bytes, but its header declares {what} ({expected} bytes)"
        )
    return shape


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

    def missing(self) -> list[str]:
        return [name for name in CIFAR_TRAIN + CIFAR_TEST if not (self.batch_dir() / name).exists()]

    def to_download(self) -> Download | None:
        if not (self.download and self.missing()):
            return None
        from torchvision import datasets

        return Download(
            name=self.name,
            urls=(datasets.CIFAR10.url,),
            into=resolve_root(self.root),
            setting_root=self.root,
            layout=f"{CIFAR_DIR}/{{data_batch_1..5,test_batch}} (the python version, unpacked)",
        )

    def check(self) -> None:
        """Every batch is there and not empty; what is inside is checked as it is unpickled (a whole
        batch has to be read for that: too slow for pre-flight)."""
        names = CIFAR_TRAIN + CIFAR_TEST
        paths = [self.batch_dir() / name for name in names]
        missing = self.missing()
        if missing and not self.download:
            raise missing_files_error(
                "cifar10", self.batch_dir(), self.root, missing if len(missing) < len(names) else None
            )
        empty = next((path for path in paths if path.exists() and path.stat().st_size == 0), None)
        if empty is not None:
            raise corrupt_file_error(empty, "is empty")

    def prepare(self, work_dir: Path) -> None:
        download = self.to_download()
        if download is not None:
            from torchvision import datasets

            with fetched(download):
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
        batch_images, batch_labels = read_cifar10_batch(path)
        images.append(batch_images)
        labels.append(batch_labels)
    return np.concatenate(images), np.concatenate(labels)


def read_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch as (N x 3 x 32 x 32 uint8, N int64), or a UserError naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
    except OSError as exc:
        raise corrupt_file_error(path, f"cannot be read ({exc.strerror or exc})") from exc
    except Exception as exc:  # a damaged pickle raises nearly anything: UnpicklingError, EOFError, ...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise corrupt_file_error(path, f"does not unpickle ({reason})") from exc
    # Batches pickled by python 3 may have str keys instead of the original's bytes keys.
    fields = (
        {k.decode(errors="replace") if isinstance(k, bytes) else k: v for k, v in batch.items()}
        if isinstance(batch, dict)
        else {}
    )
    lacking = [key for key in ("data", "labels") if key not in fields]
    if lacking:
        raise corrupt_file_error(path, f"lacks {' and '.join(lacking)}: not a CIFAR-10 python batch")
    data = np.asarray(fields["data"])
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        shape = " x ".join(map(str, data.shape)) or "a single value"
        raise corrupt_file_error(path, f"data is {shape}, expected N x 3072 (32x32 RGB, one row per image)")
    try:
        labels = np.asarray(fields["labels"], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise corrupt_file_error(path, "holds labels that are not integers") from exc
    if labels.shape != (len(data),):
        raise corrupt_file_error(path, f"holds {labels.size} labels but {len(data)} images")
    if len(labels) and not 0 <= labels.min() <= labels.max() < CLASSES:
        raise corrupt_file_error(path, f"holds labels {labels.min()}..{labels.max()}; classes are 0..9")
    return data.astype(np.uint8).reshape(-1, 3, 32, 32), labels


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

"""A class-per-folder image dataset (the tutorials' flower classification): root/<class>/*.jpg|png.

Either separate folders (`train_dir`, `val_dir`) or one folder split by a fixed seed (`val_fraction`).
Training images get a random resized crop and a horizontal flip, evaluation images a resize and a
centre crop, all at `image_size`, normalised with the ImageNet statistics. Per-image decoding and
transforms run in torch's DataLoader (set loader.num_workers to decode in parallel).

Damaged input is named with what is wrong: a class folder without images and an empty image file in
pre-flight (a listing and a size per file), an image that does not decode when it is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset

from ..errors import UserError
from .source import DataInfo, DataSource, Split, Splits, corrupt_file_error, resolve_root

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# torchvision's IMG_EXTENSIONS, named here so that pre-flight checks the files ImageFolder reads.
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
FIX = "replace or delete the file (every image under the class folders is read)"


class ImageFolderData(DataSource):
    name = "image_folder"

    def __init__(
        self,
        *,
        root: str,
        train_dir: str,
        val_dir: str | None,
        val_fraction: float,
        split_seed: int,
        image_size: int,
    ) -> None:
        self.root = root
        self.train_dir = train_dir
        self.val_dir = val_dir
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.image_size = image_size

    def _dir(self, sub: str) -> Path:
        return resolve_root(self.root) / sub

    def classes(self) -> list[str]:
        train = self._dir(self.train_dir)
        if not train.is_dir():
            raise UserError(
                f"no image folder at {train}",
                setting="data.root",
                fix="point data.root (and data.train_dir) at a folder with one sub-folder per class",
            )
        classes = sorted(p.name for p in train.iterdir() if p.is_dir())
        if len(classes) < 2:
            raise UserError(
                f"{train} has {len(classes)} class folder(s); classification needs at least 2",
                setting="data.root",
                fix="use a folder holding one sub-folder of images per class",
            )
        return classes

    def info(self) -> DataInfo:
        return DataInfo(num_classes=len(self.classes()), input_shape=(3, self.image_size, self.image_size))

    def check(self) -> None:
        classes = self.classes()
        _check_images(self._dir(self.train_dir), classes)
        if self.val_dir is not None:
            val = self._dir(self.val_dir)
            val_classes = sorted(p.name for p in val.iterdir() if p.is_dir()) if val.is_dir() else []
            if val_classes != classes:
                raise UserError(
                    f"{val} must hold the same class folders as {self._dir(self.train_dir)} ({len(classes)})",
                    setting="data.val_dir",
                    fix="fix the folders, or set data.val_dir=null to split the training folder",
                )
            _check_images(val, classes)
        elif not 0 < self.val_fraction < 1:
            raise UserError(
                f"must be between 0 and 1, got {self.val_fraction}",
                setting="data.val_fraction",
                fix="use e.g. data.val_fraction=0.2",
            )

    def transforms(self, train: bool) -> Any:
        from torchvision import transforms as T

        size = self.image_size
        head = (
            [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
            if train
            else [T.Resize(round(size * 256 / 224)), T.CenterCrop(size)]
        )
        return T.Compose([*head, T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def load(self, work_dir: Path) -> Splits:
        from torchvision.datasets import ImageFolder

        self.check()
        train_root = str(self._dir(self.train_dir))
        train_ds = ImageFolder(train_root, transform=self.transforms(True), loader=load_image)
        if self.val_dir is not None:
            eval_ds: Any = ImageFolder(
                str(self._dir(self.val_dir)), transform=self.transforms(False), loader=load_image
            )
        else:
            plain = ImageFolder(train_root, transform=self.transforms(False), loader=load_image)
            order = torch.randperm(len(plain), generator=torch.Generator().manual_seed(self.split_seed))
            n_val = max(1, round(len(plain) * self.val_fraction))
            eval_ds = Subset(plain, order[:n_val].tolist())
            train_ds = Subset(train_ds, order[n_val:].tolist())
        return Splits(train=Split(dataset=train_ds), eval=Split(dataset=eval_ds), info=self.info())


def _check_images(folder: Path, classes: list[str]) -> None:
    """Every class folder holds an image (ImageFolder's own walk: recursive, links followed), and no
    image file is empty."""
    for name in classes:
        images = [
            Path(top, file)
            for top, _, files in sorted(os.walk(folder / name, followlinks=True))
            for file in sorted(files)
            if file.lower().endswith(EXTENSIONS)
        ]
        if not images:
            raise UserError(
                f"{folder / name}: class folder holds no images ({', '.join(EXTENSIONS)})",
                setting="data.root",
                fix="put the class's images in it, or remove the folder",
            )
        empty = next((image for image in images if image.stat().st_size == 0), None)
        if empty is not None:
            raise corrupt_file_error(empty, "is empty (0 bytes)", FIX)


def load_image(path: str) -> Any:
    """ImageFolder's own loader (PIL, converted to RGB), naming the file an image that does not decode
    comes from (PIL's errors do not: "Truncated File Read")."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's UnidentifiedImageError is an OSError
        raise corrupt_file_error(Path(path), f"does not decode as an image ({exc})", FIX) from exc


def image_folder(
    *,
    root: str = "data/flower_photos",
    train_dir: str = ".",
    val_dir: str | None = None,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    image_size: int = 224,
) -> ImageFolderData:
    return ImageFolderData(
        root=root,
        train_dir=train_dir,
        val_dir=val_dir,
        val_fraction=val_fraction,
        split_seed=split_seed,
        image_size=image_size,
    )

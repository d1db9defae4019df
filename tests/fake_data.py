"""Small datasets written in each dataset's real on-disk format, so the real loading code reads them.

Labels are learnable where it matters (a class-dependent bright patch, or class words in reviews), so a
few training steps can show a falling loss.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np

RNG_SEED = 0


def _images(
    n: int, shape: tuple[int, ...], classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, classes, n).astype(np.uint8)
    images = rng.integers(0, 60, (n, *shape)).astype(np.uint8)
    for i, label in enumerate(labels):  # a bright block whose position encodes the class
        images[i, ..., 2 * label : 2 * label + 3, 2:6] = 250
    return images, labels


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX (the MNIST format): magic = 0x0000 0x08 (uint8) ndim, big-endian int32 dims, raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist(root: Path, folder: str = "MNIST", n_train: int = 96, n_test: int = 37) -> Path:
    rng = np.random.default_rng(RNG_SEED)
    raw = root / folder / "raw"
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images, labels = _images(n, (28, 28), 10, rng)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root


def write_cifar10(root: Path, per_batch: int = 20, n_test: int = 23) -> Path:
    """The python version: pickled dicts with b"data" (N x 3072 uint8) and b"labels"."""
    rng = np.random.default_rng(RNG_SEED)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else per_batch
        images, labels = _images(n, (3, 32, 32), 10, rng)
        batch = {b"batch_label": name.encode(), b"labels": labels.tolist(), b"data": images.reshape(n, -1)}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    meta = {b"label_names": [f"class{i}".encode() for i in range(10)], b"num_vis": 3072}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f)
    return root


def write_image_folder(root: Path, classes: int = 3, per_class: int = 12, size: int = 40) -> Path:
    from PIL import Image

    rng = np.random.default_rng(RNG_SEED)
    for c in range(classes):
        folder = root / f"flower{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, (size, size, 3)).astype(np.uint8)
            pixels[..., c] = 230  # the class is the dominant colour channel
            Image.fromarray(pixels).save(folder / f"img{i}.png")
    return root


POSITIVE = ["great", "wonderful", "superb", "loved", "brilliant", "moving"]
NEGATIVE = ["awful", "boring", "terrible", "hated", "dull", "waste"]
FILLER = ["the", "movie", "film", "plot", "actor", "scene", "story", "was", "and", "a", "it", "this"]


def write_aclimdb(root: Path, per_class: int = 15) -> Path:
    """aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt, reviews with HTML line breaks like the real ones."""
    rng = np.random.default_rng(RNG_SEED)
    for split in ("train", "test"):
        for label, words in (("pos", POSITIVE), ("neg", NEGATIVE)):
            folder = root / "aclImdb" / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                tokens = list(rng.choice(FILLER, 12)) + list(rng.choice(words, 4))
                rng.shuffle(tokens)
                rating = rng.integers(7, 11) if label == "pos" else rng.integers(1, 5)
                text = " ".join(tokens[:8]) + ".<br /><br />" + " ".join(tokens[8:]).capitalize() + "!"
                (folder / f"{i}_{rating}.txt").write_text(text, encoding="utf-8")
    return root


WRITERS = {
    "mnist": lambda root: write_mnist(root, "MNIST"),
    "fashion_mnist": lambda root: write_mnist(root, "FashionMNIST"),
    "cifar10": write_cifar10,
    "image_folder": write_image_folder,
    "imdb": write_aclimdb,
}

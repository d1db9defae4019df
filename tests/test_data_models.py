"""Datasets read from files in their real on-disk format; models run on matching inputs; models and
datasets are wired together automatically, and mismatches are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose
from hydra.utils import instantiate

from ddpexp import models
from ddpexp.data.imdb import PAD, UNK, Vocab, tokenize
from ddpexp.data.vision import RandomCropFlip
from ddpexp.errors import UserError

from .fake_data import WRITERS

# dataset: (train size, eval size, input shape, classes) of the generated files
EXPECTED = {
    "mnist": (96, 37, (1, 28, 28), 10),
    "fashion_mnist": (96, 37, (1, 28, 28), 10),
    "cifar10": (100, 23, (3, 32, 32), 10),
    "image_folder": (29, 7, (3, 32, 32), 3),
    "imdb": (30, 30, (256,), 2),
}
MODELS = {
    "convnet": "synthetic",
    "mlp": "synthetic",
    "toy": "synthetic",
    "resnet18": "cifar10",
    "resnet34": "cifar10",
    "gcnn": "imdb",
    "embbag": "imdb",
}


pytestmark = pytest.mark.usefixtures("hydra_conf")


def _source(data: str, root: Path, *extra: str):
    overrides = [f"data={data}", *extra]
    if data in WRITERS:
        WRITERS[data](root)
        overrides.append(f"data.root={root}")
    if data == "image_folder":
        overrides.append("data.image_size=32")
    return instantiate(compose(config_name="config", overrides=overrides).data)


@pytest.mark.parametrize("data", sorted(EXPECTED))
def test_dataset_loads_from_real_format_files(data: str, tmp_path: Path):
    source = _source(data, tmp_path / "root")
    source.check()
    work = tmp_path / "run"
    work.mkdir()
    source.prepare(work)
    splits = source.load(work)
    n_train, n_eval, shape, classes = EXPECTED[data]
    assert (len(splits.train.dataset), len(splits.eval.dataset)) == (n_train, n_eval)
    assert splits.info.num_classes == classes and tuple(splits.info.input_shape) == shape
    x, y = splits.train.dataset[0]
    assert tuple(x.shape) == shape and 0 <= int(y) < classes


def test_mnist_pixels_and_labels_survive_the_idx_round_trip(tmp_path: Path):
    import numpy as np

    from .fake_data import _images

    source = _source("mnist", tmp_path)
    splits = source.load(tmp_path)
    images, labels = _images(96, (28, 28), 10, np.random.default_rng(0))
    x, y = splits.train.tensors
    assert torch.equal(y, torch.as_tensor(labels, dtype=torch.long))
    torch.testing.assert_close(x[:, 0] * 0.3081 + 0.1307, torch.as_tensor(images).float() / 255)


@pytest.mark.parametrize("data", ["mnist", "fashion_mnist", "cifar10", "imdb"])
def test_missing_files_without_download_is_a_clear_error(data: str, tmp_path: Path):
    source = instantiate(
        compose(config_name="config", overrides=[f"data={data}", f"data.root={tmp_path}"]).data
    )
    with pytest.raises(UserError) as err:
        source.check()
    message = str(err.value)
    assert str(tmp_path) in message and "data.download=true" in message and "data=digits" in message


def test_image_folder_without_class_folders_is_a_clear_error(tmp_path: Path):
    source = instantiate(
        compose(config_name="config", overrides=["data=image_folder", f"data.root={tmp_path}"]).data
    )
    with pytest.raises(UserError, match="class folder"):
        source.check()


def test_image_folder_with_separate_val_folder(tmp_path: Path):
    from .fake_data import write_image_folder

    write_image_folder(tmp_path / "train", per_class=4)
    write_image_folder(tmp_path / "val", per_class=2)
    cfg = compose(
        config_name="config",
        overrides=[
            "data=image_folder",
            f"data.root={tmp_path}",
            "data.train_dir=train",
            "data.val_dir=val",
            "data.image_size=24",
        ],
    )
    splits = instantiate(cfg.data).load(tmp_path)
    assert (len(splits.train.dataset), len(splits.eval.dataset)) == (12, 6)
    assert splits.eval.dataset[0][0].shape == (3, 24, 24)


def test_tokenizer_and_vocabulary():
    assert tokenize("A <br />GREAT film, isn't it?") == ["a", "great", "film", ",", "isn't", "it", "?"]
    vocab = Vocab.build(["b a a c", "a b d"], min_freq=2, max_size=10)
    assert vocab.tokens == [PAD, UNK, "a", "b"]  # by frequency, ties alphabetical; c, d below min_freq
    assert vocab.encode("a c b", max_len=5) == [2, 1, 3, 0, 0]
    assert vocab.encode("a a a a a a", max_len=3) == [2, 2, 2]
    assert len(Vocab.build(["x y z w"], min_freq=1, max_size=2)) == 4


def test_imdb_vocabulary_comes_from_the_training_split_only(tmp_path: Path):
    from .fake_data import write_aclimdb

    write_aclimdb(tmp_path)
    (tmp_path / "aclImdb" / "test" / "pos" / "99_10.txt").write_text("zebra zebra zebra")
    source = _source("imdb", tmp_path / "x", f"data.root={tmp_path}", "data.min_freq=1")
    source.prepare(tmp_path)
    splits = source.load(tmp_path)
    tokens = Vocab(__import__("json").loads((tmp_path / "vocab.json").read_text())).tokens
    assert "zebra" not in tokens and "great" in tokens
    assert splits.fingerprint == Vocab(tokens).fingerprint()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_runs_forward_and_backward_on_its_data(name: str, tmp_path: Path):
    data = MODELS[name]
    source = _source(data, tmp_path, *(["data.shape=[3,32,32]"] if data == "synthetic" else []))
    cfg = compose(config_name="config", overrides=[f"model={name}"])
    source.prepare(tmp_path)
    splits = source.load(tmp_path)
    model = models.build(cfg.model, splits.info)
    x, y = (t[:4] for t in splits.train.tensors)
    out = model(x)
    assert out.shape == (4, splits.info.num_classes)
    F.cross_entropy(out, y).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_resnet_cifar_stem_keeps_32px_resolution():
    cfg = compose(config_name="config", overrides=["model=resnet18", "model.cifar_stem=true"])
    from ddpexp.data import DataInfo

    model = models.build(cfg.model, DataInfo(num_classes=10, input_shape=(1, 32, 32)))
    stem = model.stages()[0]
    assert stem(torch.zeros(2, 1, 32, 32)).shape == (2, 64, 32, 32)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model=gcnn", "data=digits"], ["token ids", "data=imdb"]),
        (["model=convnet", "data=imdb"], ["images", "model=gcnn"]),
        (["+model.num_classes=3"], ["model.num_classes", "10"]),
    ],
)
def test_model_and_dataset_mismatch_is_refused(overrides: list[str], words: list[str]):
    cfg = compose(config_name="config", overrides=overrides)
    source = instantiate(cfg.data)
    with pytest.raises(UserError) as err:
        models.build(cfg.model, source.info())
    for word in words:
        assert word in str(err.value)


def test_cifar_augmentation_crops_and_flips_per_image():
    torch.manual_seed(0)
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + 1
    out = RandomCropFlip(2)(x)
    assert out.shape == x.shape
    no_pad = RandomCropFlip(0)(x)
    for i in range(2):  # without padding only a flip can happen
        assert torch.equal(no_pad[i], x[i]) or torch.equal(no_pad[i], x[i].flip(2))
    # every output value comes from the image itself or the zero padding
    assert set(out.unique().tolist()) <= set(x.unique().tolist()) | {0.0}


def test_digits_says_its_split_sizes_before_loading(tmp_path: Path):
    """Pre-flight counts steps from these (no-step runs, faults that cannot fire): they must be true."""
    from ddpexp.data.digits import digits

    source = digits()
    splits = source.load(tmp_path)
    info = source.info()
    assert (info.train_samples, info.eval_samples) == (len(splits.train.dataset), len(splits.eval.dataset))


IDX_FILES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


@pytest.mark.parametrize("data", ["mnist", "fashion_mnist"])
@pytest.mark.parametrize("missing", IDX_FILES)
def test_a_missing_idx_file_is_named_before_anything_starts(data: str, missing: str, tmp_path: Path):
    source = _source(data, tmp_path)
    (source.raw_dir() / missing).unlink()
    with pytest.raises(UserError) as err:
        source.check()
    assert missing in str(err.value) and "data.download=true" in str(err.value)


def _corrupt_idx(raw: Path, how: str) -> tuple[str, list[str]]:
    """Damage one file the way real downloads get damaged; (the file, words the error must say)."""
    import numpy as np

    from .fake_data import write_idx

    images = raw / "train-images-idx3-ubyte"
    labels = raw / "train-labels-idx1-ubyte"
    if how == "magic":
        images.write_bytes(bytes([0, 0, 8, 1]) + images.read_bytes()[4:])
        return images.name, ["bad magic number 0x00000801", "expected 0x00000803"]
    if how == "counts":
        write_idx(labels, np.zeros(95, dtype=np.uint8))
        return labels.name, ["holds 95 labels but", "train-images-idx3-ubyte holds 96 images"]
    if how == "truncated":
        images.write_bytes(images.read_bytes()[:-100])
        return images.name, ["truncated", "96 images of 28x28"]
    if how == "header":
        labels.write_bytes(labels.read_bytes()[:6])
        return labels.name, ["truncated", "header"]
    if how == "size":
        write_idx(images, np.zeros((96, 32, 32), dtype=np.uint8))
        return images.name, ["32x32", "28x28"]
    raise AssertionError(how)


@pytest.mark.parametrize("data", ["mnist", "fashion_mnist"])
@pytest.mark.parametrize("how", ["magic", "counts", "truncated", "header", "size"])
def test_a_corrupt_idx_file_is_named_with_what_is_wrong(data: str, how: str, tmp_path: Path):
    source = _source(data, tmp_path)
    name, words = _corrupt_idx(source.raw_dir(), how)
    for step in (source.check, lambda: source.load(tmp_path)):  # pre-flight, and a worker's load
        with pytest.raises(UserError) as err:
            step()
        message = str(err.value)
        assert str(source.raw_dir() / name) in message and "\n" not in message, message
        assert all(word in message for word in words), message


def _corrupt_cifar(folder: Path, how: str) -> tuple[str, list[str]]:
    import pickle

    import numpy as np

    batch = folder / "data_batch_3"
    good = pickle.loads(batch.read_bytes(), encoding="bytes")
    if how == "garbage":
        batch.write_bytes(b"<html>404 not found</html>")
        return batch.name, ["does not unpickle"]
    if how == "truncated":
        batch.write_bytes(batch.read_bytes()[:1000])
        return batch.name, ["does not unpickle"]
    if how == "no labels":
        batch.write_bytes(pickle.dumps({b"data": good[b"data"]}))
        return batch.name, ["lacks", "labels"]
    if how == "not a dict":
        batch.write_bytes(pickle.dumps([1, 2, 3]))
        return batch.name, ["lacks", "data"]
    if how == "counts":
        batch.write_bytes(pickle.dumps({b"data": good[b"data"], b"labels": good[b"labels"][:-1]}))
        return batch.name, ["holds 19 labels but 20 images"]
    if how == "shape":
        batch.write_bytes(pickle.dumps({b"data": np.zeros((20, 100), np.uint8), b"labels": good[b"labels"]}))
        return batch.name, ["20 x 100", "3072"]
    if how == "empty":
        batch.write_bytes(b"")
        return batch.name, ["empty"]
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how", ["garbage", "truncated", "no labels", "not a dict", "counts", "shape", "empty"]
)
def test_a_corrupt_cifar_batch_is_named_with_what_is_wrong(how: str, tmp_path: Path):
    source = _source("cifar10", tmp_path)
    name, words = _corrupt_cifar(source.batch_dir(), how)
    if how == "empty":  # cheap enough for pre-flight
        with pytest.raises(UserError, match="empty"):
            source.check()
    with pytest.raises(UserError) as err:
        source.load(tmp_path)
    message = str(err.value)
    assert str(source.batch_dir() / name) in message and "\n" not in message, message
    assert all(word in message for word in words), message

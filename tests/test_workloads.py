"""Every (model, dataset) pair the README advertises trains a few steps under single and ddp (2 gloo
ranks), reading datasets from files in their real on-disk format through the real code path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ddpexp.data.imdb import Vocab

from .conftest import metrics, run_here
from .fake_data import write_aclimdb, write_cifar10, write_image_folder, write_mnist

pytestmark = pytest.mark.multiproc

FEW = ["-m", "strategy=single,ddp", "trainer.max_steps=3", "trainer.batch_size=8", "trainer.progress=false"]

# the README's list: sweep arguments -> (model, data) pairs it covers
WORKLOADS = {
    "mnist": (["model=convnet", "data=mnist,fashion_mnist"], write_mnist),
    "cifar10": (["model=resnet18", "model.cifar_stem=true", "data=cifar10"], write_cifar10),
    "image_folder": (["model=resnet34", "data=image_folder", "data.image_size=32"], write_image_folder),
    "imdb": (["model=gcnn,embbag", "data=imdb", "task=binary"], write_aclimdb),  # BCE, as tutorial 001
    "digits": (["model=toy", "data=digits"], None),
    "regression": (["model=toy", "data=synthetic_regression", "task=regression"], None),  # tutorial 004
}


def _write(writer, root: Path) -> None:
    if writer is write_mnist:
        write_mnist(root, "MNIST")
        write_mnist(root, "FashionMNIST")
    elif writer is not None:
        writer(root)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_advertised_pairs_train_under_single_and_ddp(name: str, tmp_path: Path):
    args, writer = WORKLOADS[name]
    root = tmp_path / "datasets"
    _write(writer, root)
    extra = [f"++data.root={root}"] if writer is not None else []  # ++: the data group is swept
    result = run_here(tmp_path, *FEW, *args, *extra, "hydra.sweep.dir=sweep")
    assert result.returncode == 0, result
    runs = sorted(p.parent for p in (tmp_path / "sweep").rglob("metrics.json"))
    jobs = math.prod(len(a.split("=")[1].split(",")) for a in [*args, "strategy=single,ddp"])
    assert len(runs) == jobs
    for run in runs:
        m = metrics(run)
        assert m["status"] == "completed", run
        assert m["final"]["step"] == 3 and math.isfinite(m["final"]["train/epoch_loss"])
        assert m["final"]["eval/samples"] == m["facts"]["eval_samples"]
        assert m["facts"]["world_size"] == (2 if m["facts"]["strategy"] == "ddp" else 1)
        if name == "regression":
            assert m["facts"]["best_metric"] == "eval/mse" and m["facts"]["best_mode"] == "min"
            assert m["final"]["eval/mse"] == m["final"]["eval/loss"] and "eval/acc" not in m["final"]
    if name == "imdb":  # one vocabulary per run, built by rank 0, the same for every run on this data
        prints = set()
        for run in runs:
            vocab = Vocab(json.loads((run / "vocab.json").read_text()))
            assert metrics(run)["facts"]["data_fingerprint"] == vocab.fingerprint()
            prints.add(vocab.fingerprint())
        assert len(prints) == 1

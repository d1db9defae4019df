"""Your own model and dataset without forking: the docs' example as it is shown (docs/own-model.md; its
files are docs/examples/own_model/), torchvision's builders as `_target_`, plain torch Datasets
wrapped, the one-line refusals when a dataset cannot say what it holds, and a model with a tied weight
trained by every exact strategy as single trains it."""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from ddpexp import checkpoint, load_model, models
from ddpexp.data import DataInfo
from ddpexp.data.external import External
from ddpexp.errors import UserError

from .conftest import PARITY, REPO, assert_close_weights, made_once, metrics, run_here

EXAMPLE = REPO / "docs" / "examples" / "own_model"
PAGE = (REPO / "docs/own-model.md").read_text()  # its bash block: "run by" this file (tests/test_docs.py)


def page_command(start: str) -> list[str]:
    """The arguments of the docs page's line that starts with `start`, as a shell would split them."""
    (line,) = [ln for ln in PAGE.splitlines() if ln.startswith(start)]
    return shlex.split(line)[1:]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory holding the docs example's files, as a user's project would."""
    shutil.copytree(EXAMPLE, tmp_path / "project")
    return tmp_path / "project"


def test_the_docs_show_the_example_files_as_they_are():
    for name in ("my_models.py", "conf/model/net.yaml", "conf/data/stripes.yaml"):
        assert (EXAMPLE / name).read_text().strip() in PAGE, name


def test_the_docs_example_trains_through_the_console_script(project: Path):
    """`ddpexp model._target_=my_models.Net data._target_=my_models.dataset ...` as the docs show it,
    run by the installed console script in the project directory: my_models is found there."""
    args = page_command("ddpexp model._target_=my_models.Net")
    script = Path(sys.executable).parent / "ddpexp"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # my_models: only in the cwd
    proc = subprocess.run(
        [str(script), *args, "hydra.run.dir=run", "trainer.progress=false"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics(project / "run")
    assert m["status"] == "completed"
    assert m["facts"]["eval_samples"] == 102  # data.val_fraction's default 0.1 of data.count=1024
    assert m["final"]["eval/acc"] > 0.9  # stripes are easy: the example learns


def test_the_docs_config_dir_example_trains(project: Path):
    result = run_here(project, *page_command("ddpexp --config-dir conf"), "hydra.run.dir=run")
    assert result.returncode == 0, result
    m = metrics(project / "run")
    assert m["status"] == "completed" and m["facts"]["eval_samples"] == 102  # 0.2 of 512, stripes.yaml
    weights = torch.load(project / "run" / "model.pt", weights_only=True)
    assert weights["features.0.weight"].shape == (32, 1, 3, 3)  # model.width=32 reached Net


def test_a_builder_of_ones_own_replaces_a_transformer_option(tmp_path: Path):
    """model=gpt_tiny model._target_=...: the transformer option's settings are dropped, the null ones
    (n_kv_head, ffn_dim, vocab_size...) too, which Hydra cannot delete as they are."""
    args = ["model=gpt_tiny", "model._target_=tests.user_models.small_gpt", "data=python_stdlib", "task=lm"]
    result = run_here(tmp_path, *args, "trainer.max_steps=2", "trainer.progress=false", "hydra.run.dir=run")
    assert result.returncode == 0, result
    m = metrics(tmp_path / "run")
    assert m["final"]["step"] == 2 and m["facts"]["model"] == "tests.user_models.small_gpt"
    assert (
        torch.load(tmp_path / "run" / "model.pt", weights_only=True)["tok_embeddings.weight"].shape[1] == 32
    )


def test_a_torchvision_model_builder_trains(tmp_path: Path):
    """torchvision.models.resnet18(*, weights=None, progress=True, **kwargs) gets num_classes only."""
    result = run_here(
        tmp_path,
        "model._target_=torchvision.models.resnet18",
        "data=synthetic",
        "data.shape=[3,32,32]",
        "data.num_classes=5",
        "data.num_train=64",
        "data.num_eval=16",
        "trainer.batch_size=16",
        "trainer.max_steps=2",
        "trainer.progress=false",
        "hydra.run.dir=run",
    )
    assert result.returncode == 0, result
    m = metrics(tmp_path / "run")
    assert m["final"]["step"] == 2 and math.isfinite(m["final"]["train/epoch_loss"])
    assert m["facts"]["model"] == "torchvision.models.resnet18"  # not the default option it replaced
    weights = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert weights["fc.weight"].shape == (5, 512)


def test_a_torchvision_dataset_of_pil_images_trains(tmp_path: Path):
    """FakeData: PIL images (made tensors), num_classes from the dataset, a tenth held out."""
    result = run_here(
        tmp_path,
        "model=mlp",
        "data._target_=torchvision.datasets.FakeData",
        "+data.size=160",
        "+data.image_size=[1,28,28]",
        "+data.num_classes=4",
        "trainer.max_steps=2",
        "trainer.progress=false",
        "hydra.run.dir=run",
    )
    assert result.returncode == 0, result
    m = metrics(tmp_path / "run")
    assert m["status"] == "completed" and m["facts"]["eval_samples"] == 16
    weights = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert weights["body.1.weight"].shape == (256, 784)  # input_shape from the first image: 1x28x28
    assert weights["head.weight"].shape == (4, 128)  # FakeData declares num_classes: it got it too


def test_a_dataset_that_cannot_say_its_classes_is_refused_with_the_fix(tmp_path: Path):
    (tmp_path / "unlabelled.py").write_text(
        "import torch\n"
        "class Pairs(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 20\n"
        "    def __getitem__(self, i): return torch.zeros(1, 28, 28), i % 3\n"
    )
    result = run_here(tmp_path, "data._target_=unlabelled.Pairs", "hydra.run.dir=run")
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert "data.num_classes: cannot tell how many classes unlabelled.Pairs has" in line
    assert "+data.num_classes=N" in line and not (tmp_path / "run").exists()


def test_builders_get_only_the_wired_arguments_they_declare():
    info = DataInfo(num_classes=5, input_shape=(3, 32, 32))
    kwargs_builder = OmegaConf.create({"_target_": "torchvision.models.resnet18"})
    assert models.wired_kwargs(kwargs_builder, info) == {"num_classes": 5}
    declared = OmegaConf.create({"_target_": "tests.user_models.unsplittable", "weights": None})
    assert models.wired_kwargs(declared, info) == {"num_classes": 5, "input_shape": [3, 32, 32]}
    assert models.build(declared, info)(torch.zeros(2, 3, 32, 32)).shape == (2, 5)  # weights: not passed


def test_one_dataset_is_split_the_same_way_every_time():
    data = TensorDataset(torch.randn(50, 2), torch.arange(50) % 3)
    a, b = (External(data, target="t", val_fraction=0.2, split_seed=1) for _ in range(2))
    assert a.eval.indices == b.eval.indices and len(a.eval) == 10  # type: ignore[attr-defined]
    assert sorted(a.train.indices + a.eval.indices) == list(range(50))  # type: ignore[attr-defined]
    assert a.info() == DataInfo(num_classes=3, input_shape=(2,))  # a TensorDataset's labels
    c = External(data, target="t", val_fraction=0.2, split_seed=2)
    assert c.eval.indices != a.eval.indices  # type: ignore[attr-defined]


def test_train_and_eval_datasets_may_come_as_a_pair_or_a_dict():
    train, held = (
        TensorDataset(torch.randn(8, 3), torch.zeros(8).long()),
        TensorDataset(torch.randn(4, 3), torch.ones(4).long()),
    )
    for made in ((train, held), {"train": train, "val": held}):
        source = External(made, target="t")
        assert (source.train, source.eval) == (train, held)
        splits = source.load(Path("."))
        assert len(splits.eval.dataset) == 4 and source.info().num_classes == 2  # type: ignore[arg-type]


class _Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1), 0


class _Unpaired(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(3)


@pytest.mark.parametrize(
    ("made", "message"),
    [
        (_Stream(), "cannot be indexed"),
        (_Unpaired(), "not an (input, target) pair"),
        ({"train": TensorDataset(torch.zeros(2))}, "returned a dict"),
        (42, "returned a value of type int, not a Dataset"),
    ],
)
def test_what_a_builder_returns_is_checked_with_one_line(made: object, message: str):
    with pytest.raises(UserError) as caught:
        External(made, target="t", val_fraction=0.5).check()
    assert message in str(caught.value) and "fix:" in str(caught.value) and "\n" not in str(caught.value)


# tests/user_models.py's Tied: one weight in two of its stages() blocks, on the parity experiment.
TIED = [*PARITY, "model=mlp", "~model.hidden", "model._target_=tests.user_models.tied"]
TIED += ["checkpoint.every_steps=5"]


@pytest.fixture(scope="session")
def tied_single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def make(cwd: Path) -> None:
        result = run_here(cwd, "strategy=single", *TIED, "hydra.run.dir=run")
        assert result.returncode == 0, result

    return made_once(tmp_path_factory, "tied-single", make) / "run"


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "strategy",
    ["ddp", "zero", "naive_allreduce_ring", "ddp_mp", "ps", "pipeline", "fsdp", "fsdp_no_reshard"],
)
def test_a_model_with_tied_weights_trains_like_single(strategy: str, tied_single: Path, tmp_path: Path):
    """Every exact strategy trains the tied model to single's weights, and saves every name the
    model's own state_dict() has (the tie's alias too), so the run loads as a plain model. pipeline's
    2 stages keep the tied blocks in one stage; fsdp shards the tied blocks with the root."""
    result = run_here(tmp_path, f"strategy={strategy}", *TIED, "hydra.run.dir=run")
    assert result.returncode == 0, result
    assert_close_weights(tmp_path / "run", tied_single)
    model = load_model(tmp_path / "run")
    assert model.again[0].weight is model.middle[0].weight
    newest = checkpoint.newest_valid(tmp_path / "run")  # what a resume under single would load
    saved = torch.load(tied_single / "model.pt", weights_only=True)
    assert newest is not None and newest[1]["model"].keys() == saved.keys()
    ours, theirs = metrics(tmp_path / "run")["final"], metrics(tied_single)["final"]
    assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-5)


SHARED = [*PARITY, "model=mlp", "~model.hidden", "model._target_=tests.user_models.shared_module"]


@pytest.mark.multiproc
def test_a_module_shared_by_two_shard_units_trains_under_fsdp_like_single(tmp_path: Path):
    """#50 item 18: a Linear module that is a submodule of two stages() blocks crashed every fsdp rank
    inside DeviceMesh ('Invariant encountered: value was None') after launch: the tie check compared
    modules by identity, and the shared module is inside both blocks. Tensors are now tied by the
    paths they are reached by: both blocks go with the root, and fsdp trains single's weights."""
    runs = {}
    for strategy in ("single", "fsdp", "fsdp_no_reshard"):
        result = run_here(tmp_path, f"strategy={strategy}", *SHARED, f"hydra.run.dir={strategy}")
        assert result.returncode == 0, result
        runs[strategy] = tmp_path / strategy
    for strategy in ("fsdp", "fsdp_no_reshard"):
        assert_close_weights(runs[strategy], runs["single"])
    model = load_model(runs["fsdp"])
    assert model.again[0] is model.middle[0]

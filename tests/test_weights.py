"""Weights from elsewhere: files written the tutorials' ways (a DataParallel/DDP model's `module.`
keys, tutorial 001's {'epoch', 'model_state_dict', 'optimizer_state_dict'}, torchvision's pretrained
ResNet) load through trainer.resume, trainer.mode=eval and model.weights; a file that does not fit is
refused in pre-flight with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ddpexp import checkpoint, weights
from ddpexp.data.synthetic import synthetic
from ddpexp.errors import UserError
from ddpexp.models.mlp import mlp
from ddpexp.models.resnet import resnet18

from .conftest import metrics, run_here

MLP = ["model=mlp", "data=synthetic", "trainer.progress=false", "data.num_train=256", "data.num_eval=128"]
RESNET = [
    "model=resnet18",
    "data=synthetic",
    "data.shape=[3,32,32]",
    "data.num_classes=5",
    "data.num_train=64",
    "data.num_eval=16",
    "trainer.progress=false",
]


def other_mlp() -> nn.Module:
    """The model MLP configures, with weights no run of seed 0 starts from."""
    torch.manual_seed(123)
    return mlp(num_classes=10, input_shape=[1, 28, 28], hidden=[256, 128])


def trained_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def eval_loss(model: nn.Module) -> float:
    """What ddpexp's evaluation must report for these weights on MLP's eval split."""
    x, y = synthetic(num_train=256, num_eval=128).load(Path(".")).eval.tensors  # type: ignore[misc]
    with torch.no_grad():
        return nn.functional.cross_entropy(model.eval()(x), y).item()


def test_weights_of_a_dataparallel_model_start_training(tmp_path: Path):
    """model.pt after 0 steps is exactly the file's weights, saved from nn.DataParallel (`module.`)."""
    model = other_mlp()
    torch.save(nn.DataParallel(model).state_dict(), tmp_path / "dp.pt")
    assert all(k.startswith("module.") for k in torch.load(tmp_path / "dp.pt", weights_only=True))
    result = run_here(tmp_path, *MLP, "model.weights=dp.pt", "trainer.max_steps=0", "hydra.run.dir=run")
    assert result.returncode == 0, result
    loaded = trained_weights(tmp_path / "run")
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_a_tutorial_checkpoint_evaluates_by_resume_and_by_model_weights(tmp_path: Path):
    """Tutorial 001 saves {'epoch', 'step', 'model_state_dict': model.module.state_dict(),
    'optimizer_state_dict', 'loss'}; evaluating it scores exactly those weights."""
    model = other_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save(
        {
            "epoch": 3,
            "step": 500,
            "model_state_dict": model.state_dict(),
            "optimizer_state_dict": optimizer.state_dict(),
            "loss": torch.tensor(0.25),
        },
        tmp_path / "step_500.pt",
    )
    expected = eval_loss(model)
    for setting in ("trainer.resume", "model.weights"):
        run = f"eval-{setting}"
        result = run_here(
            tmp_path, *MLP, "trainer.mode=eval", f"{setting}=step_500.pt", f"hydra.run.dir={run}"
        )
        assert result.returncode == 0, result
        m = metrics(tmp_path / run)
        assert m["status"] == "completed" and m["facts"]["mode"] == "eval"
        assert m["final"]["eval/loss"] == pytest.approx(expected, rel=1e-6), setting


def test_torchvision_resnet18_weights_fine_tune_a_five_class_resnet(tmp_path: Path):
    """Seed 003's way: ImageNet ResNet-18 weights under a new 5-class head, everything but fc loaded."""
    torch.manual_seed(7)
    import torchvision

    file = torchvision.models.resnet18().state_dict()
    torch.save(file, tmp_path / "resnet18.pt")
    result = run_here(
        tmp_path,
        *RESNET,
        "model.weights=resnet18.pt",
        "model.weights_strict=false",
        "trainer.max_steps=0",
        "hydra.run.dir=run",
    )
    assert result.returncode == 0, result
    loaded = trained_weights(tmp_path / "run")
    assert loaded.keys() == file.keys()
    body = [k for k in file if not k.startswith("fc.")]
    assert len(body) == 120 and all(torch.equal(loaded[k], file[k]) for k in body)
    assert loaded["fc.weight"].shape == (5, 512) and loaded["fc.bias"].shape == (5,)
    (line,) = [
        ln for ln in (tmp_path / "run" / "ddpexp.log").read_text().splitlines() if "model.weights" in ln
    ]
    assert "left at their initial values: fc.weight" in line and "fc.bias" in line and "120 of 122" in line


def test_weights_that_do_not_fit_are_refused_before_anything_starts(tmp_path: Path):
    import torchvision

    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet18.pt")
    result = run_here(tmp_path, *RESNET, "model.weights=resnet18.pt", "hydra.run.dir=run")
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ddpexp: error: model.weights: resnet18.pt does not fit the configured model")
    assert "fc.weight (1000, 512) vs (5, 512)" in line and "model.weights_strict=false" in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


def test_every_format_normalises_to_the_same_plain_state_dict():
    plain = {"0.weight": torch.ones(2, 3), "0.bias": torch.zeros(2)}
    ddp = {f"module.{k}": v for k, v in plain.items()}
    compiled_ddp = {f"_orig_mod.module.{k}": v for k, v in plain.items()}
    saved = [
        plain,
        ddp,
        compiled_ddp,
        {"epoch": 1, "model_state_dict": ddp, "optimizer_state_dict": {"state": {}, "param_groups": []}},
        {"state_dict": plain, "epoch": 2},
        {"model": compiled_ddp},
    ]
    for obj in saved:
        assert checkpoint.state_dict_of(obj, "f.pt") == plain
    with pytest.raises(checkpoint.CheckpointError, match="model_state_dict"):
        checkpoint.state_dict_of({"epoch": 1, "optimizer": {"lr": 0.1}}, "f.pt")


def test_checkpoints_of_the_earlier_resnet_layout_still_fit():
    """ddpexp's ResNet used to name its stem and head stem.0/stem.1/head.2; now torchvision's names."""
    with torch.device("meta"):
        model = resnet18(num_classes=5, input_shape=[3, 32, 32])
    renames = {"conv1.": "stem.0.", "bn1.": "stem.1.", "fc.": "head.2."}
    old = {}
    for key, value in resnet18(num_classes=5, input_shape=[3, 32, 32]).state_dict().items():
        prefix = next((p for p in renames if key.startswith(p)), None)
        old[renames[prefix] + key[len(prefix) :] if prefix else key] = value
    assert "head.2.weight" in old
    fitted = weights.fit(old, model, source="old.pt", setting="trainer.resume")
    assert fitted.state.keys() == model.state_dict().keys() and not fitted.left


def test_weights_that_share_no_tensor_with_the_model_are_refused_even_when_not_strict():
    model = nn.Linear(3, 2)
    with pytest.raises(UserError, match="none of the 1 tensors"):
        weights.fit(
            {"other.weight": torch.ones(1)}, model, source="x.pt", setting="model.weights", strict=False
        )

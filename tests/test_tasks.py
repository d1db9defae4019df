"""Tasks (conf/task, ddpexp/tasks.py): each loss is the tutorials' loss, and each eval metric is exact
however the eval set is split into batches and ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ddpexp import checkpoint, tasks

from .conftest import metrics, run_here, scalars

g = torch.Generator().manual_seed(0)
LOGITS = torch.randn(37, 4, generator=g)
LABELS = torch.randint(0, 4, (37,), generator=g)
SPLIT = [5, 20, 12]  # uneven pieces, as ranks and eval batches cut the eval set


def _split_sums(task: tasks.Task, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Score the batch in three uneven pieces, as ranks and eval batches do, then finish."""
    parts = [task.eval_sums(o, t) for o, t in zip(outputs.split(SPLIT), targets.split(SPLIT), strict=True)]
    return task.finish(torch.stack(parts).sum(dim=0).tolist())


def test_classification_and_nll_score_the_same_model_the_same_way():
    ce = _split_sums(tasks.Classification(topk=2), LOGITS, LABELS)
    nll = _split_sums(tasks.NLL(topk=2), F.log_softmax(LOGITS, dim=1), LABELS)
    assert ce["eval/loss"] == pytest.approx(F.cross_entropy(LOGITS, LABELS).item(), rel=1e-6)
    assert ce["eval/acc"] == pytest.approx((LOGITS.argmax(1) == LABELS).float().mean().item())
    top2 = (LOGITS.topk(2, dim=1).indices == LABELS[:, None]).any(1).float().mean().item()
    assert ce["eval/top2"] == pytest.approx(top2)
    for key in ce:
        assert nll[key] == pytest.approx(ce[key], rel=1e-6), key
    assert tasks.NLL().loss(F.log_softmax(LOGITS, dim=1), LABELS).item() == pytest.approx(
        F.cross_entropy(LOGITS, LABELS).item(), rel=1e-6
    )


def test_binary_is_tutorial_001_s_bce_on_one_hot_targets():
    logits, labels = LOGITS[:, :2], LABELS % 2
    theirs = F.binary_cross_entropy(torch.sigmoid(logits), F.one_hot(labels, num_classes=2).float())
    task = tasks.Binary()
    assert task.loss(logits, labels).item() == pytest.approx(theirs.item(), rel=1e-5)
    scored = _split_sums(task, logits, labels)
    assert scored["eval/loss"] == pytest.approx(theirs.item(), rel=1e-5)
    assert scored["eval/acc"] == pytest.approx((logits.argmax(1) == labels).float().mean().item())
    one = _split_sums(task, logits[:, 1:], labels)  # a single logit against 0/1 targets
    assert one["eval/acc"] == pytest.approx(((logits[:, 1] > 0) == (labels == 1)).float().mean().item())


def test_regression_reports_mse_and_mae_over_every_element():
    outputs, targets = torch.randn(37, 5, generator=g), torch.randn(37, 5, generator=g)
    scored = _split_sums(tasks.Regression(), outputs, targets)
    assert scored["eval/mse"] == pytest.approx(F.mse_loss(outputs, targets).item(), rel=1e-6)
    assert scored["eval/mae"] == pytest.approx(F.l1_loss(outputs, targets).item(), rel=1e-6)
    assert scored["eval/loss"] == scored["eval/mse"] and scored["eval/samples"] == 37


def test_a_loss_of_your_own_replaces_the_task_s_loss():
    cfg = OmegaConf.create({"_target_": "ddpexp.tasks.Regression", "loss": {"_target_": "torch.nn.L1Loss"}})
    task = tasks.build(cfg)
    outputs, targets = torch.randn(37, 5, generator=g), torch.randn(37, 5, generator=g)
    assert task.loss(outputs, targets).item() == pytest.approx(F.l1_loss(outputs, targets).item())
    assert _split_sums(task, outputs, targets)["eval/loss"] == pytest.approx(
        F.l1_loss(outputs, targets).item()
    )


def test_tutorial_004_s_toy_regression_trains_and_keeps_the_lowest_mse(tmp_path: Path):
    args = [
        "model=toy",
        "data=synthetic_regression",
        "task=regression",
        "trainer.epochs=4",
        "hydra.run.dir=run",
    ]
    result = run_here(tmp_path, *args, "trainer.progress=false", "optim.lr=0.05")
    assert result.returncode == 0, result
    assert "eval_mse" in result.stdout and "eval_acc" not in result.stdout
    run = tmp_path / "run"
    m = metrics(run)
    assert m["facts"]["task"] == "regression" and m["facts"]["parameters"] == 10 * 10 + 10 + 10 * 5 + 5
    mse = [h["eval/mse"] for h in m["history"]]
    assert mse[-1] < mse[0] / 2  # it learns the teacher
    assert m["best"]["eval/mse"] == min(mse)
    assert checkpoint.load(run / "checkpoints" / "best.pt")["metrics"]["best"] == min(mse)
    assert len(scalars(run)["eval/mae"]) == 4

"""What the model is trained to do: the training loss and the exact evaluation metrics (conf/task).

A task turns a micro-batch's outputs and targets into the training loss, and an eval batch into sums
(loss, metric numerators, sample count) that are added up over batches and all-reduced over ranks,
so every eval metric counts each sample exactly once whatever the world size. The task also says
which metric is "best" (checkpoint.best_metric / best_mode default to it).

  classification  cross-entropy on logits; eval/acc (argmax), eval/top<k> with topk=k
  nll             negative log-likelihood on log-probabilities (a model ending in log_softmax)
  binary          BCE on logits (the tutorials' IMDB way: one output per class against one-hot
                  targets, or one output against 0/1); eval/acc
  regression      MSE on float targets; eval/mse and eval/mae (best: eval/mse, min)
  lm              next-token cross-entropy over every position of token windows (data/tokens.py);
                  eval/loss is the mean over every eval token, eval/ppl = exp(eval/loss),
                  eval/token_acc (argmax); eval/tokens beside eval/samples (best: eval/loss, min)

`task.loss._target_=...` replaces a task's loss with your own module or function `(outputs, targets)
-> mean loss`; evaluation then sums loss x batch size, which is exact for mean-reduced losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import BestMode
from .errors import UserError

Loss = Callable[[Tensor, Tensor], Tensor]


# What a dataset's targets are (DataInfo.targets), as the refusal names them, and the task for them.
TARGETS = {
    "class": ("class labels", "task=classification (or binary, nll)"),
    "value": ("float values", "task=regression"),
    "token": ("token sequences", "task=lm"),
}


class Task:
    name: ClassVar[str] = "task"
    # what the dataset must give (DataInfo.targets): "class" indices, float "value"s or "token" ids
    targets: ClassVar[str] = "class"
    best_metric: ClassVar[str] = "eval/acc"
    best_mode: ClassVar[BestMode] = BestMode.max
    metrics: tuple[str, ...] = ()  # eval metrics besides eval/loss, in metric_sums' order

    def __init__(self, loss: Loss | None = None) -> None:
        self.custom_loss = loss

    def check(self, targets: str) -> None:
        """Refuse a dataset whose targets this task cannot learn (pre-flight)."""
        if targets != self.targets:
            kind, fix = TARGETS.get(targets, (f"{targets!r} targets", "a task made for them"))
            if self.targets == "token":
                fix += ", or a token corpus (data=python_stdlib, text_files or synthetic_tokens)"
            raise UserError(
                f"task={self.name} cannot learn this dataset's {kind}", setting="task", fix=f"use {fix}"
            )

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The micro-batch's mean loss (what backward runs on)."""
        if self.custom_loss is not None:
            return self.custom_loss(outputs, self.prepare(outputs, targets))
        return self.builtin_loss(outputs, self.prepare(outputs, targets))

    def prepare(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return targets

    def builtin_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        raise NotImplementedError

    def sample_losses(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Each sample's loss (built-in losses), summed in float64 for evaluation."""
        raise NotImplementedError

    def metric_sums(self, outputs: Tensor, targets: Tensor) -> list[Tensor]:
        """Each metric's per-sample values (summed in float64 by eval_sums)."""
        return []

    @property
    def num_sums(self) -> int:
        """Length of eval_sums' vector (a rank with nothing to score all-reduces as many zeros)."""
        return len(self.metrics) + 2

    def eval_sums(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """[loss sum, metric numerators..., samples] of one eval batch, as float64."""
        outputs = outputs.float()
        prepared = self.prepare(outputs, targets)
        n = targets.shape[0]
        if self.custom_loss is not None:
            loss_sum = self.custom_loss(outputs, prepared).double() * n
        else:
            loss_sum = self.sample_losses(outputs, prepared).double().sum()
        parts = [loss_sum, *(m.double().sum() for m in self.metric_sums(outputs, prepared))]
        return torch.stack([*parts, torch.tensor(float(n), dtype=torch.float64, device=outputs.device)])

    def finish(self, sums: list[float]) -> dict[str, float]:
        """Metrics from the all-reduced sums (the denominator is the sample count unless overridden)."""
        *numerators, count = sums
        values = {"eval/loss": numerators[0] / count}
        values |= {name: v / count for name, v in zip(self.metrics, numerators[1:], strict=True)}
        return values | {"eval/samples": count}


class Classification(Task):
    name = "classification"

    def __init__(self, loss: Loss | None = None, topk: int | None = None) -> None:
        super().__init__(loss)
        if topk is not None and topk < 2:
            raise UserError(
                f"is {topk}; top-1 is eval/acc", setting="task.topk", fix="use 2 or more, or null"
            )
        self.topk = topk
        self.metrics = ("eval/acc",) + ((f"eval/top{topk}",) if topk else ())

    def builtin_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(outputs.float(), targets)

    def sample_losses(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(outputs, targets, reduction="none")

    def metric_sums(self, outputs: Tensor, targets: Tensor) -> list[Tensor]:
        sums = [outputs.argmax(dim=1) == targets]
        if self.topk:
            k = min(self.topk, outputs.shape[1])
            sums.append((outputs.topk(k, dim=1).indices == targets[:, None]).any(dim=1))
        return sums


class NLL(Classification):
    name = "nll"

    def builtin_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.nll_loss(outputs.float(), targets)

    def sample_losses(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.nll_loss(outputs, targets, reduction="none")


class Binary(Task):
    """BCE with logits. Several outputs: one per class against one-hot targets (seed 001 on IMDB);
    one output: the logit of class 1 against 0/1 targets."""

    name = "binary"
    metrics = ("eval/acc",)

    def prepare(self, outputs: Tensor, targets: Tensor) -> Tensor:
        if outputs.dim() == 2 and outputs.shape[1] > 1:
            return F.one_hot(targets, outputs.shape[1]).to(outputs.dtype)
        return targets.to(outputs.dtype).reshape(outputs.shape)

    def builtin_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(outputs.float(), targets.float())

    def sample_losses(self, outputs: Tensor, targets: Tensor) -> Tensor:
        losses = F.binary_cross_entropy_with_logits(outputs, targets, reduction="none")
        return losses.reshape(losses.shape[0], -1).mean(dim=1)

    def metric_sums(self, outputs: Tensor, targets: Tensor) -> list[Tensor]:
        if outputs.dim() == 2 and outputs.shape[1] > 1:
            return [outputs.argmax(dim=1) == targets.argmax(dim=1)]
        return [((outputs > 0) == (targets > 0.5)).reshape(-1)]


class Regression(Task):
    """MSE on float targets shaped like the outputs. eval/mse and eval/mae are means over every output
    element (as nn.MSELoss and nn.L1Loss compute them); eval/loss is eval/mse."""

    name = "regression"
    targets = "value"
    best_metric = "eval/mse"
    best_mode = BestMode.min
    metrics = ("eval/mse", "eval/mae")

    def prepare(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return targets.to(outputs.dtype).reshape(outputs.shape)

    def builtin_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.mse_loss(outputs.float(), targets.float())

    def sample_losses(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return (outputs - targets).pow(2).reshape(outputs.shape[0], -1).mean(dim=1)

    def metric_sums(self, outputs: Tensor, targets: Tensor) -> list[Tensor]:
        err = (outputs - targets).reshape(outputs.shape[0], -1)
        return [err.pow(2).mean(dim=1), err.abs().mean(dim=1)]


class LanguageModel(Task):
    """Next-token prediction: outputs (B, L, V) logits, targets (B, L) token ids (the inputs shifted by
    one). Every position counts, so the eval loss is a mean over tokens, not samples: the sums are
    [loss, correct, tokens, samples], all-reduced, and eval/ppl is exp of the exact mean loss (not a
    mean of per-rank perplexities). A custom `task.loss` is given the (B*L, V) logits and (B*L,)
    targets, as for classification."""

    name = "lm"
    targets = "token"
    best_metric = "eval/loss"
    best_mode = BestMode.min
    metrics = ("eval/ppl", "eval/token_acc")

    def __init__(self, loss: Loss | None = None, loss_chunks: int | None = None) -> None:
        super().__init__(loss)
        if loss_chunks is not None and loss_chunks < 1:
            raise UserError(f"is {loss_chunks}", setting="task.loss_chunks", fix="give 1 or more, or null")
        self.loss_chunks = loss_chunks

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        flat = outputs.reshape(-1, outputs.shape[-1])
        ids = targets.reshape(-1).long()
        if self.custom_loss is not None:
            return self.custom_loss(flat, ids)
        if (self.loss_chunks or 1) > 1 and flat.requires_grad and not _split(flat):
            return chunked_cross_entropy(flat, ids, self.loss_chunks or 1)
        return F.cross_entropy(flat.float(), ids)

    @property
    def num_sums(self) -> int:
        return 4

    def eval_sums(self, outputs: Tensor, targets: Tensor) -> Tensor:
        flat = outputs.float().reshape(-1, outputs.shape[-1])
        ids = targets.reshape(-1).long()
        tokens = ids.numel()
        if self.custom_loss is not None:
            loss_sum = self.custom_loss(flat, ids).double() * tokens
        else:
            # each token's loss summed in float64: the same total whichever batches and ranks hold them
            loss_sum = F.cross_entropy(flat, ids, reduction="none").double().sum()
        correct = (flat.argmax(dim=1) == ids).sum().double()
        counts = torch.tensor([tokens, targets.shape[0]], dtype=torch.float64, device=outputs.device)
        return torch.cat([torch.stack([loss_sum, correct]), counts])

    def finish(self, sums: list[float]) -> dict[str, float]:
        loss_sum, correct, tokens, samples = sums
        loss = loss_sum / tokens
        try:
            ppl = math.exp(loss)
        except OverflowError:  # a loss above ~709
            ppl = math.inf
        return {
            "eval/loss": loss,
            "eval/ppl": ppl,
            "eval/token_acc": correct / tokens,
            "eval/samples": samples,
            "eval/tokens": tokens,
        }


def chunked_cross_entropy(logits: Tensor, ids: Tensor, chunks: int) -> Tensor:
    """The mean cross-entropy of (tokens, vocabulary) logits, computed over `chunks` runs of tokens, each
    checkpointed: its float32 copy of the logits and their log-softmax live only while it is computed
    (again in the backward), so a step holds one chunk's of them instead of every token's (for a
    vocabulary of 128k, 0.5 MB per token in float32). The same mean, summed in another order."""
    from torch.utils.checkpoint import checkpoint

    total = logits.new_zeros((), dtype=torch.float32)
    for part, wanted in zip(logits.chunk(chunks), ids.chunk(chunks), strict=True):
        total = total + checkpoint(_summed_cross_entropy, part, wanted, use_reentrant=False)
    return total / ids.numel()


def _split(t: Tensor) -> bool:
    """Whether `t` is a DTensor (tensor parallelism's logits, whose loss runs in one go under
    loss_parallel)."""
    return hasattr(t, "device_mesh")


def _summed_cross_entropy(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits.float(), ids, reduction="sum")


def build(task_cfg: Any) -> Task:
    from hydra.utils import instantiate

    task = instantiate(task_cfg, _convert_="all")
    if not isinstance(task, Task):
        raise UserError(
            f"{task_cfg.get('_target_')} is not a ddpexp.tasks.Task",
            setting="task._target_",
            fix="subclass ddpexp.tasks.Task, or keep a built-in task and set task.loss._target_ to your loss",
        )
    return task


def best_of(cfg: Any) -> tuple[str, BestMode]:
    """checkpoint.best_metric / best_mode, defaulting to the task's own."""
    from hydra.utils import get_class

    task_class: Any = get_class(cfg.task._target_)
    metric = cfg.checkpoint.best_metric or task_class.best_metric
    mode = cfg.checkpoint.best_mode or task_class.best_mode
    return metric, BestMode(mode)

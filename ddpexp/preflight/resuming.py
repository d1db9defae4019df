"""Pre-flight's checks of a resume: the checkpoint it would continue from fits the configured model,
global batch and optimizer, and there is something left to train."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError


def check_auto_resume(run_dir: Path, model: Any, cfg: DictConfig, global_batch: int) -> None:
    """resume=auto, before anything in the run directory changes: the newest valid checkpoint must fit
    the configured model and the run's global batch (its position in the epoch counts steps of that
    batch), and a run that has already trained everything it was asked to is not started again. A
    refused resume leaves every byte of the run as it was."""
    from .. import checkpoint
    from ..errors import NothingToDo
    from ..weights import fit

    found = checkpoint.resolve("auto", run_dir)
    if found is None:
        return
    path, state = found
    fit(state["model"], model, source=path, setting="trainer.resume")
    saved_batch = state.get("global_batch")  # absent from checkpoints older than this check
    if saved_batch is not None and int(saved_batch) != global_batch:
        raise UserError(
            f"{path.name} was trained at global batch {saved_batch}, this run's is {global_batch}: its "
            "place in the epoch and its learning-rate schedule count steps of the old batch",
            setting="trainer.batch_size",
            fix=f"resume with trainer.batch_size={saved_batch}, or start a new run from its weights "
            f"with model.weights={path}",
        )
    t = cfg.trainer
    if t.mode.value != "train":
        return
    finished_epochs = int(state.get("epoch", 0)) >= t.epochs
    finished_steps = t.max_steps is not None and int(state.get("step", 0)) >= t.max_steps
    if (finished_epochs or finished_steps) and _completed(run_dir):
        raise NothingToDo(
            f"{run_dir} is already complete (step {state.get('step')}, epoch {state.get('epoch')} of "
            f"{t.epochs}); nothing to resume. Raise trainer.epochs or trainer.max_steps to train further"
        )
    check_optimizer_state(path, state, cfg)


def _completed(run_dir: Path) -> bool:
    """Whether the run finished its work: its record says completed (final evaluation and model.pt
    written). A run that trained its last step and failed after it (in its final evaluation, saving
    model.pt) is resumed to do what is left."""
    from ..runrecord import read_run_record_or_none

    record = read_run_record_or_none(run_dir)
    return record is None or record.status == "completed"


def check_optimizer_state(path: Path, state: dict[str, Any], cfg: DictConfig) -> None:
    """Training on from a checkpoint loads its optimizer state into the configured optimizer, which
    torch accepts from any optimizer: SGD's momentum buffers and hyperparameters then reach AdamW,
    whose first step fails for want of its step count and moments, after the run was reopened. The
    same optimizer continues with the saved hyperparameters and schedule (they are part of its state),
    so a changed one would be ignored without a word: refused too."""
    if "optimizer" not in state:  # bare weights: training starts a fresh optimizer
        return
    saved = (state.get("config") or {}).get("optim") or {}
    container = OmegaConf.to_container(cfg.optim, resolve=True, enum_to_str=True)
    assert isinstance(container, dict)
    wanted = {str(k): v for k, v in container.items()}
    if saved.get("name") not in (None, wanted["name"]):
        raise UserError(
            f"{path.name} holds the optimizer state of {saved['name']}, which optim={wanted['name']} "
            "cannot continue from",
            setting="optim",
            fix=f"resume with optim={saved['name']}, or start a new run from its weights with "
            f"model.weights={path}",
        )
    changed = [k for k in wanted if k not in UNSAVED_OPTIM and k in saved and saved[k] != wanted[k]]
    if changed:
        was = " ".join(f"optim.{k}={saved[k]}" for k in changed)
        now = ", ".join(f"optim.{k}={wanted[k]}" for k in changed)
        raise UserError(
            f"{path.name} continues with {was}, its optimizer's saved settings, not {now}",
            setting="optim",
            fix=f"resume with {was}, or start a new run from its weights with model.weights={path}",
        )


# Optimizer settings a resume may change: how the update is computed, not what it is.
UNSAVED_OPTIM = frozenset({"name", "fused"})

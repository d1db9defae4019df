"""Weights from elsewhere, fitted to the configured model: a checkpoint to resume or evaluate
(`trainer.resume`), initial weights to fine-tune from (`model.weights`), a run's trained model
(`ddpexp.load_model`).

Reading a file, whatever wrote it, is checkpoint.load's job (checkpoint.state_dict_of: a bare
state_dict, a tutorial's {'model_state_dict': ...}, DDP's `module.` keys...). This module matches the
plain state_dict it gives to the model, by name and shape:

- strict (trainer.resume, and model.weights by default): every tensor of the model, nothing else, same
  shapes; otherwise a one-line error listing what is missing, unexpected or differently shaped.
- not strict (`model.weights_strict=false`, fine-tuning with a new head): every tensor whose name and
  shape match is loaded; the rest of the model keeps its initial values, and one log line names them.

Both work on a model built on the "meta" device, so pre-flight checks a file against the model before
anything is launched. A model may declare `state_dict_aliases = {"their.prefix.": "our.prefix."}` for
key names other code (or an earlier ddpexp) gave its tensors (models/resnet.py), or, for a file laid
out otherwise, `adapt_state_dict(weights, *, strict) -> weights` under its own names, which may raise a
UserError naming the setting that would make a file fit (models/gpt.py: GPT-2's files).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import checkpoint
from .checkpoint import some
from .errors import UserError

log = logging.getLogger(__name__)

RESUME_FIX = "choose the model (and data) the checkpoint was trained with, or another checkpoint"
WEIGHTS_FIX = (
    "set model.weights_strict=false to load only the tensors whose name and shape match (e.g. "
    "under a new classifier head), or choose the model the weights were made for"
)


@dataclass(frozen=True)
class Fit:
    state: dict[str, torch.Tensor]  # under the model's own names: load_state_dict(state, strict=...)
    left: list[str]  # the model's tensors the file does not fill (they keep their initial values)
    unused: list[str]  # the file's tensors whose names the model does not have
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # name: (file's, model's) where they differ


def fit(
    weights: Mapping[str, torch.Tensor],
    model: nn.Module,
    *,
    source: Path | str,
    setting: str,
    strict: bool = True,
    fix: str = RESUME_FIX,
) -> Fit:
    """`weights` under the model's names, checked against its tensors' names and shapes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    adapt = getattr(model, "adapt_state_dict", None)
    if callable(adapt):
        weights = adapt(weights, strict=strict)
    found = _renamed(dict(weights), expected, getattr(model, "state_dict_aliases", {}))
    fits = {k: v for k, v in found.items() if k in expected and tuple(v.shape) == expected[k]}
    left = [k for k in expected if k not in fits]
    unused = [k for k in found if k not in expected]
    if strict and (left or unused):
        raise UserError(
            f"{source} does not fit the configured model: {_problems(found, expected)}",
            setting=setting,
            fix=fix,
        )
    if not fits:
        raise UserError(
            f"none of the {len(found)} tensors in {source} fits the configured model (the file has "
            f"{some(list(found))}; the model {some(list(expected))})",
            setting=setting,
            fix="choose weights made for this model (its layer names must match)",
        )
    shapes = {k: (tuple(found[k].shape), expected[k]) for k in left if k in found}
    return Fit(state=fits, left=left, unused=unused, shapes=shapes)


def _renamed(
    weights: dict[str, torch.Tensor], expected: Mapping[str, Any], aliases: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """Keys the model does not have, renamed by its aliases where that gives one it has."""
    out = {}
    for key, value in weights.items():
        if key not in expected:
            for theirs, ours in aliases.items():
                if key.startswith(theirs) and (ours + key[len(theirs) :]) in expected:
                    key = ours + key[len(theirs) :]
                    break
        out[key] = value
    return out


def _problems(found: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]) -> str:
    problems = []
    if missing := [k for k in expected if k not in found]:
        problems.append(f"missing {some(missing)}")
    if unexpected := [k for k in found if k not in expected]:
        problems.append(f"unexpected {some(unexpected)}")
    differ = [k for k in expected if k in found and tuple(found[k].shape) != expected[k]]
    if shapes := [f"{k} {tuple(found[k].shape)} vs {expected[k]}" for k in differ]:
        problems.append(f"different shapes (checkpoint vs model) {some(shapes)}")
    return "; ".join(problems)


def read(path: str | Path, *, setting: str, fix: str) -> dict[str, torch.Tensor]:
    """The plain state_dict in a file, or a one-line UserError naming the setting that points at it."""
    try:
        return checkpoint.load(Path(path).expanduser())["model"]
    except checkpoint.CheckpointError as exc:
        raise UserError(str(exc), setting=setting, fix=fix) from exc


# ------------------------------------------------------------------------------------ trainer.resume


def check_resume(resume: str | None, model: nn.Module) -> tuple[Path, dict[str, Any]] | None:
    """Pre-flight: an explicit checkpoint path must exist, load, and fit the configured model; what it
    loaded, for the caller's further checks (None for no path)."""
    if not resume or resume == "auto":
        return None
    found = checkpoint.resolve(resume, Path("."))
    assert found is not None
    fit(found[1]["model"], model, source=found[0], setting="trainer.resume")
    return found


# ------------------------------------------------------------------------------------- model.weights


def check_initial(model_cfg: Mapping[str, Any], model: nn.Module) -> None:
    """Pre-flight: model.weights, if set, loads and fits the (meta) model as model.weights_strict asks."""
    if model_cfg.get("weights"):
        _initial(model_cfg, model)


def load_initial(model: nn.Module, model_cfg: Mapping[str, Any]) -> None:
    """Start from model.weights, if set (on every rank: each builds the same model and loads the same
    file, so they start identical). Not strict: one line says what keeps its initial values."""
    path = model_cfg.get("weights")
    if not path:
        return
    fitted, strict = _initial(model_cfg, model)
    model.load_state_dict(fitted.state, strict=strict)
    if strict:
        log.info("model.weights: loaded %s", path)
        return
    log.info(
        "model.weights: loaded %d of %d tensors from %s; left at their initial values: %s%s",
        len(fitted.state),
        len(fitted.state) + len(fitted.left),
        path,
        some([_described(k, fitted) for k in fitted.left], shown=10) or "none",
        f"; not used from the file: {some(fitted.unused)}" if fitted.unused else "",
    )


def _described(key: str, fitted: Fit) -> str:
    if key not in fitted.shapes:
        return key
    theirs, ours = ("x".join(map(str, shape)) for shape in fitted.shapes[key])
    return f"{key} (file {theirs}, model {ours})"


def _initial(model_cfg: Mapping[str, Any], model: nn.Module) -> tuple[Fit, bool]:
    path = str(model_cfg["weights"])
    strict = bool(model_cfg.get("weights_strict", True))
    weights = read(
        path, setting="model.weights", fix="point model.weights at a state_dict or checkpoint file"
    )
    return fit(weights, model, source=path, setting="model.weights", strict=strict, fix=WEIGHTS_FIX), strict

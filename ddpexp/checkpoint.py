"""Checkpoint files: their format, how they are written (atomically, by rank 0), found and loaded.
(What goes into one and when: resume.py.)

A checkpoint is a plain dictionary of tensors and containers, loadable with
`torch.load(path, weights_only=True)`:

    format, step, epoch, step_in_epoch, world_size, accumulate   where training stands
    epoch_loss   mid-epoch, the epoch's loss sum and count so far, over every rank
    model        state_dict of the unwrapped model (loads into a plain model, any strategy)
    optimizer, scheduler, scaler                                  optimizer/LR schedule/GradScaler state
    rng          one entry per rank: torch (CPU and CUDA), numpy and python random states
    config       the resolved config as plain containers
    metrics      best-so-far bookkeeping

Weights saved any other common way load too (`state_dict_of`): a bare state_dict such as model.pt or
torchvision's pretrained files, a dict holding one (`model_state_dict`, `state_dict`, `model`), and
the keys of a DDP/DataParallel or torch.compile'd model (`module.`, `_orig_mod.`). Fitting them to
the configured model (names, shapes, strict or not): weights.py.

Files live in <run dir>/checkpoints/: step-00000123.pt (the newest `checkpoint.keep_last_k` kept),
best.pt (best eval metric so far), last.pt (a symlink to the newest step file). Every file is written
to a temporary name in the same directory, fsynced, then renamed: a crash or a full disk while saving
leaves the previous checkpoints intact and no half-written file under a checkpoint name.
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from .errors import UserError
from .fsutil import atomic_write, atomic_write_bytes

log = logging.getLogger(__name__)

FORMAT = 1
DIR = "checkpoints"
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(Exception):
    pass


# ------------------------------------------------------------------------------------------ RNG


def rng_state() -> dict[str, Any]:
    """This process's random number generator states, as tensors and plain containers."""
    np_state: Any = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": version, "state": list(internal), "gauss": gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


# ------------------------------------------------------------------------------------- writing


def to_cpu(obj: Any) -> Any:
    """A state (dicts, lists and tuples of tensors) with every tensor in host memory: what a rank
    gathers to rank 0 for it to save."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def serialize(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def step_file(run_dir: Path, step: int) -> Path:
    return run_dir / DIR / f"step-{step:08d}.pt"


class Checkpointer:
    """Rank 0's checkpoint files. `save` is atomic per file; pruning happens only after success."""

    def __init__(
        self, run_dir: Path, *, keep_last_k: int, while_saving: Callable[[int], None] | None = None
    ) -> None:
        self.dir = run_dir / DIR
        self.run_dir = run_dir
        self.keep_last_k = keep_last_k
        self.while_saving = while_saving  # fault injection (ddpexp.faults), called mid-write
        # A process killed mid-save leaves its temporary file behind; nothing reads it, so clear it.
        for leftover in self.dir.glob(".*.tmp") if self.dir.is_dir() else []:
            leftover.unlink(missing_ok=True)

    def save(self, state: dict[str, Any], *, periodic: bool, best: bool) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        data = serialize(state)
        path = None
        if periodic:
            path = step_file(self.run_dir, state["step"])
            self._write(path, data, state["step"])
            self._point_last_at(path)
        if best and not (path is not None and self._link(path, self.dir / "best.pt")):
            self._write(self.dir / "best.pt", data, state["step"])
        if periodic:
            self._prune()  # after best.pt took its own link to the data, if it shares the step file's

    def _link(self, source: Path, target: Path) -> bool:
        """Make `target` a second name of `source`'s bytes (one write for the step's checkpoint and
        best.pt alike), atomically; False where the filesystem has no hard links."""
        tmp = target.with_name(f".{target.name}.link.tmp")
        try:
            tmp.unlink(missing_ok=True)
            os.link(source, tmp)
            os.replace(tmp, target)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        return True

    def _write(self, path: Path, data: bytes, step: int) -> None:
        hook = self.while_saving
        if hook is None:
            atomic_write_bytes(path, data)
            return

        def write_with_hook(f: IO[bytes]) -> None:
            f.write(data[: len(data) // 2])
            f.flush()
            hook(step)
            f.write(data[len(data) // 2 :])

        atomic_write(path, write_with_hook)

    def _point_last_at(self, path: Path) -> None:
        tmp = self.dir / ".last.pt.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.name)
        os.replace(tmp, self.dir / "last.pt")

    def _prune(self) -> None:
        for old in step_files(self.run_dir)[self.keep_last_k :]:
            old.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------- reading


def step_files(run_dir: Path) -> list[Path]:
    """Periodic checkpoints of a run directory, newest first."""
    folder = run_dir / DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load(path: Path) -> dict[str, Any]:
    """A checkpoint (or a bare state_dict such as model.pt), safely: weights_only, on the CPU."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} does not exist") from exc
    except Exception as exc:
        # torch's own message runs to several paragraphs; its first sentence is the useful part.
        first = next(iter(str(exc).strip().splitlines()), "").split(". ")[0][:200]
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {first})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint")
    if "format" not in state:  # weights saved some other way (model.pt, a tutorial's, torchvision's)
        return {"model": state_dict_of(state, path)}
    if state["format"] != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {state['format']}, this ddpexp reads {FORMAT}")
    return {**state, "model": state_dict_of(state["model"], path)}


# What training scripts wrap their weights in: tutorial 001's {'epoch', 'model_state_dict',
# 'optimizer_state_dict'}, Lightning-style {'state_dict': ...}, {'model': ...}.
WEIGHT_KEYS = ("model_state_dict", "state_dict", "model")
# What wrappers put in front of every key: DistributedDataParallel/DataParallel, torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def state_dict_of(saved: dict[str, Any], source: Path | str) -> dict[str, torch.Tensor]:
    """The plain state_dict in whatever a training script saved: a bare state_dict, or one held under
    `model_state_dict`/`state_dict`/`model` next to other entries, with the `module.` (DDP, DP) and
    `_orig_mod.` (torch.compile) prefixes of wrapped models removed. The one reader of foreign
    weights: resuming, evaluating, model.weights and ddpexp.load_model all go through it."""
    inner = next((saved[k] for k in WEIGHT_KEYS if isinstance(saved.get(k), dict)), saved)
    if not inner or not all(isinstance(v, torch.Tensor) for v in inner.values()):
        raise CheckpointError(
            f"{source} is neither a ddpexp checkpoint nor a model state_dict (its entries: "
            f"{some(sorted(map(str, saved)))}; weights are looked for under {', '.join(WEIGHT_KEYS)})"
        )
    weights: dict[str, torch.Tensor] = dict(inner)
    while prefix := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in weights)), None):
        weights = {k[len(prefix) :]: v for k, v in weights.items()}
    return weights


def has_any(run_dir: Path) -> bool:
    """Whether the run directory holds any checkpoint file, loadable or not."""
    return bool(step_files(run_dir)) or (run_dir / DIR / "best.pt").exists()


def newest_valid(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in the run directory that loads; corrupt or partial ones are skipped
    with a warning naming the file. best.pt is the fallback when no periodic one is readable."""
    for path in [*step_files(run_dir), run_dir / DIR / "best.pt"]:
        if not path.exists():
            continue
        try:
            return path, load(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None


def resolve(resume: str, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """What trainer.resume names: `auto` (newest valid in the run directory, or None) or a file."""
    if resume == "auto":
        return newest_valid(run_dir)
    path = Path(resume).expanduser()
    try:
        return path, load(path)
    except CheckpointError as exc:
        raise UserError(
            str(exc),
            setting="trainer.resume",
            fix="point trainer.resume at a valid checkpoint file, or use auto",
        ) from exc


def some(names: list[str], shown: int = 3) -> str:
    """The first few names of a list, for a one-line message."""
    more = f" (+{len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more

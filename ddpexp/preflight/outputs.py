"""Pre-flight's checks of where a run or sweep writes: the directory can be made and written, has room,
and holds no other run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import UserError
from ..runrecord import METRICS_FILE

# A floor, not an estimate: below it even Hydra's few config files may not fit (a full disk then
# fails halfway through making the run dir).
MIN_FREE_BYTES = 1 << 20


def check_output_dir(directory: Path, *, setting: str) -> None:
    """Hydra makes the run's (or sweep's) directory and writes into it: the nearest part of its path that
    exists must be a directory this user may write into (else Hydra fails with a traceback)."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(
            f"{existing} is not a directory, so {directory} cannot be made",
            setting=setting,
            fix=f"choose a {setting} whose parents are directories",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"{existing} is not writable, so {directory} cannot be made or written there",
            setting=setting,
            fix=f"choose a {setting} you can write to (e.g. under the current directory)",
        )
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"the disk of {existing} has {free // 1024} KiB free, too little for a run's config, logs, "
            "metrics and checkpoints",
            setting=setting,
            fix=f"free space on that disk, or choose a {setting} on another",
        )


def check_sweep_dir(sweep_dir: Path, resume: str | None) -> None:
    """A sweep into a directory that already holds a sweep's runs would overwrite them job by job."""
    if resume != "auto" and next(sweep_dir.glob(f"*/{METRICS_FILE}"), None) is not None:
        raise UserError(
            f"{sweep_dir} already holds a sweep's runs; sweeping into it again would overwrite them",
            setting="hydra.sweep.dir",
            fix="choose a new hydra.sweep.dir, or add trainer.resume=auto to continue those runs",
        )


def refuse_claimed(directory: Path, holder: int, *, setting: str = "hydra.run.dir") -> UserError:
    """The one-line refusal when another ddpexp run holds `directory` (`setting` names it)."""
    who = f"pid {holder}" if holder else "another process"
    return UserError(
        f"{directory} is in use by another ddpexp run ({who}); two runs in one directory mix their results",
        setting=setting,
        fix=f"wait for that run to end, or choose another {setting}",
    )


def check_run_dir(run_dir: Path, *, setting: str = "hydra.run.dir") -> None:
    if (run_dir / METRICS_FILE).exists():
        raise UserError(
            f"{run_dir} already holds a run; starting another there would mix their results",
            setting=setting,
            fix=f"choose a new {setting}, or add trainer.resume=auto to continue that run",
        )

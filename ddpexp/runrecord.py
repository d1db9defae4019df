"""A run's record (metrics.json, which rank 0's recorder writes) read back, and what it means.

The lowest layer of reading results: the standard library only (no torch, nothing of ddpexp above
fsutil, host and procstat), so the report, the cost model, the HParams view and the in-process API
can all use it.

    METRICS_FILE            the record's file name in a run directory
    read_run_record(where)  the one reader: a RunRecord, None when the run left no record yet, or
                            RunRecordError (a ValueError) when the file is there but unreadable
    RunRecord               what the record holds, typed (status, facts, final, best, history,
                            started_at, wall_s, time_to_first_step_s, attempts, error, nonfinite,
                            owner), and the whole parsed file as `raw`, so no reader loses a key
    owner_record(pid)       who a `running` record belongs to (pid, host, boot id, the pid's start)
    owner_gone(owner)       whether that process has ended (gone_error(owner): the error that says so)
    steady(per_epoch)       per-epoch values without the warm-up epoch
    strategy_label(facts)   "ddp comm_hook=bf16": the strategy and its settings that differ from defaults

What the recorder writes (ddpexp/recorder.py): `status` (running, completed, failed, ...), `facts`
(the job's settings and host, ddpexp/facts.py), `final` (the last epoch's values), `best` (the epoch
whose best metric was best), `history` (one record per epoch), `started_at` (the recorder's start, Unix
seconds), `wall_s` (its start to its close), `time_to_first_step_s`, `attempts` (a resumed run counts
its attempts), `error` (how a failed run failed), `nonfinite` (keys whose NaN/inf was written as null)
and `owner` (the process that runs the job: owner_record).

A run killed outright (SIGKILL, the OOM killer, a machine gone) cannot say how it ended: its record
stays `running`. Every reader gets the true status from here: a `running` record whose owner is gone
reads as CRASHED (`RunRecord.lost`), and the next command that claims the directory writes that into
the file (recorder.settle_lost). An owner on another machine cannot be checked from here, so its
record reads as written; a record without an owner (written before owners were) reads as CRASHED when
no live ddpexp process holds its directory or its sweep's (fsutil.claim).
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import fsutil, host, procstat

METRICS_FILE = "metrics.json"
CRASHED = "crashed"  # a `running` record whose owner is gone


class RunRecordError(ValueError):
    """A metrics.json that is there but cannot be read as a record (truncated, not JSON, not a JSON
    object, unreadable). `cause` is the exception behind it (JSONDecodeError, PermissionError...)."""

    def __init__(self, path: Path, cause: BaseException | str) -> None:
        self.path = path
        self.cause = cause
        why = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        super().__init__(f"{path} is not a readable run record ({why})")

    @property
    def kind(self) -> str:
        """The cause's type name (JSONDecodeError, PermissionError) or "not an object"."""
        return type(self.cause).__name__ if isinstance(self.cause, BaseException) else self.cause


@dataclass(frozen=True)
class RunRecord:
    """metrics.json, typed. Missing or mistyped keys read as empty (a record written before a key
    existed, or by a run that stopped early); numbers that are not finite read as None."""

    path: Path  # the metrics.json file
    status: str = "unknown"
    facts: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    best: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per epoch, in order
    started_at: float | None = None  # the recorder's start (Unix seconds)
    wall_s: float | None = None  # the recorder's start to its close
    time_to_first_step_s: float | None = None
    attempts: int = 1  # 2 and more: resumed
    error: str | None = None
    nonfinite: list[str] = field(default_factory=list)
    owner: dict[str, Any] = field(default_factory=dict)  # owner_record() of the process running it
    raw: dict[str, Any] = field(default_factory=dict)  # the whole file as parsed

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    @property
    def memory_per_rank(self) -> list[dict[str, Any]]:
        """Every rank's measured bytes by category (mem/*_mb), in rank order; [] if not measured."""
        ranks = self.raw.get("memory_per_rank")
        return [_dict(r) for r in ranks] if isinstance(ranks, list) else []

    @property
    def lost(self) -> bool:
        """Whether the file says `running` of a run whose owner is gone (read as CRASHED)."""
        return self.status == CRASHED and self.raw.get("status") == "running"

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path) -> RunRecord:
        attempts = data.get("attempts")
        error = data.get("error")
        status = str(data.get("status") or "unknown")
        owner = _dict(data.get("owner"))
        if status == "running" and _gone(owner, path.parent):
            status = CRASHED
            error = error or gone_error(owner)
        return cls(
            path=path,
            status=status,
            facts=_dict(data.get("facts")),
            final=_dict(data.get("final")),
            best=_dict(data.get("best")),
            history=[h for h in data.get("history") or [] if isinstance(h, dict)],
            started_at=finite_number(data.get("started_at")),
            wall_s=finite_number(data.get("wall_s")),
            time_to_first_step_s=finite_number(data.get("time_to_first_step_s")),
            attempts=attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else 1,
            error=None if error is None else str(error),
            nonfinite=[str(key) for key in data.get("nonfinite") or []],
            owner=owner,
            raw=data,
        )


def read_run_record(where: Path | str) -> RunRecord | None:
    """The record of a run: `where` is its directory (metrics.json inside it) or the file itself.

    None when there is no record (the directory or file does not exist, or the run has not written
    one yet): a normal state that every caller must decide about. A record that is there but cannot be
    read (truncated by a crash, not JSON, not a JSON object, no permission) raises RunRecordError,
    whose message names the file and the cause."""
    path = Path(where)
    if path.is_dir():
        path = path / METRICS_FILE
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunRecordError(path, exc) from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RunRecordError(path, exc) from exc
    if not isinstance(data, dict):
        raise RunRecordError(path, "not an object")
    return RunRecord.from_dict(data, path)


def read_run_record_or_none(where: Path | str) -> RunRecord | None:
    """`read_run_record` for callers that treat a damaged record like a missing one (a status check
    that must not fail: the run's own error is reported elsewhere)."""
    try:
        return read_run_record(where)
    except RunRecordError:
        return None


def owner_record(pid: int) -> dict[str, Any]:
    """Who a `running` record belongs to: process `pid` (the job's launcher, or the process training
    in-process) on this machine. Its start time tells it from a later process given the same pid;
    the boot id, from the same pid after a reboot."""
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": host.machine_id(),
        "start": procstat.start_time(pid),
    }


def _gone(owner: dict[str, Any], run_dir: Path) -> bool:
    if not owner:  # a record from before owners: no live claim on its directory or its sweep's
        return not (fsutil.held(run_dir) or fsutil.held(run_dir.parent))
    return owner_gone(owner)


def owner_gone(owner: dict[str, Any]) -> bool:
    """Whether the process `owner` (owner_record) is known to have ended; False where this machine
    cannot tell (another host, no pid)."""
    if owner.get("host") != socket.gethostname():
        return False  # another machine's process: nothing here can tell
    boot = host.machine_id()
    if owner.get("boot_id") and boot and owner["boot_id"] != boot:
        return True  # this machine has restarted since
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return False
    return procstat.is_gone(pid, owner.get("start"))


def gone_error(owner: dict[str, Any]) -> str:
    if not owner:
        return "the run ended without recording how (no live ddpexp process holds its directory)"
    return (
        f"the run's process (pid {owner.get('pid')} on {owner.get('host')}) ended without recording "
        "how: killed outright (SIGKILL, the out-of-memory killer) or its machine went down"
    )


def steady(per_epoch: list[float]) -> list[float]:
    """Per-epoch values without the first when there are several: the first epoch includes warm-up
    (compilation, caches, rendezvous skew). The one definition the report's samples/s, the HParams
    view's and the cost model's per-step numbers share."""
    return per_epoch[1:] if len(per_epoch) > 1 else per_epoch


def strategy_label(facts: dict[str, Any]) -> str:
    """The strategy and the settings it ran with that differ from its defaults, so that variants of one
    strategy (fsdp with and without reshard_after_forward, ddp with each comm_hook) read apart."""
    settings = dict(facts.get("strategy_settings") or {})
    syncbn = bool(settings.pop("sync_bn", facts.get("sync_bn")))
    shown = [f"{key}={setting_text(value)}" for key, value in sorted(settings.items())]
    return " ".join([str(facts.get("strategy", "?")) + (" +syncbn" if syncbn else ""), *shown])


def is_accuracy(tag: str) -> bool:
    """Accuracies (eval/acc, eval/top<k>, eval/token_acc): fractions in metrics.json, percent wherever
    a person reads them (console, report, TensorBoard)."""
    return tag in ("eval/acc", "eval/token_acc") or tag.startswith("eval/top")


def setting_text(value: Any) -> str:
    """A setting's value as it is written on the command line: true/false, null."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite int or float (not a bool); else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}

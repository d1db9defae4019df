"""The record a rank leaves of the exception that ended it (logs/rank<N>.error.json), and how the
launchers read them: which record explains a failure, and how it reads on the console."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any


def error_file(run_dir: Path, rank: int) -> Path:
    """Where a worker leaves the record of the exception that ended it (read by the supervisor)."""
    return run_dir / "logs" / f"rank{rank}.error.json"


def read_error(run_dir: Path, rank: int) -> dict[str, Any] | None:
    """The error record `rank` left (written atomically, so whole), or None when it left none."""
    try:
        record: dict[str, Any] = json.loads(error_file(run_dir, rank).read_text())
    except FileNotFoundError:
        return None
    return record


# What a rank's collective says when a peer went away: an echo of another rank's failure, never a
# cause while a record of a rank's own failure exists (gloo's and NCCL's words).
LOST_PEER = (
    "closed by peer",
    "reset by peer",
    "Broken pipe",
    "communicator was aborted",
    "remote process exited",
)


def first_cause(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The error record that explains a failure: the earliest of the ranks' own failures, a lost peer
    only where no rank recorded one (the peers of a rank that fails while writing, say a full disk,
    see their connection close moments before it records why)."""
    own = [r for r in records if not any(words in r["message"] for words in LOST_PEER)]
    return min(own or records, key=lambda r: r["time"])


def error_summary(record: dict[str, Any]) -> str:
    """How an error record reads after "rank N": a user error's own line, else `failed: Type: message`."""
    return record["message"] if record["user_error"] else f"failed: {record['type']}: {record['message']}"


def set_aside_errors(run_dir: Path) -> None:
    """The error records an earlier attempt left (a restarted group's, or an earlier command's in this
    run dir) move aside to rank<N>.attempt<K>.error.json, K the first free number: a failure is
    explained by its own attempt's records only."""
    logs = run_dir / "logs"
    for path in sorted(logs.glob("rank*.error.json")):
        m = re.fullmatch(r"rank(\d+)\.error\.json", path.name)
        if m is None:
            continue
        k = 0
        while (aside := logs / f"rank{m[1]}.attempt{k}.error.json").exists():
            k += 1
        with contextlib.suppress(FileNotFoundError):  # another node's launcher, on a shared disk
            path.rename(aside)

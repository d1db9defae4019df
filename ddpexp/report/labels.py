"""One label per row, the same in the table's strategy column and in every plot's legend: the strategy
with its settings (`ddp +syncbn`, `ddp comm_hook=bf16`), and, where rows of one group share that, the
parts of their run names (the sweep's overrides) that tell them apart (`ddp threads=2`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

REPEAT_KEYS = ("seed=", "repeat=", "+repeat=", "+seed=")
DEVICE_KEYS = ("dist.", "+dist.")  # what sets the device count: one series of a scaling plot spans them


def repeat_free_name(name: str) -> str:
    """A run's name without its seed=/repeat= parts: `seed=1,strategy=ddp` → `strategy=ddp`."""
    head, _, last = name.rpartition("/")
    kept = [part for part in last.split(",") if not part.startswith(REPEAT_KEYS)]
    return "/".join(p for p in (head, ",".join(kept)) if p)


def distinct_labels(
    items: Sequence[tuple[str, str]], *, ignore: tuple[str, ...] = (), unique: bool = True
) -> list[str]:
    """The label of each (strategy label, run name): the strategy label where no other item has it,
    else with the name's parts (minus those starting with `ignore`) that not all items of that
    strategy label share. `unique`: labels still equal get their run names appended, in parentheses."""
    parts = [_parts(name, ignore) for _, name in items]
    labels = []
    for i, (strategy, _) in enumerate(items):
        same = [parts[j] for j, (other, _) in enumerate(items) if other == strategy]
        common = set.intersection(*(set(p) for p in same))
        labels.append(" ".join([strategy, *(p for p in parts[i] if p not in common)]))
    if not unique:
        return labels
    counts = Counter(labels)
    return [
        f"{label} ({name})" if counts[label] > 1 else label
        for label, (_, name) in zip(labels, items, strict=True)
    ]


def _parts(name: str, ignore: tuple[str, ...]) -> list[str]:
    last = repeat_free_name(name).rpartition("/")[2]
    return [p for p in last.split(",") if p and not p.startswith(ignore)]

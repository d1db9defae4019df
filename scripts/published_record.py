"""The published record (ddpexp/planner/published_record.yaml): predict every row from its config alone
and compare with what was published.

    python scripts/published_record.py                 # the table and the summary, predicted now
    python scripts/published_record.py --update        # and write the predictions into the record
    python scripts/published_record.py --recommend     # and, per published setting, the search's choice
    python scripts/published_record.py --rows mosaicml # only the rows whose id contains this

Prints a markdown table (docs/published_record.md shows it) and the summary: the median and worst
|error| of tokens/s per device over the held-out rows and over all, how many runs are predicted to fit
on their own hardware, and the memory rows' worst error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddpexp.planner import record  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--update", action="store_true", help="write the predictions into the record")
    p.add_argument("--recommend", action="store_true", help="run the search for each published setting")
    p.add_argument("--rows", default="", help="only rows whose id contains this")
    p.add_argument("--fit", action="store_true", help="fit the device constants to the in-sample rows")
    args = p.parse_args()
    rec = record.load()
    if args.fit:
        fit(rec)
        return 0
    rows = []
    for row in rec.rows:
        if args.rows in row.id:
            start = time.perf_counter()
            row = dataclasses.replace(row, predicted=record.predict(row))
            print(f"{row.id}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        rows.append(row)
    rec.rows = rows
    if args.recommend:
        settings = sorted({r.setting for r in rows if r.setting and args.rows in r.id})
        rec.recommendations = []
        for setting in settings:
            start = time.perf_counter()
            rec.recommendations.append(record.recommend([r for r in rows if r.setting == setting]))
            print(f"{setting}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    print(table(rec))
    print()
    print(summary(rec))
    if args.update:
        write(rec)
    return 0


def fit(rec: record.Record) -> None:
    """Each device constant of record.FITTED, bisected until its row's predicted tokens/s is the
    published one (twice over: a later constant moves an earlier row a little); prints them."""
    from ddpexp.predict.device import load_device

    rows = {r.id: r for r in rec.rows}
    cache: dict[object, object] = {}
    for name, constants in record.FITTED.items():
        device = load_device(name, where=name)
        for _ in range(2):
            for parameter, row_id in constants:
                device = _bisect(device, parameter, rows[row_id], cache)
        print(f"{name}: " + ", ".join(f"{p} = {_get(device, p):.4g}" for p, _ in constants), flush=True)


def _get(device: object, parameter: str) -> float:
    field, _, kind = parameter.partition(".")
    value = getattr(device, field)
    return float(value[kind] if kind else value)


def _set(device: object, parameter: str, value: float) -> object:
    field, _, kind = parameter.partition(".")
    if kind:
        return dataclasses.replace(device, **{field: {**getattr(device, field), kind: value}})  # type: ignore[type-var]
    return dataclasses.replace(device, **{field: value})  # type: ignore[type-var]


def _bisect(device: object, parameter: str, row: record.Row, cache: dict[object, object]) -> object:
    low, high = (0.0, 100.0) if parameter.endswith("_us") else (0.1, 1.0)
    for _ in range(30):
        middle = (low + high) / 2
        predicted = record.predict(row, device=_set(device, parameter, middle), cache=cache)
        assert predicted is not None
        slower = predicted.tokens_per_s_per_device < row.published_tokens_per_s
        # More time per kernel slows a step; more efficiency speeds it.
        if parameter.endswith("_us") == slower:
            high = middle
        else:
            low = middle
    return _set(device, parameter, (low + high) / 2)


def table(rec: record.Record) -> str:
    head = (
        "| row | hardware | published tokens/s/GPU | predicted | error | published GiB | predicted GiB "
        "| fits |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rec.rows:
        name = f"{r.id}" + (" (in-sample)" if r.in_sample else "")
        if r.predicted is None:
            lines.append(
                f"| {name} | {r.hardware} | {r.published_tokens_per_s:,.0f} | - | missing: {r.missing} | "
                f"{_gib(r.published_gib)} | - | - |"
            )
            continue
        error = r.error() or 0.0
        lines.append(
            f"| {name} | {r.hardware} | {r.published_tokens_per_s:,.0f} | "
            f"{r.predicted.tokens_per_s_per_device:,.0f} | {error:+.0%} | {_gib(r.published_gib)} | "
            f"{r.predicted.peak_gib:.1f} | {'yes' if r.predicted.fits else 'no'} |"
        )
    return "\n".join(lines)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary(rec: record.Record) -> str:
    s = rec.summary()
    lines = [
        f"held out: {s['held_out_rows']} rows, median |error| {_pct(s['held_out_median_error'])}, "
        f"worst {_pct(s['held_out_worst_error'])}",
        f"all: {s['all_rows']} rows, median |error| {_pct(s['all_median_error'])}, "
        f"worst {_pct(s['all_worst_error'])}",
        f"predicted to fit on their own hardware: {s['predicted_to_fit']} of {s['runnable_rows']}",
        f"memory: {s['memory_rows']} rows, worst |error| {_pct(s['memory_worst_error'])}",
        f"not expressible yet: {s['missing_rows']} rows",
    ]
    for r in rec.recommendations:
        lines.append(
            f"setting {r.setting}: recommended {r.recommended} ({r.recommended_tokens_per_s:,.0f} "
            f"tokens/s/GPU); the published layout, {r.published_row}, predicted at "
            f"{r.published_tokens_per_s:,.0f} ({r.within:+.0%})"
        )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def write(rec: record.Record) -> None:
    raw = yaml.safe_load(record.RECORD.read_text())
    by_id = {r.id: r for r in rec.rows}
    for item in raw["rows"]:
        predicted = by_id[item["id"]].predicted
        item.pop("predicted", None)
        if predicted is not None:
            item["predicted"] = predicted.to_dict()
    raw["date"] = datetime.date.today().isoformat()
    raw["machine"] = f"{platform.node()} ({platform.machine()}), predicted from the config alone"
    if rec.recommendations:
        raw["recommendations"] = [dataclasses.asdict(r) for r in rec.recommendations]
    header = "".join(line + "\n" for line in record.RECORD.read_text().splitlines() if line.startswith("#"))
    record.RECORD.write_text(header + yaml.safe_dump(raw, sort_keys=False, width=120))


if __name__ == "__main__":
    raise SystemExit(main())

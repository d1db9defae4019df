"""`python -m ddpexp.report DIR [DIR ...]` (or `ddpexp-report`): which strategy, and at what cost.

The command line: find the runs, group them, draw the plots, write report.md / .csv / .json and print
the table (what each part means: the package's docstring, ddpexp/report/__init__.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import fsutil
from .groups import Group, context_line, group_runs
from .plots import accuracy_figure, colours, cost_figure, loss_figure, save, throughput_figure
from .prediction import prediction
from .records import records, write_csv
from .runs import find_runs
from .scaling_plot import scaling_figure
from .table import heading, markdown, plain, table, weak_table
from .weak import weak_scaling


def plots(
    groups: list[Group], out: Path, *, target: float, predicted: Callable[[Group], Any] | None = None
) -> list[Path]:
    """The PNGs (each drawn only when it has something to show), one palette for all."""
    palette = colours(groups)
    title = context_line([run for group in groups for row in group.rows for run in row.runs])
    figures = {
        "acc_vs_time.png": accuracy_figure(groups, palette=palette, title=title, target=target),
        "loss_vs_step.png": loss_figure(groups, palette=palette, title=title),
        "loss_vs_cost.png": cost_figure(groups, palette=palette, title=title),
        "throughput.png": throughput_figure(groups, palette=palette, title=title),
        "scaling.png": scaling_figure(groups, palette=palette, title=title, predicted=predicted),
    }
    return [save(fig, out / name) for name, fig in figures.items() if fig is not None]


def render_markdown(groups: list[Group], *, dirs: list[Path], target: float, images: list[Path]) -> str:
    runs = sum(row.n for group in groups for row in group.rows)
    body = [
        f"# ddpexp report: {', '.join(map(str, dirs))}",
        "",
        f"{runs} runs in {len(groups)} group(s); time to target = seconds from the job's start until the "
        f"best metric first reached {target:g}.",
    ]
    for group in groups:
        body += ["", f"## {heading(group)}", "", markdown(*table(group, target)), ""]
        body += [f"- note: {note}" for note in group.notes]
        body += [f"- [{flag.number}] warning: {flag.text}" for flag in group.flags()]
    for series in weak_scaling(groups):
        body += ["", f"## {series.title}", "", markdown(*weak_table(series)), ""]
    body += ["", *(f"![{p.stem}]({p.name})" for p in images), ""]
    return "\n".join(body)


def render_plain(groups: list[Group], target: float) -> str:
    lines: list[str] = []
    for group in groups:
        lines += [heading(group), plain(*table(group, target))]
        lines += [f"note: {note}" for note in group.notes]
        lines += [f"warning [{flag.number}]: {flag.text}" for flag in group.flags()]
        lines.append("")
    for series in weak_scaling(groups):
        lines += [series.title, plain(*weak_table(series)), ""]
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ddpexp-report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep or run directories")
    parser.add_argument(
        "--target", type=float, default=0.95, help="best-metric value for 'time to target' (0.95)"
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the first dir)")
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="NAME",
        help="the row efficiency is measured against: a strategy label (single, 'ddp comm_hook=bf16') "
        "or a run's name (default: each group's `single` run)",
    )
    parser.add_argument(
        "--predict",
        default=None,
        metavar="PROFILE|commbench.json",
        help="scaling.png also shows ddpexp-predict's curves for each strategy of a group, from the "
        "group's single run and this interconnect (conf/interconnect: localhost_gloo, nvlink4, ib400...) "
        "or commbench result",
    )
    parser.add_argument(
        "--format",
        choices=("md", "csv", "json"),
        default="md",
        help="report.md (default), report.csv or report.json",
    )
    args = parser.parse_args(argv)
    missing = [d for d in args.dirs if not d.is_dir()]
    if missing:
        print(f"ddpexp-report: error: {missing[0]} is not a directory", file=sys.stderr)
        sys.exit(2)
    runs = find_runs(args.dirs)
    if not runs:
        print(
            f"ddpexp-report: error: no runs (metrics.json) under {', '.join(map(str, args.dirs))}",
            file=sys.stderr,
        )
        sys.exit(2)
    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, baseline=args.baseline)
    predicted = prediction(args.predict) if args.predict else None
    images = plots(groups, out, target=args.target, predicted=predicted)
    path = out / f"report.{args.format}"
    if args.format == "md":
        text = render_markdown(groups, dirs=args.dirs, target=args.target, images=images)
        fsutil.atomic_write_text(path, text)
    elif args.format == "csv":
        write_csv(path, records(groups, args.target))
    else:
        fsutil.atomic_write_text(path, json.dumps(records(groups, args.target), indent=1) + "\n")
    print(render_plain(groups, args.target))
    print(f"report: {path}")

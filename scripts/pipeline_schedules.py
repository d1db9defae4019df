"""Every pipeline schedule on the same job, in turn, repeated: the measured bubble next to its
formula, the step time, each rank's activations (the largest rank's) and what the stages send. The
schedules alternate within each round, so a machine whose load changes affects them alike; medians
over the rounds, with the range of step times.

    python scripts/pipeline_schedules.py                      # gpt_tiny at 4 layers, 2 ranks, 3 rounds
    python scripts/pipeline_schedules.py --rounds 5 --format md
    python scripts/pipeline_schedules.py --extra strategy.microbatches=8
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import ddpexp
from ddpexp.runrecord import read_run_record

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
JOB = [
    "model=gpt_tiny",
    "model.n_layer=4",
    "data=python_stdlib",
    "task=lm",
    "strategy=pipeline",
    "trainer.batch_size=32",
    "trainer.max_steps=20",
    "trainer.epochs=1",
    "trainer.progress=false",
    "checkpoint.every_epochs=null",
]


def run(out: Path, schedule: str, round_: int, extra: list[str]) -> dict[str, float]:
    run_dir = out / f"{schedule}-{round_}"
    result = ddpexp.run([*JOB, f"strategy.schedule={schedule}", *extra, f"hydra.run.dir={run_dir}"])
    if result.status != "completed":
        raise SystemExit(f"{schedule}: the run {result.status} (see {run_dir}/ddpexp.log)")
    record = read_run_record(run_dir)
    assert record is not None
    final = dict(record.final)
    final["activations_mb"] = max(r["mem/activations_mb"] for r in record.memory_per_rank)
    return final


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--out", type=Path, default=Path("outputs") / f"schedules-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    p.add_argument("--format", choices=("text", "md"), default="text")
    p.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SCHEDULES}
    for round_ in range(args.rounds):
        for schedule in SCHEDULES:
            runs[schedule].append(run(args.out, schedule, round_, args.extra))
    head = ["schedule", "bubble measured", "textbook", "step ms (range)", "activations MB", "sent KB/step"]
    rows = []
    for schedule, finals in runs.items():
        steps = [1000 * f["perf/step_time_s"] for f in finals]
        rows.append(
            [
                schedule,
                f"{statistics.median(f['pipe/bubble_frac'] for f in finals):.2f}",
                f"{finals[0]['pipe/bubble_frac_textbook']:.2f}",
                f"{statistics.median(steps):.1f} ({min(steps):.1f}-{max(steps):.1f})",
                f"{finals[0]['activations_mb']:.2f}",
                f"{finals[0]['comm/bytes_per_step/activations'] / 1024:.0f}",
            ]
        )
    if args.format == "md":
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        for row in [head, *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

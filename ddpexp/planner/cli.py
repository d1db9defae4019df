"""`ddpexp plan`: the command line (the package's docstring says what it does)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..predict import validation
from . import emit, picture, verify
from .estimate import Estimate, candidates, estimate, job_of, launch_args
from .profiles import GIB, Cluster, cluster_names, load_cluster


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpexp plan",
        description="Rank every strategy and mesh for a model on a cluster you are about to rent: fits, "
        "step time, tokens/s, MFU, and time and cost to a target.",
        epilog="Other arguments are ddpexp's overrides (model=..., data=..., trainer.batch_size=...).",
    )
    p.add_argument(
        "--cluster", required=True, help=f"a profile ({', '.join(cluster_names())}) or a YAML file"
    )
    p.add_argument("--nodes", type=int, help="nodes of the profile's size (default: the profile's)")
    p.add_argument("--price", type=float, help="USD per device and hour (default: the profile's)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--tokens", type=float, help="train this many tokens (e.g. 1e9)")
    target.add_argument("--epochs", type=float, help="train this many epochs of the dataset")
    p.add_argument("--by", choices=("cost", "time"), default="cost", help="sort by cost or by time")
    p.add_argument("--format", choices=("table", "md", "csv", "json"), default="table")
    p.add_argument(
        "--validation",
        type=Path,
        help="the held-out validation record the time and cost ranges come from (default: ddpexp's, from "
        "its development VM; scripts/predict_vs_measured.py --record FILE writes yours)",
    )
    p.add_argument(
        "--emit",
        choices=("torchrun", "slurm", "skypilot"),
        help="write the file that runs the recommended plan on the cluster",
    )
    p.add_argument("--emit-to", type=Path, help="where --emit writes (default: plan_torchrun.sh, ...)")
    p.add_argument("--plot", type=Path, help="draw predicted time against cost per plan into this PNG")
    p.add_argument(
        "--verify",
        type=int,
        metavar="K",
        help="run the first K plans that fit on this machine (a CPU profile of it) and print the regret",
    )
    p.add_argument("--verify-rounds", type=int, default=1, help="runs of each plan, in turn (medians)")
    p.add_argument("--verify-epochs", type=int, default=2, help="epochs a run (the first is left out)")
    p.add_argument(
        "--verify-dir", type=Path, help="where the runs go (default: outputs/DATE/TIME_plan_verify)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        print(f"ddpexp plan: error: {flags[0]} is not an option (ddpexp plan --help)", file=sys.stderr)
        return UserError.exit_code
    try:
        cluster = load_cluster(args.cluster, nodes=args.nodes, price=args.price)
        if args.verify is not None:
            verify.check(cluster, args.verify)
            if args.verify_rounds < 1 or args.verify_epochs < 2:
                raise UserError(
                    f"--verify-rounds {args.verify_rounds}, --verify-epochs {args.verify_epochs}",
                    setting="--verify-epochs",
                    fix="give 1 round or more and 2 epochs or more (a run's first epoch is left out)",
                )
        spread = validation.load(args.validation)
        results, job = plan(args, overrides, cluster)
    except UserError as exc:
        print(f"ddpexp plan: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(render(results, cluster, args, job, spread), end="")
    if args.plot:
        print(f"wrote {picture.write(args.plot, results, cluster, job, spread)}: predicted time against cost")
    if args.verify is not None:
        out = args.verify_dir or verify.default_out()
        ran = verify.verify(
            results, job, cluster, args.verify, rounds=args.verify_rounds, epochs=args.verify_epochs, out=out
        )
        print()
        print(verify.render(ran, cluster, args.verify_rounds, args.verify_epochs, out), end="")
    if args.emit:
        best = next(r for r in results if r.note is None and r.fits)
        try:
            cmd = launch_args(overrides, best.candidate.overrides, cluster)
            path = emit.write(args.emit, args.emit_to, cluster, cmd, best.time_s / 3600, best.candidate.label)
        except UserError as exc:
            print(f"ddpexp plan: error: --emit {args.emit}: {exc}", file=sys.stderr)
            return exc.exit_code
        print(f"wrote {path}: {best.candidate.label}, {args.emit}")
    return 0


def plan(args: argparse.Namespace, overrides: list[str], cluster: Cluster) -> tuple[list[Estimate], Any]:
    from .. import composition
    from ..predict.interconnect import fabric

    with composition.composer() as compose:
        cfg = compose(overrides)
    job = job_of(overrides, cfg, tokens=args.tokens if args.epochs is None else None, epochs=args.epochs)
    links = fabric(cluster.interconnect)
    results = [
        estimate(c, job, cluster, links)
        for c in candidates(cluster, job.stages, loss_parallel=job.loss_parallel)
    ]
    if not any(r.fits for r in results):
        runnable = [r for r in results if r.note is None]
        if not runnable:
            raise UserError(results[0].note or "no strategy runs this job")  # the first one's refusal
        least = min(runnable, key=lambda r: r.peak_bytes)
        need, usable = least.peak_bytes / GIB, cluster.usable_bytes / GIB
        raise UserError(
            f"no strategy fits on {cluster.devices} x {cluster.device}: the leanest, "
            f"{least.candidate.label}, needs {need:,.2f} GiB per rank of the {usable:,.2f} usable",
            setting="--nodes",
            fix=f"rent more devices (--nodes {2 * cluster.nodes}), a smaller trainer.batch_size, or "
            "trainer.activation_checkpointing=full",
        )
    # Without a target there is no cost: by step time (cost per token follows it on one cluster).
    key = (lambda r: r.cost) if args.by == "cost" and job.target_tokens else (lambda r: r.step_s)
    results.sort(key=lambda r: (r.note is not None, not r.fits, key(r) if r.note is None else 0.0))
    return results, job


def _duration(seconds: float, spread: validation.Validation) -> str:
    """`seconds` in the unit that reads best, with the range the validation puts around it."""
    if not math.isfinite(seconds):
        return "-"
    unit, size = ("d", 86400) if seconds >= 86400 else ("h", 3600) if seconds >= 3600 else ("min", 60)
    low, high = spread.around(seconds)
    return f"{seconds / size:.1f} {unit} ({low / size:.1f}-{high / size:.1f})"


def _money(usd: float, spread: validation.Validation) -> str:
    if not math.isfinite(usd):
        return "-"
    digits = 2 if usd < 100 else 0
    low, high = spread.around(usd)
    return f"{usd:,.{digits}f} ({low:,.{digits}f}-{high:,.{digits}f})"


HEAD = [
    "plan",
    "fits",
    "GiB/rank",
    "step s",
    "tokens/s",
    "MFU",
    "GB/step node",
    "GB/step net",
    "time",
    "cost $",
]


def _row(r: Estimate, spread: validation.Validation) -> list[str]:
    if r.note is not None:
        return [r.candidate.label, "-", "-", "-", "-", "-", "-", "-", "-", r.note]
    fits = "yes" if r.fits else f"no: {r.largest}"
    return [
        r.candidate.label,
        fits,
        f"{r.peak_bytes / GIB:,.1f}",
        f"{r.step_s:.3f}",
        f"{r.tokens_per_s:,.0f}",
        f"{r.mfu:.1%}",
        f"{r.bytes_intra / 1e9:,.2f}",
        f"{r.bytes_inter / 1e9:,.2f}",
        _duration(r.time_s, spread),
        _money(r.cost, spread),
    ]


def _record(r: Estimate, spread: validation.Validation) -> dict[str, Any]:
    fields = {
        "plan": r.candidate.label,
        "overrides": r.candidate.overrides,
        "note": r.note,
        "fits": r.fits,
        "peak_gib_per_rank": r.peak_bytes / GIB,
        "largest_category": r.largest,
        "step_s": r.step_s,
        "compute_s": r.compute_s,
        "exposed_comm_s": r.exposed_s,
        "tokens_per_s": r.tokens_per_s,
        "mfu": r.mfu,
        "bytes_per_step_intra_node": r.bytes_intra,
        "bytes_per_step_inter_node": r.bytes_inter,
        "steps": r.steps,
        "time_s": r.time_s,
        "cost_usd": r.cost,
    }
    out: dict[str, Any] = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()
    }
    if out["time_s"] is not None:
        out["time_s_range"] = list(spread.around(r.time_s))
        out["cost_usd_range"] = list(spread.around(r.cost))
    return out


def render(
    results: list[Estimate],
    cluster: Cluster,
    args: argparse.Namespace,
    job: Any,
    spread: validation.Validation,
) -> str:
    if args.format == "json":
        plans = [_record(r, spread) for r in results]
        ranges = {"ranges_from": spread.describe()}
        return json.dumps({"cluster": cluster.name, **ranges, "plans": plans}, indent=2) + "\n"
    rows = [_row(r, spread) for r in results]
    if args.format == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerows([HEAD, *rows])
        return out.getvalue()
    if args.format == "md":
        table = "\n".join(
            [
                "| " + " | ".join(HEAD) + " |",
                "|" + "---|" * len(HEAD),
                *("| " + " | ".join(r) + " |" for r in rows),
            ]
        )
    else:
        widths = [max(len(x) for x in col) for col in zip(HEAD, *rows, strict=True)]
        table = "\n".join(
            "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
            for line in [HEAD, *rows]
        )
    target = (
        f"{job.target_tokens:,.0f} tokens"
        if job.target_tokens
        else "no target (--tokens N for time and cost)"
    )
    head = (
        f"{cluster.devices} x {cluster.device} ({cluster.nodes} node(s), {cluster.interconnect}), "
        f"${cluster.price_per_device_hour:g} per device-hour, {cluster.achieved_mfu:.0%} of peak assumed; "
        f"global batch {job.global_batch} x {job.seq_len} tokens; to {target}"
    )
    if job.target_tokens:
        head += f"\nTime and cost ranges: {spread.describe()}."
    return f"{head}\n{table}\n\n{advice(results, args.by if job.target_tokens else 'time')}\n"


def advice(results: list[Estimate], by: str) -> str:
    """The recommendation and the runner-up, a sentence each."""
    fitting = [r for r in results if r.note is None and r.fits]
    best = fitting[0]
    what = "cheapest" if by == "cost" else "fastest"

    def why(r: Estimate) -> str:
        share = r.exposed_s / r.step_s if r.step_s else 0.0
        return (
            f"{r.peak_bytes / GIB:,.1f} GiB per rank (most of it {r.largest}), "
            f"{share:.0%} of its step waiting for communication"
        )

    lines = [
        f"Recommended: {best.candidate.label} ({' '.join(best.candidate.overrides)}), the {what} of the "
        f"{len(fitting)} plans that fit: {why(best)}."
    ]
    if len(fitting) > 1:
        second = fitting[1]
        slower = second.step_s / best.step_s - 1
        dearer = second.cost - best.cost
        extra = f", ${dearer:,.2f} more" if math.isfinite(dearer) else ""
        lines.append(f"Runner-up: {second.candidate.label}, {slower:+.0%} step time{extra}: {why(second)}.")
    return "\n".join(lines)

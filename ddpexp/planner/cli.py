"""`ddpexp plan`: the command line (the package's docstring says what it does)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..predict import validation
from . import emit, picture, verify
from .estimate import DEFAULT_SEQ_CAP, Estimate, chooses, composed, job_of, launch_args, target_args
from .profiles import GIB, Cluster, cluster_names, load_cluster
from .search import given_layout, search, to_stderr

EPILOG = """\
Other arguments are ddpexp's overrides (model=..., trainer.batch_size=..., trainer.precision=bf16...):
the job to plan. A language model needs no data=: it is planned on synthetic tokens at its context
length (--seq-len N to choose). With strategy=... the layout given is planned as given (one row).

examples:
  ddpexp plan model=llama3_1_8b trainer.precision=bf16 optim=adamw --cluster 8xh100_sxm --tokens 1e9
  ddpexp plan model=llama3_70b trainer.batch_size=64 trainer.precision=bf16 optim=adamw \\
      --cluster 8xa100_80gb --nodes 8 --seq-len 8192
  ddpexp plan model=llama3_1_8b trainer.batch_size=16 trainer.precision=bf16 optim=adamw \\
      strategy=fsdp trainer.activation_checkpointing=selective --cluster 8xh100_sxm --seq-len 8192
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpexp plan",
        description="Rank every strategy and mesh for a model on a cluster you are about to rent: fits, "
        "step time, tokens/s, MFU, and time and cost to a target.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cluster", required=True, help=f"a profile ({', '.join(cluster_names())}) or a YAML file"
    )
    p.add_argument("--nodes", type=int, help="nodes of the profile's size (default: the profile's)")
    p.add_argument("--price", type=float, help="USD per device and hour (default: the profile's)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--tokens", type=float, help="train this many tokens (e.g. 1e9)")
    target.add_argument("--epochs", type=float, help="train this many epochs of the dataset")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sample of the synthetic tokens a language model is planned on when no data= is "
        f"given (default: the model's context, at most {DEFAULT_SEQ_CAP:,})",
    )
    p.add_argument(
        "--mfu",
        type=float,
        help="time every step at this share of the peak instead of the per-op model (an override, named "
        "in the output)",
    )
    p.add_argument("--all", action="store_true", help="list every layout tried, not only each mesh's best")
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
    p.add_argument(
        "--plot",
        type=Path,
        help="draw each plan's predicted time and cost, the recommended one marked, into this PNG",
    )
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


def check_target(tokens: float | None, epochs: float | None) -> None:
    """What to train to must be a finite amount above 0 (argparse takes nan, inf and 1e400 as floats)."""
    for flag, value, example in (("--tokens", tokens, "1e9"), ("--epochs", epochs, "3")):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(
                f"{value:g} is not an amount to train: plans are timed and priced to a finite amount above 0",
                setting=flag,
                fix=f"give {flag} {example}, or leave it out to compare step times only",
            )


def check_output(path: Path | None, flag: str) -> None:
    """A file the plan will write, checked before the search (minutes) rather than after it: a regular
    file, or none yet, in a directory that exists and takes a new file."""
    import tempfile

    if path is None:
        return
    folder = path.parent
    why = (
        "is a directory"
        if path.is_dir()
        else "is not a regular file"
        if path.exists() and not path.is_file()
        else f"is in {folder}, which is not a directory"
        if not folder.is_dir()
        else None
    )
    if why is None:
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as exc:
            why = f"cannot be written in {folder}: {exc.strerror}"
    if why is not None:
        raise UserError(
            f"{path} {why}",
            setting=flag,
            fix="give a file path in a directory you can write to (create the directory first)",
        )


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        print(f"ddpexp plan: error: {flags[0]} is not an option (ddpexp plan --help)", file=sys.stderr)
        return UserError.exit_code
    try:
        check_target(args.tokens, args.epochs)
        check_output(args.plot, "--plot")
        if args.emit:
            check_output(args.emit_to or Path(emit.FILES[args.emit]), "--emit-to")
        cluster = load_cluster(args.cluster, nodes=args.nodes, price=args.price)
        if args.mfu is not None:
            if not 0 < args.mfu <= 1:
                raise UserError(f"--mfu {args.mfu}", setting="--mfu", fix="give a share of the peak, 0..1")
            cluster = dataclasses.replace(cluster, achieved_mfu=args.mfu)
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
    # Machine formats own stdout: what else the command says goes to stderr.
    say = (lambda line: print(line, file=sys.stderr)) if args.format in ("json", "csv") else print
    if args.plot:
        say(f"wrote {picture.write(args.plot, results, cluster, job, spread)}: predicted time against cost")
    if args.verify is not None:
        out = args.verify_dir or verify.default_out()
        quiet = args.format in ("json", "csv")  # the runs' own output must not follow the JSON
        with stdout_to_stderr() if quiet else contextlib.nullcontext():
            ran = verify.verify(
                results,
                job,
                cluster,
                args.verify,
                rounds=args.verify_rounds,
                epochs=args.verify_epochs,
                out=out,
            )
        say("")
        say(verify.render(ran, cluster, args.verify_rounds, args.verify_epochs, out).rstrip("\n"))
    if args.emit:
        try:
            best = next((r for r in results if r.note is None and r.fits), None)
            if best is None:
                raise UserError("the layout given does not fit", setting="strategy", fix="plan without it")
            target = target_args(job, best.steps, planned_data=not chooses(overrides, "data"))
            cmd = launch_args(job.overrides, [*best.candidate.overrides, *target], cluster)
            path = emit.write(args.emit, args.emit_to, cluster, cmd, best.time_s / 3600, best.label)
        except UserError as exc:
            print(f"ddpexp plan: error: --emit {args.emit}: {exc}", file=sys.stderr)
            return exc.exit_code
        say(f"wrote {path}: {best.label}, {args.emit}")
    return 0


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Everything written to stdout inside, by this process or the ones it starts, goes to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def plan(args: argparse.Namespace, overrides: list[str], cluster: Cluster) -> tuple[list[Estimate], Any]:
    from ..predict.interconnect import fabric

    job = job_of(
        *composed(overrides, args.seq_len),
        tokens=args.tokens if args.epochs is None else None,
        epochs=args.epochs,
    )
    links = fabric(cluster.interconnect)
    results = search(job, cluster, links, progress=to_stderr, everything=args.all)
    if given_layout(job.overrides, job) is not None:
        return results, job
    if not any(r.fits for r in results):
        runnable = [r for r in results if r.note is None]
        if not runnable:
            raise UserError(results[0].note or "no strategy runs this job")  # the first one's refusal
        least = min(runnable, key=lambda r: r.peak_bytes)
        need, usable = least.peak_bytes / GIB, cluster.usable_bytes / GIB
        if least.largest == "host memory" and least.peak_bytes <= cluster.usable_bytes:
            raise UserError(
                f"no strategy fits on {cluster.devices} x {cluster.device}: the leanest, {least.label}, "
                f"offloads {least.host_bytes / GIB:,.1f} GiB a node to host memory of "
                f"{cluster.host_memory_gib or 0:,.0f} GiB",
                setting="--nodes",
                fix=f"rent more devices (--nodes {2 * cluster.nodes}) or hosts with more memory",
            )
        raise UserError(
            f"no strategy fits on {cluster.devices} x {cluster.device}: the leanest, "
            f"{least.label}, needs {need:,.2f} GiB per rank of the {usable:,.2f} usable",
            setting="--nodes",
            fix=f"rent more devices (--nodes {2 * cluster.nodes}), a smaller trainer.batch_size, or "
            "a shorter --seq-len",
        )
    # Without a target there is no cost: by step time (cost per token follows it on one cluster).
    key = (lambda r: r.cost) if args.by == "cost" and job.target_tokens else (lambda r: r.step_s)
    results.sort(key=lambda r: (r.note is not None, not r.fits, key(r) if r.note is None else 0.0))
    return results, job


def _shown(value: float, decimals: int) -> str:
    """`value` to `decimals` places, or to two significant digits where those places would show 0
    (a small model's bytes, MFU, minutes and cents)."""
    if value == 0 or abs(value) >= 0.5 * 10**-decimals:
        return f"{value:,.{decimals}f}"
    return f"{value:.2g}"


def _duration(seconds: float, spread: validation.Validation) -> str:
    """`seconds` in the unit that reads best, with the range the validation puts around it."""
    if not math.isfinite(seconds):
        return "-"
    units = [("d", 86400), ("h", 3600), ("min", 60), ("s", 1)]
    unit, size = next(((u, n) for u, n in units if seconds >= n), units[-1])
    low, high = spread.around(seconds)
    return f"{_shown(seconds / size, 1)} {unit} ({_shown(low / size, 1)}-{_shown(high / size, 1)})"


def _money(usd: float, spread: validation.Validation) -> str:
    if not math.isfinite(usd):
        return "-"
    digits = 2 if usd < 100 else 0
    low, high = spread.around(usd)
    return f"{_shown(usd, digits)} ({_shown(low, digits)}-{_shown(high, digits)})"


HEAD = [
    "plan",
    "fits",
    "GiB/rank",
    "step s",
    "tokens/s/device",
    "MFU",
    "GB/step node",
    "GB/step net",
    "time",
    "cost $",
]


def _seconds(value: float) -> str:
    """A step's seconds with the digits that show it (a small model's step is milliseconds)."""
    return f"{value:.3f}" if value >= 0.1 else f"{value:.2g}" if value > 0 else "0"


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f}" if value >= 0.1 * GIB else f"{value / GIB:.2g}"


def _row(r: Estimate, spread: validation.Validation) -> list[str]:
    if r.note is not None:
        return [r.label, "-", "-", "-", "-", "-", "-", "-", "-", r.note]
    fits = "yes" if r.fits else f"no: {r.largest}"
    return [
        r.label,
        fits,
        _gib(r.peak_bytes),
        _seconds(r.step_s),
        f"{r.tokens_per_s_per_device:,.0f}",
        f"{_shown(100 * r.mfu, 1)}%",
        _shown(r.bytes_intra / 1e9, 2),
        _shown(r.bytes_inter / 1e9, 2),
        _duration(r.time_s, spread),
        _money(r.cost, spread),
    ]


def _record(r: Estimate, spread: validation.Validation) -> dict[str, Any]:
    fields = {
        "plan": r.label,
        "mesh": r.candidate.label,
        "overrides": r.candidate.overrides,
        "note": r.note,
        "fits": r.fits,
        "peak_gib_per_rank": r.peak_bytes / GIB,
        "largest_category": r.largest,
        "peak_gib_by_category": {k: v / GIB for k, v in r.parts.items()},
        "micro_batch": r.micro_batch,
        "step_s": r.step_s,
        "compute_s": r.compute_s,
        "exposed_comm_s": r.exposed_s,
        "optimizer_s": r.optimizer_s,
        "tokens_per_s": r.tokens_per_s,
        "tokens_per_s_per_device": r.tokens_per_s_per_device,
        "mfu": r.mfu,
        "bytes_per_step_intra_node": r.bytes_intra,
        "bytes_per_step_inter_node": r.bytes_inter,
        "host_gib_per_node": r.host_bytes / GIB,
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


def timing_basis(cluster: Cluster) -> str:
    """What the step times rest on, said in the header."""
    if cluster.achieved_mfu is not None:
        return f"step time at {cluster.achieved_mfu:.0%} of peak (an MFU override, not the per-op model)"
    return "step time from the per-op model"


def render(
    results: list[Estimate],
    cluster: Cluster,
    args: argparse.Namespace,
    job: Any,
    spread: validation.Validation,
) -> str:
    if args.format == "json":
        plans = [_record(r, spread) for r in results]
        about = {"ranges_from": spread.describe(), "timing": timing_basis(cluster), "seq_len": job.seq_len}
        return json.dumps({"cluster": cluster.name, **about, "plans": plans}, indent=2) + "\n"
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
        f"${cluster.price_per_device_hour:g} per device-hour, {timing_basis(cluster)}; "
        f"global batch {job.global_batch} x {job.seq_len} tokens; to {target}"
    )
    if job.target_tokens:
        head += f"\nTime and cost ranges: {spread.describe()}."
    return f"{head}\n{table}\n\n{advice(results, args.by if job.target_tokens else 'time')}\n"


def advice(results: list[Estimate], by: str) -> str:
    """The recommendation and the runner-up, a sentence each; for a layout given as such, its verdict."""
    fitting = [r for r in results if r.note is None and r.fits]
    what = "cheapest" if by == "cost" else "fastest"

    def why(r: Estimate) -> str:
        share = r.exposed_s / r.step_s if r.step_s else 0.0
        return (
            f"{_gib(r.peak_bytes)} GiB per rank (most of it {r.largest}), "
            f"{share:.0%} of its step waiting for communication"
        )

    if len(results) == 1 and results[0].candidate.given:
        (r,) = results
        if r.note is not None:
            return f"The layout given cannot run: {r.note}"
        verdict = "fits" if r.fits else f"does not fit (most of it {r.largest})"
        return f"The layout given {verdict}: {why(r)}."
    best = fitting[0]
    lines = [
        f"Recommended: {best.label}: {' '.join(best.candidate.overrides)}; the {what} of the "
        f"{len(fitting)} plans that fit: {why(best)}."
    ]
    if len(fitting) > 1:
        second = fitting[1]
        slower = second.step_s / best.step_s - 1
        dearer = second.cost - best.cost
        extra = f", ${dearer:,.2f} more" if math.isfinite(dearer) else ""
        lines.append(f"Runner-up: {second.label}, {slower:+.0%} step time{extra}: {why(second)}.")
    return "\n".join(lines)

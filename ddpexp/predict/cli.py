"""`ddpexp-predict` (`python -m ddpexp.predict`): the command line of the cost model (the package's
docstring says what it predicts and how)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import UserError
from .measured import MeasuredRun
from .model import Predictor, target_strategy
from .render import render


def _sizes(text: str, what: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise UserError(
            f"{text!r} is not a list of positive counts", setting=what, fix=f"e.g. {what} 1,2,4,8"
        )
    return sizes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpexp-predict",
        description="Predict a run's step time and scaling efficiency on W devices over N nodes.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (it holds metrics.json)")
    p.add_argument("--devices", default="1,2,4,8", help="device counts W, comma-separated (default 1,2,4,8)")
    p.add_argument("--nodes", default="1", help="node counts N, comma-separated (default 1)")
    p.add_argument(
        "--interconnect",
        help="profile(s) from conf/interconnect (nvlink4, or nvlink4,ib400: intra- then inter-node), "
        "or a YAML file",
    )
    p.add_argument(
        "--commbench",
        type=Path,
        action="append",
        help="a commbench.json whose fitted alpha/beta to use; repeat it for results measured at other "
        "process counts on one host (each is used at its own count)",
    )
    p.add_argument("--strategy", help="predict this strategy (a conf/strategy option) instead of the run's")
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the predicted strategy (repeatable), e.g. --set comm_hook=bf16",
    )
    p.add_argument(
        "--overlap-efficiency", type=float, help="share of the hideable communication that hides (0-1)"
    )
    p.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        help="a run of the predicted strategy at another size (e.g. 2 devices): what it measured beyond "
        "the prediction there is added at every size (default strategy: that run's)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    if "" not in sys.path:  # a run of your own model is rebuilt from this directory, as ddpexp runs it
        sys.path.insert(0, "")
    args = parser().parse_args(argv)
    try:
        if args.overlap_efficiency is not None and not 0 <= args.overlap_efficiency <= 1:
            raise UserError(
                f"{args.overlap_efficiency} is not a share", setting="--overlap-efficiency", fix="give 0..1"
            )
        devices, nodes = _sizes(args.devices, "--devices"), _sizes(args.nodes, "--nodes")
        calibration = MeasuredRun.of(args.calibrate) if args.calibrate else None
        if calibration is not None and args.strategy is None:
            args.strategy = target_strategy(calibration).settings.name
        predictor = Predictor.build(
            args.run_dir,
            interconnect=args.interconnect,
            commbench=args.commbench,
            strategy=args.strategy,
            settings=args.settings,
            overlap=args.overlap_efficiency,
            calibration=calibration,
        )
        if predictor.shape.note:  # said first, not only among the assumptions under the table
            print(f"ddpexp-predict: {predictor.shape.note}", file=sys.stderr)
        points = predictor.points(devices, nodes)
        if not points:
            raise UserError(
                "no device count is a multiple of a node count",
                setting="--devices",
                fix="e.g. --devices 2,4 --nodes 1,2",
            )
    except UserError as exc:
        print(f"ddpexp-predict: error: {exc}", file=sys.stderr)
        return exc.exit_code
    wider = [p for p in points if p.devices > 1]
    if args.strategy is None and wider and all(p.note is not None for p in wider):
        return _predict_spread(args, predictor, devices, nodes)
    print(render(predictor, points))
    return 0


# What a one-device run is predicted as when no --strategy is given: those that fit its host.
SPREAD = ("ddp", "fsdp", "zero", "dp")


def _predict_spread(args: argparse.Namespace, run: Predictor, devices: list[int], nodes: list[int]) -> int:
    """A one-device run (the usual baseline) without --strategy: a table for each strategy of SPREAD
    that runs on the run's host at more than one device, and one line first naming them."""
    fitting, left_out = [], []
    for name in SPREAD:
        predictor = Predictor.build(
            args.run_dir,
            interconnect=args.interconnect,
            commbench=args.commbench,
            strategy=name,
            overlap=args.overlap_efficiency,
        )
        points = predictor.points(devices, nodes)
        if any(p.note is None for p in points if p.devices > 1):
            fitting.append((predictor, points))
        else:
            left_out.append(name)
    device = run.host.device_type
    names = ", ".join(p.strategy.settings.name for p, _ in fitting)
    skipped = "".join(f"; {name} needs GPUs" for name in left_out if name == "dp")
    print(
        f"ddpexp-predict: {run.strategy.settings.name} runs on one device: predicting {names}, the "
        f"strategies that run on its {device} host{skipped} (--strategy NAME predicts another: "
        "naive_allreduce, ps, ...; python -m ddpexp --help lists them)"
    )
    for predictor, points in fitting:
        print()
        print(render(predictor, points))
    return 0

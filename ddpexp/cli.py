"""Command line: `python -m ddpexp [overrides]` / `ddpexp [overrides]`.

    argv ──► --help ──► pre-flight: compose + check every job (nothing started yet)
         ──► Hydra: a run dir per job ──► launch (in-process, spawned workers, or torchrun rank)

Bad input stops at pre-flight with one line and exit code 2: no process spawned, no directory made.
Under torchrun only rank 0 composes; the other ranks take the resolved job from it (launch/torchrun.py).
torch.distributed.launch's `--local-rank=N` is taken out of argv first (torchrun.take_local_rank).
Self-launched on several machines (dist.nnodes), only node 0 runs Hydra; the others, after their own
pre-flight, join node 0's run directory (launch/nodes.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from .errors import NothingToDo, UserError, interrupted_within


def main(argv: list[str] | None = None, *, early_workers: bool = False) -> None:
    """`early_workers`: this process is the command line's own (console), so it may start the
    workers' forkserver before pre-flight knows whether a job needs it (launch/warmup.py)."""
    started_at = float(os.environ.get("DDPEXP_T0") or time.time())  # DDPEXP_T0: a caller's own clock
    argv = list(sys.argv[1:] if argv is None else argv)
    if "" not in sys.path:  # the console script finds your modules in this directory, as python -m does
        sys.path.insert(0, "")
    from hydra._internal.utils import get_args_parser

    from .launch import torchrun

    try:
        argv = torchrun.take_local_rank(argv)  # torch.distributed.launch passes --local-rank=N
    except UserError as exc:
        print(f"ddpexp: error: {exc}", file=sys.stderr)
        sys.exit(UserError.exit_code)
    if argv[:1] == ["plan"]:  # `ddpexp plan ...`: the planner's own command line
        from .planner import main as plan

        sys.exit(plan(argv[1:]))
    args, unknown = get_args_parser().parse_known_args(argv)
    if unknown and not unknown[0].startswith("-"):  # an override after an option: argparse's order
        overrides = [a for a in argv if "=" in a and not a.startswith("-")]
        options = [a for a in argv if a not in overrides]
        print(
            f"ddpexp: error: {unknown[0]} comes after an option, where the command line takes none "
            f"(fix: put the options before the key=value overrides: python -m ddpexp "
            f"{' '.join([*options, *overrides])})",
            file=sys.stderr,
        )
        sys.exit(UserError.exit_code)
    if unknown:
        flag = unknown[0].split("=", 1)[0]
        key = flag.lstrip("-").replace("-", "_")
        print(
            f"ddpexp: error: {flag} is not an option: ddpexp takes key=value overrides "
            f"(fix: e.g. trainer.{key}=3 instead of {flag} 3; python -m ddpexp --help lists the settings)",
            file=sys.stderr,
        )
        sys.exit(UserError.exit_code)
    if args.help:
        from .help import help_text

        print(help_text())
        return
    if torchrun.rank() is not None:  # before the store's threads start: they would inherit no mask
        from .launch import senders

        # The agent's SIGTERM or SIGINT to every rank, told from one sent to one rank.
        senders.watch((signal.SIGTERM, signal.SIGINT))
    if torchrun.is_follower():
        sys.exit(torchrun.follow())
    if not _is_plain_run(args):  # --cfg, --info, --shell-completion...: Hydra's own business
        sys.exit(_hydra_main(argv))
    if early_workers and torchrun.world() is None:  # under torchrun, torchrun starts the workers
        from .launch import warmup

        warmup.start_early()  # importing torch on another core while this process imports its own
    _import_torch()
    from .composition import CONFIG_NAME, search_path_override
    from .plan import ExternalWorld
    from .runner import run_command

    world = torchrun.world()
    try:
        if args.config_path:
            raise UserError(
                "replaces ddpexp's own configs",
                setting="--config-path",
                fix="use --config-dir DIR to add yours",
            )
        outcomes = run_command(
            list(args.overrides) + search_path_override(args.config_dir),
            multirun=args.multirun,
            started_at=started_at,
            report=_print_outcome,
            config_name=args.config_name or CONFIG_NAME,
            external=ExternalWorld(*world) if world else None,
        )
    except NothingToDo as done:
        print(f"ddpexp: {done}", flush=True)
        sys.exit(0)
    except UserError as exc:
        if interrupted_within(exc):  # Ctrl-C left a half-built config whose next error is not the cause
            raise KeyboardInterrupt from exc
        if world is not None:
            torchrun.publish_error(exc)
        print(f"ddpexp: error: {exc}", file=sys.stderr)
        sys.exit(UserError.exit_code)
    sys.exit(next((o.exit_code for o in outcomes if o.exit_code != 0), 0))


def _print_outcome(outcome: Any) -> None:
    if outcome.error:
        print(f"ddpexp: error: {outcome.error}", file=sys.stderr)
    if outcome.note:
        print(f"ddpexp: {outcome.note}")
    code = "" if outcome.exit_code == 0 else f"  (exit code {outcome.exit_code})"
    print(f"run dir: {outcome.run_dir}{code}", flush=True)


def console() -> None:
    """The `ddpexp` script and `python -m ddpexp`: main(), then exit without the interpreter's teardown
    (~0.9 s with torch loaded). Not for in-process callers, which call main() and catch SystemExit."""
    try:
        main(early_workers=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:  # Ctrl-C before any job started (pre-flight, imports): one line
        print("ddpexp: interrupted before anything started", file=sys.stderr)
        code = 130
    # a forkserver started early that no job used (bad input, --help, single); main() imported warmup
    # if it started one, and a Ctrl-C may have cut that import short
    release = getattr(sys.modules.get("ddpexp.launch.warmup"), "release", None)
    if release is not None:
        release()
    from .launch.leave import exit_now  # imports no torch: it may be half-imported

    exit_now(code)


def _import_torch() -> None:
    """`import torch` with Ctrl-C held back until it is done, then delivered as usual. torch imports
    numpy from C and drops an exception raised there: a KeyboardInterrupt in that second was lost (the
    run went on) and left numpy half-imported."""
    if "torch" in sys.modules:
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _is_plain_run(args: Any) -> bool:
    """Pre-flight applies to runs and sweeps, not to --cfg/--info/--shell-completion and friends."""
    return not (args.cfg or args.info or args.shell_completion or args.hydra_help or args.experimental_rerun)


def _hydra_main(argv: list[str]) -> int:
    import hydra

    from .composition import CONFIG_NAME, conf_dir, register_schema

    register_schema()
    sys.argv = [sys.argv[0], *argv]
    hydra.main(config_path=conf_dir(), config_name=CONFIG_NAME, version_base="1.3")(lambda cfg: None)()
    return 0

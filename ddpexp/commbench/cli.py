"""`python -m ddpexp.commbench [overrides]` / `ddpexp-commbench`: ddpexp's own command line (pre-flight,
Hydra's run directory, the launcher, torchrun) on conf/commbench.yaml instead of conf/config.yaml."""

from __future__ import annotations

import sys

from .settings import SMOKE_ITERS, SMOKE_MAX_BYTES, SMOKE_WARMUP, CommbenchConfig

CONFIG_NAME = "commbench"

USAGE = """\
ddpexp.commbench: how long each collective takes on this machine and backend, like nccl-tests:
time, algorithm bandwidth and bus bandwidth per op and message size, and a fitted latency-bandwidth
model (time ~ alpha + bytes x beta) per op. Launched the way ddpexp trains: the same backends, init
methods, dist.* settings and torchrun.

Usage:
  python -m ddpexp.commbench [key=value ...]                      W ranks (dist.nprocs; default 2 on CPU,
                                                                  one per GPU)
  python -m ddpexp.commbench backend=gloo dist.nprocs=3 init=tcp
  torchrun --nproc-per-node=2 -m ddpexp.commbench backend=gloo

Settings (commbench.*):
  commbench.ops=[{ops}]
              what to measure (sendrecv: rank i sends to i+1, receives from i-1)
  commbench.min_bytes={min_bytes}  commbench.max_bytes={max_bytes}
              sizes: doubling from min to max (all_gather: the gathered output; reduce_scatter: the
              input; all_to_all: each rank's send buffer; see ddpexp/commbench/__init__.py)
  commbench.warmup={warmup}  commbench.iters={iters}
              untimed and timed calls per size; time = the slowest rank's mean per call
  commbench.dtype={dtype}     float32|float64|bfloat16|float16
  commbench.smoke=true
              a quick try: sizes up to {smoke_kib} KiB, {smoke_warmup} warm-up and {smoke_iters} timed calls
ddpexp's launch settings: backend=auto|nccl|gloo|mpi  init=env|tcp|file  device=auto|cpu|cuda
  dist.nprocs=N  dist.master_port=P  dist.nnodes=N dist.node_rank=R  dist.timeout_s=600
  (python -m ddpexp.commbench --cfg job shows them all)

Outputs, in the run directory (hydra.run.dir=...; default outputs/DATE/TIME_commbench): the table
(also on the console), commbench.json (facts, results, fits), commbench.png (busbw against size,
log-log), config.yaml, plan.json, logs/."""


def help_text() -> str:
    d = CommbenchConfig()
    return USAGE.format(
        ops=",".join(str(op) for op in d.ops),
        min_bytes=d.min_bytes,
        max_bytes=d.max_bytes,
        warmup=d.warmup,
        iters=d.iters,
        dtype=d.dtype,
        smoke_kib=SMOKE_MAX_BYTES // 2**10,
        smoke_warmup=SMOKE_WARMUP,
        smoke_iters=SMOKE_ITERS,
    )


def main(argv: list[str] | None = None) -> None:
    """ddpexp.cli.main on the benchmark's config (a --config-name given here still wins)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return
    from .. import cli

    cli.main(["--config-name", CONFIG_NAME, *argv])


def console() -> None:
    """The `ddpexp-commbench` script and `python -m ddpexp.commbench` (ddpexp.cli.console's exit)."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        print("ddpexp: interrupted before anything started", file=sys.stderr)
        code = 130
    from ..launch.leave import exit_now  # imports no torch: it may be half-imported

    exit_now(code)

"""Measure a GPU's matmul throughput over the shapes training runs (one CUDA GPU), as the share of its
peak the per-op model's device profile needs (conf/devices: `matmul_table`).

    python scripts/gemm_efficiency.py --peak-tflops 989.5          # prints the YAML entries
    python scripts/gemm_efficiency.py --peak-tflops 989.5 --append conf/devices/h100_sxm.yaml

Each (M, N, K) of a grid from 256 to 16384 on every side, bf16 (and fp32 with --fp32), is timed with
CUDA events over `--iterations` calls after a warm-up, the median of `--repeats`. The share printed is
2 M N K / time / peak. A profile with a `matmul_table` uses the measured share of the nearest shape
measured (in the logarithm of M, N and K) instead of its one `matmul_efficiency`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

SIDES = (256, 1024, 4096, 16384)


def measure(m: int, n: int, k: int, dtype: object, iterations: int, repeats: int) -> float:
    """Seconds one (m x k) @ (k x n) matmul takes on the GPU, the median of `repeats` timings."""
    import torch

    a = torch.randn(m, k, device="cuda", dtype=dtype)  # type: ignore[arg-type]
    b = torch.randn(k, n, device="cuda", dtype=dtype)  # type: ignore[arg-type]
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iterations)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak-tflops", type=float, required=True, help="the device's dense bf16 peak")
    p.add_argument("--fp32-peak-tflops", type=float, help="its fp32 peak (with --fp32)")
    p.add_argument("--fp32", action="store_true", help="fp32 matmuls too")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--append", type=Path, help="append the table to this device profile")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gemm_efficiency: needs a CUDA GPU", file=sys.stderr)
        return 2
    kinds = [("bf16", torch.bfloat16, args.peak_tflops)]
    if args.fp32:
        kinds.append(("fp32", torch.float32, args.fp32_peak_tflops or args.peak_tflops))
    device = torch.cuda.get_device_name()
    lines = [f"# Measured by scripts/gemm_efficiency.py on {device}, torch {torch.__version__}."]
    lines.append("matmul_table:")
    for name, dtype, peak in kinds:
        lines.append(f"  {name}:")
        for m, n, k in itertools.product(SIDES, repeat=3):
            seconds = measure(m, n, k, dtype, args.iterations, args.repeats)
            share = 2 * m * n * k / seconds / (peak * 1e12)
            lines.append(f"    - [{m}, {n}, {k}, {share:.3f}]")
            print(f"{name} {m} x {n} x {k}: {2 * m * n * k / seconds / 1e12:,.1f} TFLOP/s", file=sys.stderr)
    text = "\n".join(lines) + "\n"
    if args.append:
        with args.append.open("a") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

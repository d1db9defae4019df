"""Model FLOPs utilisation: the FLOPs a model's training needs per token, against what the devices
could do at their peak.

  perf/mfu = flops_per_token x perf/tokens_per_s / (peak FLOP/s of one device x devices)

FLOPs per token are the model's own (`model.flops_per_token(seq_len)`, forward and backward: for
ddpexp's GPT the standard 6N + 12 * n_layer * dim * seq_len, N its parameters as its docstring counts
them, the second term attention's scores and weighted sum); a model without that method gets no MFU.
The peak is `trainer.peak_flops` where set; else, for a GPU of the table below, NVIDIA's datasheet
figure for the precision the matmuls run in (bf16 for bf16 and fp16 autocast, tf32 for fp32 with TF32
matmuls allowed, else fp32), dense: the datasheets give tensor figures with 2:4 sparsity, halved here.
CPUs have no table: MFU is reported on them only with trainer.peak_flops set.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import Precision

# NVIDIA datasheets (A100; H100 SXM, PCIe and NVL; H200 SXM and NVL), TFLOP/s: bf16 and tf32 tensor
# figures are with sparsity (halved below), fp32 is dense. Matched against torch.cuda.get_device_name
# in this order (the first name it contains): "NVIDIA H100 80GB HBM3" is the SXM part.
DATASHEET_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 NVL", {"bf16": 1671 / 2, "tf32": 835 / 2, "fp32": 60}),
    ("H100 PCIe", {"bf16": 1513 / 2, "tf32": 756 / 2, "fp32": 51}),
    ("H100", {"bf16": 1979 / 2, "tf32": 989 / 2, "fp32": 67}),
    ("H200 NVL", {"bf16": 1671 / 2, "tf32": 835 / 2, "fp32": 60}),
    ("H200", {"bf16": 1979 / 2, "tf32": 989 / 2, "fp32": 67}),
    ("A100", {"bf16": 624 / 2, "tf32": 312 / 2, "fp32": 19.5}),
)


def matmul_kind(precision: Precision) -> str:
    """What a GPU's matmuls run in: bf16 (bf16 or fp16 autocast: the same peak), tf32 or fp32."""
    if precision != Precision.fp32:
        return "bf16"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def gpu_peak(name: str, kind: str) -> float | None:
    """FLOP/s of one GPU of this name at its dense peak for `kind`, or None when it is not in the table."""
    for part, peaks in DATASHEET_TFLOPS:
        if part.lower() in name.lower():
            return peaks[kind] * 1e12
    return None


def peak_flops(setting: float | None, device: torch.device, precision: Precision) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where that number comes from); None when unknown."""
    if setting is not None:
        return float(setting), "trainer.peak_flops"
    if device.type != "cuda":
        return None, f"{device.type}: no table, set trainer.peak_flops"
    name = torch.cuda.get_device_name(device)
    kind = matmul_kind(precision)
    peak = gpu_peak(name, kind)
    if peak is None:
        return None, f"{name}: not in ddpexp's table, set trainer.peak_flops"
    return peak, f"{name}, {kind} dense (NVIDIA datasheet)"


def model_flops_per_token(model: Any, seq_len: int | None) -> float | None:
    """Training FLOPs per token (forward and backward) the model declares, or None."""
    declared = getattr(model, "flops_per_token", None)
    if seq_len is None or not callable(declared):
        return None
    return float(declared(seq_len))

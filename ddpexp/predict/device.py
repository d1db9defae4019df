"""One device's speed, from its profile (conf/devices/*.yaml), and the time a trace of ops
(ddpexp.predict.ops) takes on it.

Each op takes the longer of its compute and its memory traffic (a roofline; a matmul, their sum), and
every kernel `kernel_us` besides:

  matmul     FLOPs / (the dense peak for its input dtype x `matmul_efficiency` x the share of the
             device's multiprocessors its output tiles keep busy), plus its
             bytes / (memory bandwidth x `memory_efficiency`): small or thin matmuls are slowed by
             their loads and, below one tile per multiprocessor, by the tiles that leave them idle
             (NVIDIA's "Matrix Multiplication Background" guide)
  attention  FLOPs / (peak x `attention_efficiency`, forward or backward: a flash kernel's share of
             the peak, published per device)
  memory     bytes / (memory bandwidth x `memory_efficiency`)

The host issues each kernel in `launch_us` (eager mode one per op; under torch.compile element-wise
chains are fused, Trace.fused, into fewer): a step whose kernels finish faster than the host issues
them is bound by the host (small models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from .ops import Op, Work

PEAK_KINDS = ("bf16", "tf32", "fp32")
# What a matmul of inputs this size runs at: 2-byte floats on the tensor cores' bf16/fp16 peak; fp32 at
# the fp32 peak (ddpexp leaves TF32 off, torch's default); 1-byte (float8) at the fp8 peak where given.
PEAK_OF_SIZE = {1: "fp8", 2: "bf16", 4: "fp32"}


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    peak_tflops: dict[str, float]  # dense, by what the matmuls run in
    memory_bandwidth_GBps: float = 0.0
    multiprocessors: int = 0  # SMs: what a GEMM's output tiles are spread over (0: not modelled)
    # The share of the peak a large GEMM reaches, by what it runs in (bf16, fp32...); {}: no per-op model.
    matmul_efficiency: dict[str, float] = field(default_factory=dict)
    attention_efficiency: tuple[float, float] = (0.0, 0.0)  # forward, backward
    # The share of that a context-parallel ring's attention keeps: chunked kernels, each merged into
    # the others' result by log-sum-exp in fp32, the gradients accumulated in fp32.
    ring_efficiency: float = 1.0
    memory_efficiency: float = 0.9
    launch_us: float = 0.0  # host time per kernel launched
    kernel_us: float = 0.0  # device time every kernel takes besides its work (start-up, tail)
    tile: tuple[int, int] = (128, 128)  # a GEMM kernel's output tile
    type: str = "cuda"  # cpu: a process of one thread on a core of its own
    # Measured shares of the peak by dtype: (M, N, K, share) rows (scripts/gemm_efficiency.py); where
    # given, a matmul takes the nearest shape's share instead of the model's.
    matmul_table: dict[str, tuple[tuple[int, int, int, float], ...]] = field(default_factory=dict)
    # Its link to the host's memory (conf/interconnect): what offload's copies cross.
    host_link: str = "pcie5"

    def peak_flops(self, precision: str) -> float:
        """The dense peak matmuls run at under trainer.precision: bf16 for mixed precision, fp32
        otherwise (a GPU's tf32 where the profile has no fp32 figure)."""
        kind = "bf16" if precision != "fp32" else "fp32"
        return self.peak_tflops.get(kind, self.peak_tflops.get("tf32", 0.0)) * 1e12

    @property
    def per_op(self) -> bool:
        """Whether the profile has what the per-op model needs (else only a given MFU can time it)."""
        return bool(self.matmul_efficiency) and self.memory_bandwidth_GBps > 0

    def op_s(self, op: Op) -> float:
        """Seconds one op takes on the device (the module's roofline)."""
        memory = op.bytes / (self.memory_bandwidth_GBps * 1e9 * self.memory_efficiency)
        if op.kind == "memory":
            return memory
        kind = PEAK_OF_SIZE.get(op.element_size, "fp32")
        peak = self.peak_tflops.get(kind) or self.peak_tflops["bf16"]
        if op.kind == "attention":
            forward, backward = self.attention_efficiency
            share = backward if "backward" in op.name else forward
            if op.ring > 1:
                share *= self.ring_efficiency
            return max(op.flops / (peak * 1e12 * share), memory)
        measured = self.matmul_table.get(kind)
        if measured and op.shape is not None:
            return op.flops / (peak * 1e12 * _nearest(measured, op.shape))
        efficiency = self.matmul_efficiency.get(kind) or self.matmul_efficiency["bf16"]
        # A GEMM's loads are not all hidden behind its math: the two add, which is what makes a thin
        # matmul (a small model's) reach a small share of the peak.
        return op.flops / (peak * 1e12 * efficiency * self.wave_share(op)) + memory

    def wave_share(self, op: Op) -> float:
        """The share of the multiprocessors a matmul's output tiles keep busy: all of them once there
        are as many tiles as multiprocessors (the libraries balance a last partial wave, stream-K), fewer
        where its output cannot fill the device even split over K (split-K, as cuBLAS does for a
        weight's gradient, a small matrix summed over many tokens)."""
        if op.shape is None or not self.multiprocessors:
            return 1.0
        batch, m, n, k = op.shape
        tiles = batch * math.ceil(m / self.tile[0]) * math.ceil(n / self.tile[1])
        tiles *= max(1, min(self.multiprocessors // max(tiles, 1), k // 256))
        return min(1.0, tiles / self.multiprocessors)

    def time(
        self, work: Work, *, compiled: bool = False, launches: tuple[float, float] = (0.0, 0.0)
    ) -> Timing:
        """The time of a rank's micro-batch (`Work`: its traces, weighted) on the device, by pass: its
        kernels' time, or the host's where it issues them slower than they run (compiled code too
        launches each of its kernels from Python, Inductor's wrapper, without CUDA graphs).
        `launches`: kernels the host launches besides the ops', per micro-batch, forward and
        backward (a strategy's collectives)."""
        kernel = {"forward": 0.0, "backward": 0.0}
        count = {"forward": launches[0], "backward": launches[1]}
        for trace, weight in work.parts:
            for op in trace.fused() if compiled else trace.ops:
                kernel[op.phase] += weight * (self.op_s(op) + self.kernel_us * 1e-6)
                count[op.phase] += weight
        host = self.launch_us * 1e-6
        return Timing(
            max(kernel["forward"], count["forward"] * host),
            max(kernel["backward"], count["backward"] * host),
            round(count["forward"] + count["backward"]),
        )


def _nearest(table: tuple[tuple[int, int, int, float], ...], shape: tuple[int, int, int, int]) -> float:
    """The measured share of the shape nearest `shape` (batch x M, N, K), in their logarithms."""
    batch, m, n, k = shape
    want = (math.log(max(batch * m, 1)), math.log(max(n, 1)), math.log(max(k, 1)))

    def distance(row: tuple[int, int, int, float]) -> float:
        return sum((math.log(r) - w) ** 2 for r, w in zip(row[:3], want, strict=True))

    return min(table, key=distance)[3]


@dataclass(frozen=True)
class Timing:
    """Seconds of one micro-batch's forward and backward (its recomputation included) on a device."""

    forward_s: float
    backward_s: float
    kernels: int = 0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def __add__(self, other: Timing) -> Timing:
        return Timing(
            self.forward_s + other.forward_s, self.backward_s + other.backward_s, self.kernels + other.kernels
        )

    def scaled(self, k: float) -> Timing:
        return Timing(self.forward_s * k, self.backward_s * k, round(self.kernels * k))


def load_device(spec: Any, *, where: str) -> Device:
    """A device profile: a conf/devices name, or a mapping (inline in a cluster profile); a missing or
    wrong field is one line naming it."""
    import yaml

    from ..composition import profile_file

    if isinstance(spec, str):
        path = profile_file("devices", spec, setting=f"{where}: device", what="device profile")
        raw: Any = yaml.safe_load(path.read_text()) or {}
        where = path.name
    else:
        raw = spec
    if not isinstance(raw, dict):
        raise _bad(where, "device", f"must be a mapping or a conf/devices name, got {raw!r}")
    peaks = raw.get("peak_tflops")
    if not isinstance(peaks, dict):
        raise _bad(where, "device.peak_tflops", "missing (bf16, tf32, fp32: dense TFLOP/s)")
    for kind in PEAK_KINDS:
        _positive(peaks.get(kind), where, f"device.peak_tflops.{kind}")
    attention = raw.get("attention_efficiency") or {}
    matmul = raw.get("matmul_efficiency") or {}
    if not isinstance(matmul, dict):
        matmul = {"bf16": matmul}
    if not raw.get("name"):
        raise _bad(where, "device.name", "missing")
    device = Device(
        name=str(raw["name"]),
        memory_gib=_positive(raw.get("memory_gib"), where, "device.memory_gib"),
        peak_tflops={str(k): float(v) for k, v in peaks.items()},
        memory_bandwidth_GBps=float(raw.get("memory_bandwidth_GBps") or 0.0),
        multiprocessors=int(raw.get("multiprocessors") or 0),
        matmul_efficiency={str(k): float(v) for k, v in matmul.items()},
        attention_efficiency=(float(attention.get("forward", 0.0)), float(attention.get("backward", 0.0))),
        ring_efficiency=float(raw.get("ring_efficiency") or 1.0),
        memory_efficiency=float(raw.get("memory_efficiency") or 0.9),
        launch_us=float(raw.get("launch_us") or 0.0),
        kernel_us=float(raw.get("kernel_us") or 0.0),
        matmul_table={
            str(kind): tuple((int(r[0]), int(r[1]), int(r[2]), float(r[3])) for r in rows)
            for kind, rows in (raw.get("matmul_table") or {}).items()
        },
        tile=tuple(raw.get("tile") or (128, 128)),
        type=str(raw.get("type", "cuda")),
        host_link=str(raw.get("host_link") or "pcie5"),
    )
    if device.type not in ("cuda", "cpu"):
        raise _bad(where, "device.type", f"{device.type!r}: give cuda (the default) or cpu")
    if device.matmul_efficiency and "bf16" not in device.matmul_efficiency:
        raise _bad(where, "device.matmul_efficiency.bf16", "missing: the figure other dtypes fall back to")
    for name, value in (
        *(("matmul_efficiency", v) for v in device.matmul_efficiency.values()),
        ("memory_efficiency", device.memory_efficiency),
        *(("attention_efficiency", v) for v in device.attention_efficiency),
        ("ring_efficiency", device.ring_efficiency),
    ):
        if not 0 <= value <= 1:
            raise _bad(where, f"device.{name}", f"is a share of the peak, got {value}: give 0..1")
    return device


def _positive(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _bad(where, key, f"must be a positive number, got {value!r}")
    return float(value)


def _bad(where: str, key: str, what: str) -> UserError:
    return UserError(what, setting=f"{where}: {key}", fix="see conf/devices/h100_sxm.yaml")

"""The collective benchmark (`python -m ddpexp.commbench`, `ddpexp-commbench`): what a backend's
collectives cost on this machine, measured the way nccl-tests measures them, through ddpexp's own
composition, pre-flight and launcher (any backend, init method, self-launched or under torchrun).

This module holds the pure part, importable without torch (a cost model uses it on recorded results):

    Op                     the collective operations, with nccl-tests' conventions: the one vocabulary
                           of ddpexp (strategies.comm.COLLECTIVE_OPS, which strategies describe what they
                           send with for the cost model, is this enum's values)
    bus_factor(op, world)  busbw = algbw x this factor; the cost model's bytes per link (ddpexp.predict)
    fit_alpha_beta(...)    time ~ alpha + bytes x beta, fitted on relative error
    sizes(...)             the message sizes an op is measured at

Size conventions (nccl-tests'): `bytes` is the whole buffer the operation is about, not what one rank
sends: all_reduce and broadcast: the buffer; all_gather: the gathered output (each rank contributes
bytes / W); reduce_scatter: the input each rank reduces (each rank keeps bytes / W); all_to_all: each
rank's send buffer (bytes / W to every rank, itself included); sendrecv: what each rank sends to the
next rank of the ring (and receives from the previous one).

algbw = bytes / time. busbw = algbw x bus_factor: the bandwidth each rank's link would need for a
ring algorithm to take that time, so one number compares across operations and world sizes.

    op              bus factor      (W ranks)
    all_reduce      2 (W - 1) / W   a reduce-scatter then an all-gather: each rank sends 2 (W-1)/W bytes
    all_gather      (W - 1) / W     each rank receives the W - 1 parts it does not have
    reduce_scatter  (W - 1) / W
    all_to_all      (W - 1) / W     each rank keeps one part of W
    broadcast       1               every byte reaches every rank once (a pipelined ring)
    sendrecv        1               point to point: the link carries the buffer once

On one rank (W = 1) nothing crosses a link, so every collective's factor is 0 (where nccl-tests keeps
broadcast's 1; the benchmark itself never runs on fewer than 2 ranks, so only the cost model meets it);
sendrecv stays 1 at any W: it is one message over one link, whatever the ring's size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Op(StrEnum):
    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    broadcast = "broadcast"
    all_to_all = "all_to_all"
    sendrecv = "sendrecv"  # point to point around the ring: rank i sends to i + 1, receives from i - 1


JSON_FILE = "commbench.json"  # in the run directory: the results and the fits (ddpexp/commbench/output.py)
PLOT_FILE = "commbench.png"  # busbw against size, one line per op

# The ops whose buffer is cut into one part per rank: their sizes are whole multiples of W elements.
SPLIT_OPS = frozenset({Op.all_gather, Op.reduce_scatter, Op.all_to_all})


def bus_factor(op: Op | str, world: int) -> float:
    """busbw / algbw for `op` on `world` ranks: the bytes that cross each rank's link per byte of the
    operation's size (nccl-tests' factors; 0 on one rank but for sendrecv: see the module docstring).
    ValueError for an op that is not an `Op` or a world below 1."""
    op = Op(op)
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if op == Op.sendrecv:
        return 1.0
    if world == 1:
        return 0.0  # one rank: nothing crosses a link
    if op == Op.all_reduce:
        return 2 * (world - 1) / world
    if op in SPLIT_OPS:
        return (world - 1) / world
    return 1.0  # broadcast


def sizes(op: Op | str, *, min_bytes: int, max_bytes: int, world: int, itemsize: int) -> list[int]:
    """The byte counts `op` is measured at: min_bytes doubling up to max_bytes, each rounded down to
    whole elements (to a multiple of W elements for the ops that split their buffer over ranks), at
    least one element (per rank); sizes that round to the same count are measured once."""
    granule = itemsize * (world if Op(op) in SPLIT_OPS else 1)
    out: list[int] = []
    size = min_bytes
    while size <= max_bytes:
        rounded = max(granule, size // granule * granule)
        if not out or rounded > out[-1]:
            out.append(rounded)
        size *= 2
    return out


@dataclass(frozen=True)
class Fit:
    """time ~ alpha_s + bytes x beta_s_per_byte, and how far the measurements are from it (relative:
    |fit - measured| / measured, the mean and the worst over the sizes fitted)."""

    alpha_s: float
    beta_s_per_byte: float
    rel_error_mean: float
    rel_error_max: float

    def time_s(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> Fit:
    """Least squares on relative error: minimise sum(((alpha + n beta - t) / t)^2), i.e. weighted least
    squares with weights 1/t^2, so that a 4-byte message's 20 us counts as much as a 64 MiB message's
    50 ms (plain least squares would fit the large sizes and leave alpha meaningless). alpha and beta
    are kept >= 0: where the unconstrained fit takes one below zero, the best fit with alpha = 0 or
    beta = 0 is returned."""
    if len(sizes) != len(times):
        raise ValueError(f"{len(sizes)} sizes but {len(times)} times")
    if len(set(sizes)) < 2:
        raise ValueError("fitting alpha and beta needs at least two different sizes")
    if any(t <= 0 for t in times) or any(n < 0 for n in sizes):
        raise ValueError("times must be positive and sizes non-negative")
    pairs = list(zip(sizes, times, strict=True))
    weights = [1.0 / (t * t) for _, t in pairs]

    def objective(alpha: float, beta: float) -> float:
        return math.fsum(w * (alpha + n * beta - t) ** 2 for w, (n, t) in zip(weights, pairs, strict=True))

    total = sum(weights)
    mean_n = sum(w * n for w, (n, _) in zip(weights, pairs, strict=True)) / total
    mean_t = sum(w * t for w, (_, t) in zip(weights, pairs, strict=True)) / total
    # Centred sums (two passes): n^2 reaches 1e15 at 64 MiB, too much for the one-pass normal equations.
    spread = sum(w * (n - mean_n) ** 2 for w, (n, _) in zip(weights, pairs, strict=True))
    covariance = sum(w * (n - mean_n) * (t - mean_t) for w, (n, t) in zip(weights, pairs, strict=True))
    beta = covariance / spread
    candidates = [(mean_t - beta * mean_n, beta)]  # unconstrained
    # Constrained: the best of each edge of alpha, beta >= 0 (all latency; all bandwidth).
    through_origin = sum(w * n * t for w, (n, t) in zip(weights, pairs, strict=True)) / sum(
        w * n * n for w, (n, _) in zip(weights, pairs, strict=True)
    )
    candidates += [(mean_t, 0.0), (0.0, through_origin)]
    feasible = [(a, b) for a, b in candidates if a >= 0 and b >= 0]
    alpha, beta = min(feasible, key=lambda ab: objective(*ab))
    errors = [abs(alpha + n * beta - t) / t for n, t in pairs]
    return Fit(
        alpha_s=alpha,
        beta_s_per_byte=beta,
        rel_error_mean=math.fsum(errors) / len(errors),
        rel_error_max=max(errors),
    )

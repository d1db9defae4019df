"""The scalars an epoch reports beside its loss: throughput (samples/s, tokens/s, MFU), the share of
time spent waiting for data, communication by kind, and memory. `costs` reduces over ranks: every rank
calls it at the same point."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import distributed
from ..models.moe import routing_layers, routing_summary
from ..strategies.comm import KINDS

if TYPE_CHECKING:
    from ..memory import Peak
    from ..strategies import Wrapped
    from .settings import LoopSettings


def throughput(s: LoopSettings, samples_per_s: float) -> dict[str, float]:
    """Samples/s; for data with tokens, tokens/s too; and MFU where FLOPs and peak are known."""
    out = {
        "perf/samples_per_s": samples_per_s,
        "perf/samples_per_s_per_device": samples_per_s / s.devices,
    }
    if s.tokens_per_sample is None:
        return out
    tokens_per_s = samples_per_s * s.tokens_per_sample
    out |= {"perf/tokens_per_s": tokens_per_s, "perf/tokens_per_s_per_device": tokens_per_s / s.devices}
    if s.flops_per_token is not None and s.peak_flops:
        out["perf/mfu"] = s.flops_per_token * tokens_per_s / (s.peak_flops * s.devices)
    return out


def routing(base: torch.nn.Module, shape: tuple[int, int], device: torch.device) -> dict[str, float]:
    """The epoch's routing metrics of a mixture of experts (models/moe.py), over every rank: each rank
    fills the rows of the MoE layers it holds. A collective where the model routes: every rank calls it."""
    if not shape[0]:
        return {}
    rows = torch.zeros(shape, dtype=torch.float64, device=device)
    for layer in routing_layers(base):
        rows[layer.index] += layer.counts.take(device)
    return routing_summary(distributed.all_reduce_sum(rows).cpu())


def costs(
    model: Wrapped,
    device: torch.device,
    peak: Peak,
    resident: dict[str, float] | None,
    *,
    wait: float,
    elapsed: float,
    steps: int,
) -> dict[str, float]:
    """Data wait, communication and memory of the epoch: averaged (time) or maxed (memory) over ranks,
    in one small reduction each; `resident` is memory by category (already the max over ranks), the
    peak is this rank's since the run began (memory.Peak), maxed here."""
    comm = model.comm.take_with_share(elapsed) if model.comm is not None else None
    world = max(distributed.world_size(), 1)
    kinds = [float(comm[1][kind]) if comm else 0.0 for kind in KINDS]
    local = [wait, comm[0] if comm else 0.0, comm[2] if comm else 0.0, *kinds]
    sums = distributed.all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=device))
    wait_s, comm_s, share, *kind_bytes = (v / world for v in sums.tolist())
    out = {
        "perf/data_wait_frac": wait_s / elapsed if elapsed > 0 else 0.0,
        "mem/peak_mb": distributed.all_reduce_max(peak.mb()),
        **(resident or {}),
    }
    if comm is not None:
        # Between devices only: offload's copies stay inside a machine (comm/bytes_per_step/offload).
        network = sum(b for k, b in zip(KINDS, kind_bytes, strict=True) if k != "offload")
        out["comm/bytes_per_step"] = network / max(steps, 1)
        if comm_s > 0 or not sum(kind_bytes):  # bytes and no time: untimed (a pipeline's sends)
            out["comm/time_per_step_s"] = comm_s / max(steps, 1)
            out["comm/share"] = share
        # by kind (comm/bytes_per_step/sync_bn...), each only for strategies that send it
        by_kind = zip(KINDS, kind_bytes, strict=True)
        out |= {f"comm/bytes_per_step/{k}": b / max(steps, 1) for k, b in by_kind if b}
    if model.extra_metrics is not None:
        out |= model.extra_metrics()
    return out

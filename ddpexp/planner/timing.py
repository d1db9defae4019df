"""A step's time on a cluster, from what each rank computes (its ops on the device: the per-op model of
ddpexp.predict.device) and what the strategy sends (its collectives on the fabric's links):

  compute     per rank, one micro-batch's forward and backward x the micro-batches it runs per step x
              the slots its critical path takes per micro-batch (a pipeline's bubble); the slowest rank's
  exposed     the communication the step waits for. A collective that overlaps a pass is spread over
              its calls, each hiding behind the compute between two calls (FSDP prefetches unit i+1's
              all-gather while unit i computes; DDP's buckets and FSDP's reduce-scatters follow the
              backward): every call costs what it takes beyond its share of the pass, the first (or
              last) whole. One that overlaps nothing (tensor parallelism's, a pipeline's sends) is
              waited for whole.
  optimizer   the optimizer's step over the rank's shard: AdamW reads the parameter, its gradient and
              two moments and writes three of them, in fp32 (SGD with momentum: one moment), bound by
              memory bandwidth: the device's, or with offload the host's, shared by the node's ranks
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..predict.device import Device, Timing
from ..strategies.comm import Collective, Overlap
from .profiles import Cluster


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    exposed_s: float
    optimizer_s: float
    forward_s: float = 0.0  # of the compute
    backward_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s + self.optimizer_s


def exposed_s(timed: Sequence[tuple[Collective, float]], forward_s: float, backward_s: float) -> float:
    """The communication a step waits for, given its passes' compute (the module's docstring)."""
    waited = sum(t for c, t in timed if c.overlaps == Overlap.none)
    for phase, window in ((Overlap.forward, forward_s), (Overlap.backward, backward_s)):
        items = [(c, t) for c, t in timed if c.overlaps == phase and t > 0]
        if not items:
            continue
        calls = max(max(c.calls for c, _ in items), 1.0)
        per_call = sum(t for _, t in items) / calls
        gap = window / calls
        waited += per_call + (calls - 1) * max(0.0, per_call - gap)
    return waited


def optimizer_s(device: Device, optimized_bytes: float, states: int) -> float:
    """One optimizer step over parameters of `optimized_bytes` (fp32) with `states` moments each: it
    reads the parameter, its gradient and the moments, and writes the parameter and the moments."""
    moved = optimized_bytes * (2 + 2 * states + 1)
    return moved / (device.memory_bandwidth_GBps * 1e9 * device.memory_efficiency)


def host_optimizer_s(cluster: Cluster, optimized_bytes: float, states: int) -> float:
    """optimizer_s on the host (offload): the node's memory bandwidth, at the profile's share of it,
    split between its devices' ranks stepping at once."""
    assert cluster.host_memory_bandwidth_GBps is not None  # offload is planned only where it is given
    moved = optimized_bytes * (2 + 2 * states + 1)
    each = (
        cluster.host_memory_bandwidth_GBps * 1e9 * cluster.host_memory_efficiency / cluster.devices_per_node
    )
    return moved / each


def compute(timing: Timing, passes: float, slots: float) -> tuple[float, float]:
    """(forward, backward) seconds of a rank's step: `passes` micro-batches, each taking `slots`."""
    return timing.forward_s * passes * slots, timing.backward_s * passes * slots

"""The search: for every mesh (space.meshes) the settings practitioners tune, each estimated
(estimate.py), and the best of each mesh kept; or the one layout the user gave, as given. A sharded
mesh on which nothing fits is tried again with FSDP's states offloaded to the hosts' memory, where the
cluster profile says how much they have.

Per mesh (`_mesh`), the fastest layout is the largest micro-batch that fits with the lightest
activation checkpointing: a larger micro-batch holds more activations and runs its matmuls larger,
heavier checkpointing holds less and recomputes more. So each mode, lightest first, finds its largest
micro-batch that fits by bisection, and a heavier mode looks only among those larger than a lighter
one fitted. Those layouts are then timed with torch.compile and, for FSDP, without
resharding after the forward and with its parameters gathered in fp32 (autocast's way). The fake
runs behind the memory and the ops (ddpexp.predict.memory) are shared between layouts that compute
alike (`cache`)."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import UserError
from ..predict.interconnect import load_profile
from .estimate import Estimate, Job, chooses, estimate, launch_args, preflight, strategy_of
from .profiles import Cluster
from .space import AC_MODES, Candidate, Settings, accumulations, meshes

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


def to_stderr(line: str) -> None:
    """Progress, on a terminal only (a file or a pipe gets the result alone)."""
    if sys.stderr.isatty():
        print(line, file=sys.stderr, flush=True)


def given_layout(overrides: list[str], job: Job) -> Candidate | None:
    """The layout the command line gives (strategy=... and its settings), to be planned as given; None
    where it gives none (the search then chooses)."""
    if not chooses(overrides, "strategy"):
        return None
    from .. import strategies

    strategy = strategies.resolve(job.cfg.strategy)
    section = {"name": strategy.name, **strategy.changed_settings()}
    if job.cfg.strategy.get("module"):
        section["module"] = str(job.cfg.strategy.module)
    t = job.cfg.trainer
    settings = Settings(
        accumulate=int(t.accumulate), ac=str(t.activation_checkpointing), compile=bool(t.compile)
    )
    return Candidate(str(section["name"]), section, settings, given=True)


def search(
    job: Job,
    cluster: Cluster,
    fabric: Any,
    *,
    progress: Progress | None = None,
    everything: bool = False,
    cache: dict[Any, Any] | None = None,
) -> list[Estimate]:
    """The best estimate of each mesh (every estimate with `everything`), or the given layout's.
    `cache`: the fake runs of earlier calls for the same job, to reuse."""
    from ..predict.memory import fresh_fake_process_group

    fresh_fake_process_group()
    # Offload's copies cross each device's own link to its host.
    fabric = replace(fabric, host=load_profile(cluster.hardware.host_link).link)
    cache = {} if cache is None else cache
    given = given_layout(job.overrides, job)
    if given is not None:
        note = _refusal(given, job, cluster)
        result = estimate(given, job, cluster, fabric, cache) if note is None else Estimate(given, note=note)
        return [result]
    out: list[Estimate] = []
    all_meshes = meshes(
        cluster, job.stages, loss_parallel=job.loss_parallel, seq_len=job.seq_len, experts=job.experts
    )
    for i, mesh in enumerate(all_meshes, 1):
        if progress is not None:
            progress(f"ddpexp plan: mesh {i} of {len(all_meshes)}, {mesh.label}")
        note = _refusal(mesh, job, cluster)
        if note is not None:
            out.append(Estimate(mesh, note=note, devices=cluster.devices))
            continue
        tried = _mesh(mesh, job, cluster, fabric, cache)
        if _offloadable(mesh, cluster) and not any(r.fits for r in tried):
            tried += _mesh(mesh, job, cluster, fabric, cache, offload=True)
        out += tried if everything else [_best(tried)]
    return out


def _refusal(candidate: Candidate, job: Job, cluster: Cluster) -> str | None:
    """What pre-flight would refuse of the candidate's command line on the cluster (None: nothing)."""
    try:
        preflight(launch_args(job.overrides, candidate.overrides, cluster), cluster)
        strategy_of(candidate)
    except UserError as exc:
        return str(exc)
    return None


def _offloadable(mesh: Candidate, cluster: Cluster) -> bool:
    """Whether offload is worth a try on the mesh: FSDP shards there (without pipeline stages, whose
    parameters stay gathered) and the profile says what the hosts hold."""
    return mesh.sharded and not _staged(mesh) and cluster.host_memory_gib is not None


def _mesh(
    mesh: Candidate,
    job: Job,
    cluster: Cluster,
    fabric: Any,
    cache: dict[Any, Any],
    *,
    offload: bool = False,
) -> list[Estimate]:
    """The settings worth trying on one mesh (the module's docstring): for each checkpointing mode,
    lightest first, the largest micro-batch that fits (the smallest tried first: if it does not fit,
    none does; then halving the gap up), a heavier mode only for micro-batches larger than a lighter
    one fitted (it is slower at the same size). A mesh whose model states alone overflow the devices
    is given up at its first try. Each mode's largest fitting micro-batch is then timed with
    torch.compile, without resharding and, the fastest, with FSDP's gather in fp32. `offload`: every
    layout with FSDP's states in host memory (tried where none fits on the devices)."""
    strategy = strategy_of(mesh)
    shards = len(set(strategy.data_layout(world_size=cluster.devices)))
    local = job.global_batch // shards
    chunks = int(mesh.section.get("microbatches", 1)) if _staged(mesh) else 1
    accs = accumulations(local, chunks)  # the largest micro-batch first
    sharded = mesh.sharded and not _staged(mesh)
    reshard: bool | None = True if sharded else None
    out: list[Estimate] = []
    tried: dict[tuple[str, int], Estimate] = {}

    def probe(ac: str, i: int) -> Estimate:
        if (ac, i) not in tried:
            settings = Settings(accs[i], ac, False, None, reshard, offload)
            tried[ac, i] = estimate(mesh.with_settings(settings), job, cluster, fabric, cache)
            out.append(tried[ac, i])
        return tried[ac, i]

    best: list[Estimate] = []  # each mode's largest fitting micro-batch
    limit = len(accs)  # micro-batches from index `limit` on are no larger than one a lighter mode fitted
    for ac in AC_MODES:
        if limit == 0:
            break
        smallest = probe(ac, limit - 1)
        if smallest.note is not None or _states_overflow(smallest, cluster):
            return out
        if not smallest.fits:
            continue
        low, high = 0, limit - 1  # the answer lies in [low, high]: accs[high] fits
        while low < high:
            middle = (low + high) // 2
            if probe(ac, middle).fits:
                high = middle
            else:
                low = middle + 1
        best.append(probe(ac, high))
        limit = high
    variants: list[Settings] = []
    for found in best:
        s = found.candidate.settings
        variants.append(replace(s, compile=True))
        if sharded:
            variants += [replace(s, reshard=False), replace(s, reshard=False, compile=True)]
    if best and sharded and job.precision == "bf16" and mesh.section["name"] == "fsdp":
        fastest = min(best, key=lambda r: r.step_s).candidate.settings
        variants += [replace(fastest, gather="fp32"), replace(fastest, gather="fp32", compile=True)]
    out += [estimate(mesh.with_settings(v), job, cluster, fabric, cache) for v in variants]
    return out


def _states_overflow(result: Estimate, cluster: Cluster) -> bool:
    """Whether what no micro-batch or checkpointing changes (the model states, the strategy's copies
    and buffers) already exceeds the devices' memory."""
    fixed = sum(v for k, v in result.parts.items() if k not in ("activations", "the backward's temporaries"))
    return fixed > cluster.usable_bytes


def _staged(mesh: Candidate) -> bool:
    s = mesh.section
    return s["name"] == "pipeline" or (s["name"] == "nd" and s.get("pp", 1) > 1)


def _best(tried: list[Estimate]) -> Estimate:
    """The fastest that fits, else the leanest."""
    runnable = [r for r in tried if r.note is None]
    if not runnable:
        return tried[0]
    fitting = [r for r in runnable if r.fits]
    if fitting:
        return min(fitting, key=lambda r: r.step_s)
    return min(runnable, key=lambda r: (r.peak_bytes, r.step_s if math.isfinite(r.step_s) else math.inf))

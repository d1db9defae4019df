"""A prediction as text: the run, the table of predicted sizes, and the assumptions behind it."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .model import Host, Point, Predictor


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.2f}"


def render(predictor: Predictor, points: Sequence[Point]) -> str:
    run, facts = predictor.run, predictor.run.facts
    label = predictor.strategy.settings.name
    changed = predictor.strategy.changed_settings()
    if changed:
        label += " " + " ".join(f"{k}={v}" for k, v in changed.items())
    gb = int(facts.get("global_batch_size") or 1)
    lines = [
        f"run: {run.path or '(facts)'}: {facts.get('strategy')} on {facts.get('devices')} "
        f"{facts.get('device_type')} "
        f"device(s), {facts.get('nnodes', 1)} node(s), global batch {gb}: "
        f"{run.mean('perf/step_time_s') * 1e3:.3g} ms/step, {run.mean('perf/samples_per_s'):,.0f} samples/s",
        f"predicting: {label} on {predictor.fabric.name}; one device computes a global batch in "
        f"{predictor.single_s * 1e3:.3g} ms ({gb / predictor.single_s:,.0f} samples/s)",
    ]
    if facts.get("device_type") == "cpu":
        lines.append(
            f"compute: this run's CPU host ({facts.get('host_cpus') or '?'} cores a node), whatever devices "
            f"the links connect: the step times are CPU processes' (ddpexp plan --cluster prices GPUs)"
        )
    lines.append("")
    header: tuple[str, ...] = (
        "W",
        "N",
        "compute ms",
        "comm ms",
        "exposed ms",
        "step ms",
        "samples/s",
        "efficiency",
        "bytes/step",
    )
    calibrated = predictor.overhead_s != 0  # its column shows: step = compute + exposed + overhead
    if calibrated:
        header = (*header[:5], "overhead ms", *header[5:])
    rows = []
    for p in points:
        if p.note is not None:
            rows.append((str(p.devices), str(p.nodes), *["-"] * (len(header) - 2)))
            continue
        overhead = (_ms(p.overhead_s),) if calibrated else ()
        rows.append(
            (
                str(p.devices),
                str(p.nodes),
                _ms(p.compute_s),
                _ms(p.comm_s),
                _ms(p.exposed_s),
                *overhead,
                _ms(p.step_s),
                f"{p.samples_per_s:,.0f}",
                f"{p.efficiency:.1%}",
                f"{p.counted_bytes:,.0f}",
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    lines += ["", "assumptions:"]
    lines += [f"  - {n}" for n in [*predictor.notes, *predictor.fabric.notes]]
    if predictor.shape.note:
        lines.append(f"  - {predictor.shape.note}")
    lines.append(_host_note(predictor))
    lines.append(
        "  - overlap: communication that may hide behind the forward (1/3 of compute) or backward (2/3) pass "
        "hides up to that time x efficiency, less its last call; efficiency "
        + (
            f"{predictor.overlap:g} (given)"
            if predictor.overlap is not None
            else _overlap_rule(predictor.host)
        )
    )
    lines.append("  - bytes/step: what comm/bytes_per_step would show (metered collectives only)")
    for p in points:
        if p.note is not None:
            lines.append(f"  - W={p.devices} N={p.nodes}: not predicted: {p.note}")
    widest = max((p for p in points if p.note is None), key=lambda p: (p.devices, p.nodes), default=None)
    if widest is not None:
        lines.append(f"  - what the step sends at W={widest.devices}, N={widest.nodes}:")
        for c, t in widest.timed:
            where = "inter-node" if c.inter_node else "intra-node"
            lines.append(
                f"      {c.what}: {c.op} over {c.ranks} ranks, {c.bytes:,.0f} bytes in {c.calls:g} call(s), "
                f"{where}, hides behind {c.overlaps.value}: {t * 1e3:,.3g} ms"
            )
        if not widest.timed:
            lines.append("      nothing")
    return "\n".join(lines)


def _host_note(predictor: Predictor) -> str:
    host = predictor.host
    if host.device_type != "cpu":
        return "  - compute: the run's, divided as the strategy divides it (a device per process: no sharing)"
    threads = f"trainer.threads={host.threads}" if host.threads else "cores // processes (ddpexp's default)"
    return (
        f"  - compute on a CPU host of {host.cores} cores per node: a process gets "
        "min(threads, cores/processes) "
        f"cores, threads = {threads}; compute assumed to scale with cores (intra-op threads do not scale "
        f"perfectly: measure the baseline with the threads the ranks will get)"
    )


def _overlap_rule(host: Host) -> str:
    if host.device_type != "cpu":
        return "1 (collectives run on the accelerator's own engines)"
    return "1 where the ranks leave a core free, else 0 (gloo's threads compete with compute for cores)"

"""Warnings about the host a run ran on, read from its facts: oversubscribed cores, other load at
the start or during the run (the 1-minute load average), jobs that overlapped on one machine, and runs
that the scheduler did not treat alike."""

from __future__ import annotations

import math
from typing import Any

from ..runrecord import finite_number
from .runs import Run

LOAD_TAU_S = 60.0  # time constant of Linux's 1-minute load average
LOAD_CHANGE_SHARE = 0.5  # of host_cpus: how far the end-of-job load may stray from the expected one
BUSY_MARGIN = 0.5  # runnable tasks of others tolerated at the start beyond the cores the run leaves free
OVERLAP_TOLERANCE_S = 1.0


def run_warnings(runs: list[Run], everyone: list[Run]) -> list[str]:
    """Every host warning of `runs` (a row's), against all the runs of the report."""
    out = []
    for run in runs:
        out += oversubscription(run)
        out += load_warnings(run, previous_on_host(run, everyone))
        out += overlaps(run, everyone)
        out += unequal_scheduling(run, everyone)
    return out


def busy_threads(facts: dict[str, Any]) -> int:
    """Runnable threads the run keeps busy: on CPU every intra-op thread of every process, on GPUs
    about one per process."""
    procs = int(facts.get("nprocs_per_node") or 1)
    threads = facts.get("threads")
    return procs * int(threads) if facts.get("device_type") == "cpu" and threads else procs


def oversubscription(run: Run) -> list[str]:
    f = run.facts
    procs, threads, cpus = f.get("nprocs_per_node"), f.get("threads"), f.get("host_cpus")
    if f.get("device_type") != "cpu" or not (procs and threads and cpus) or procs * threads <= cpus:
        return []
    return [
        f"{run.name}: oversubscribed: {procs} processes x {threads} threads = {procs * threads} busy "
        f"threads on {cpus} cores: they take turns, and the numbers describe that"
    ]


def same_machine(a: Run, b: Run) -> bool:
    """Whether two runs ran on one machine: the same facts.machine (the kernel's boot id, which
    containers on one machine share under different host names), else, for runs recorded before it
    was, the same facts.host."""
    if a.facts.get("machine") and b.facts.get("machine"):
        return bool(a.facts["machine"] == b.facts["machine"])
    return a.facts.get("host") is not None and a.facts.get("host") == b.facts.get("host")


def previous_on_host(run: Run, everyone: list[Run]) -> Run | None:
    """The job on the same machine that ended last before this one started."""
    start = run.job_start
    if start is None:
        return None
    before = [
        other
        for other in everyone
        if other is not run
        and same_machine(run, other)
        and (end := other.job_end) is not None
        and end <= start + OVERLAP_TOLERANCE_S
    ]
    return max(before, key=lambda other: other.job_end or 0.0, default=None)


def load_warnings(run: Run, previous: Run | None) -> list[str]:
    """Other work on the host at the start, or work that started or stopped during the run, read off
    the 1-minute load average with the run's own share (and the previous job's fading share) set aside."""
    f = run.facts
    start, end, cpus = (
        finite_number(f.get("load_avg_start")),
        finite_number(f.get("load_avg_end")),
        f.get("host_cpus"),
    )
    if start is None or not cpus or run.job_start is None:
        return []
    busy = busy_threads(f)
    left = 0.0  # the previous job's load, fading
    if previous is not None and previous.job_end is not None:
        previous_end = finite_number(previous.facts.get("load_avg_end")) or 0.0
        left = previous_end * math.exp(-max(run.job_start - previous.job_end, 0.0) / LOAD_TAU_S)
    others = max(start - left, 0.0)
    out = []
    if others > max(cpus - busy, 0) + BUSY_MARGIN:
        out.append(
            f"{run.name}: host busy at the start: 1-min load {start:.1f} ({others:.1f} of it not left by "
            f"earlier jobs here) while this run keeps {busy} threads busy on {cpus} cores: others were "
            "running"
        )
    duration = run.job_time()
    if end is not None and duration is not None:
        fade = math.exp(-duration / LOAD_TAU_S)
        expected = others + left * fade + busy * (1 - fade)
        if abs(end - expected) > LOAD_CHANGE_SHARE * cpus:
            out.append(
                f"{run.name}: load changed during the run: 1-min load {start:.1f} at the start, {end:.1f} at "
                f"the end, {expected:.1f} expected from this run alone on {cpus} cores: other work "
                f"{'started' if end > expected else 'stopped'} meanwhile"
            )
    return out


def overlaps(run: Run, everyone: list[Run]) -> list[str]:
    host, start, end = run.facts.get("host"), run.job_start, run.job_end
    if start is None or end is None:
        return []
    shared = []
    for other in everyone:
        if other is run or not same_machine(run, other) or other.job_start is None or other.job_end is None:
            continue
        overlap = min(end, other.job_end) - max(start, other.job_start)
        if overlap > OVERLAP_TOLERANCE_S:
            shared.append((other.name, overlap, other.facts.get("host")))
    if not shared:
        return []
    names = ", ".join(name for name, _, _ in shared[:2]) + (
        f" and {len(shared) - 2} more" if len(shared) > 2 else ""
    )
    longest = max(overlap for _, overlap, _ in shared)
    hosts = list(dict.fromkeys(str(h) for h in [host, *(h for _, _, h in shared)] if h))
    if len(hosts) == 1:
        where = f"host {hosts[0]}"
    else:  # containers of one machine under their own names (or runs that recorded none)
        where = "one machine" + (f" (host names {', '.join(hosts)})" if hosts else "")
    return [
        f"{run.name}: ran at the same time as {names} on {where} (up to {longest:.0f} s of its "
        f"{end - start:.0f} s): each slowed the other, so neither measures its strategy alone"
    ]


def unequal_scheduling(run: Run, everyone: list[Run]) -> list[str]:
    """What makes a busy host favour one run over another on the same machine: more of the autogroup
    scheduler's CPU shares (one per session: torchrun starts each worker in its own), or OpenMP threads
    that spin while they wait where the others' sleep. Runs that recorded neither are not judged."""
    f, out = run.facts, []
    others = [o for o in everyone if o is not run and same_machine(run, o)]
    sessions = int(f.get("sessions") or 1)
    fewer = [o for o in others if "sessions" in o.facts and int(o.facts["sessions"] or 1) < sessions]
    if f.get("autogroup") and "sessions" in f and fewer:
        out.append(
            f"{run.name}: its {sessions} processes had a session each (torchrun starts workers so): on a "
            "busy host Linux's autogroup scheduler gives each session a share of the CPU, so it had "
            f"{sessions} shares against fewer for {fewer[0].name}: launch the runs alike or compare on an "
            "idle host"
        )
    sleeping = [o for o in others if o.facts.get("wait_policy") not in (None, "default")]
    if f.get("wait_policy") == "default" and int(f.get("threads") or 1) > 1 and sleeping:
        out.append(
            f"{run.name}: its OpenMP threads spin while they wait (torch was loaded before ddpexp could set "
            f"OMP_WAIT_POLICY=PASSIVE, as in a notebook), those of {sleeping[0].name} sleep: on a busy "
            "host it slows far more; set OMP_WAIT_POLICY=PASSIVE before torch is imported"
        )
    return out

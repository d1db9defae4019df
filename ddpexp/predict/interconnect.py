"""What communication costs: a link's latency and seconds per byte (`Link`), the ring formulas that turn
a `Collective` into time on it, and the links a prediction uses (`Fabric`), from interconnect profiles
(conf/interconnect/*.yaml) and/or a commbench.json's fits. Bus factors are ddpexp.commbench's."""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import composition
from ..commbench import bus_factor
from ..errors import UserError
from ..strategies.comm import COLLECTIVE_OPS, PASS_SHARE, Collective

PROFILE_SCOPES = ("intra", "inter", "both")
HOST_LINK = "pcie5"  # a device's link to its host where nothing says which (conf/interconnect)

# ------------------------------------------------------------------------------------------ formulas


def hops(op: str, ranks: int) -> int:
    """Latency terms one call of `op` pays on a ring of `ranks` ranks: a ring all-reduce is a
    reduce-scatter then an all-gather, W-1 steps each; a pipelined (ring) broadcast reaches the last
    rank after W-1 hops; a point-to-point message is one hop."""
    if op == "sendrecv":
        return 1
    if ranks < 2:
        return 0
    return 2 * (ranks - 1) if op == "all_reduce" else ranks - 1


@dataclass(frozen=True)
class Link:
    """One link: latency per hop (seconds) and seconds per byte."""

    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def of(cls, *, bandwidth_GBps: float, latency_us: float, efficiency: float = 1.0) -> Link:
        return cls(latency_us * 1e-6, 1.0 / (bandwidth_GBps * 1e9 * efficiency))

    def describe(self) -> str:
        bandwidth = f"{1e-9 / self.beta_s_per_byte:,.3g}" if self.beta_s_per_byte else "unbounded"
        return f"{bandwidth} GB/s, {self.alpha_s * 1e6:,.3g} us"


def collective_time(c: Collective, link: Link) -> float:
    """calls x hops(W) x alpha + bus_factor(W) x bytes x beta: a ring over `c.ranks` ranks whose every
    link is as slow as `link` (the slowest one bounds a ring)."""
    return (
        c.calls * hops(c.op, c.ranks) * link.alpha_s
        + bus_factor(c.op, c.ranks) * c.bytes * link.beta_s_per_byte
    )


@dataclass(frozen=True)
class Stretch:
    """What W processes computing side by side on one host do to each one's compute (a commbench after
    compute measured it): the time of the same work, all W at once over one alone, each process with
    `threads` threads."""

    factor: float
    threads: int


@dataclass(frozen=True)
class AfterCompute:
    """A commbench after compute at one process count: how long its burst took with every rank
    computing, what each op cost after it, and what the same calls cost back to back."""

    burst_s: float
    after: dict[str, Link]
    back_to_back: dict[str, Link]
    stretch: Stretch


@dataclass(frozen=True)
class Fabric:
    """The links a prediction uses: per operation, within a node and between nodes (None: not given).
    Commbench results measured on one node at several process counts are kept per count (`per_node`):
    on a host whose processes outnumber or share its cores, W processes' collectives do not follow
    the ring formulas from another W, so a size measured is read as measured. Results after compute
    (`after`, one or more burst lengths per count) also say what a call waits for after compute."""

    name: str
    intra: dict[str, Link]
    inter: dict[str, Link] | None
    notes: tuple[str, ...] = ()
    per_node: dict[int, dict[str, Link]] = field(default_factory=dict)
    stretch: dict[int, Stretch] = field(default_factory=dict)
    after: dict[int, tuple[AfterCompute, ...]] = field(default_factory=dict)  # by burst length
    waits: tuple[AfterCompute, ...] = ()  # this count's
    # Whether each device has a network adapter of its own (rail-optimised GPU nodes): a ring crossing
    # nodes then moves as many adapters' bytes at once as the group has ranks on a node.
    rails: bool = False
    # Each device's link to its host's memory (offload's copies, Collective.host); None: PCIe 5.0 x16.
    host: Link | None = None

    def at(self, processes: int) -> Fabric:
        """This fabric for `processes` processes per node: the intra-node links measured at that count,
        where one was."""
        links = self.per_node.get(processes)
        if links is None:
            return self
        return replace(self, intra=links, waits=self.after.get(processes, ()))

    def timed(self, collectives: Sequence[Collective], compute_s: float) -> list[tuple[Collective, float]]:
        """Each collective's time in a step whose compute per rank is `compute_s`. Where commbench after
        compute measured this node, a call costs what it costs back to back plus the wait the benchmark
        measured on top after a burst as long as the compute before the call (the ranks arrive apart,
        the host's threads wake; between two burst lengths measured, interpolated in the logarithm of
        the length; outside them, the nearest). Every call of a collective that interleaves with a
        pass (a bucket, a unit) follows its share of that pass; the calls of one that runs between
        compute (zero's broadcasts) wait once, after the step's compute, then follow one another."""
        if not self.waits:
            return [(c, self.time_s(c)) for c in collectives]
        quick = replace(self, intra=self.waits[0].back_to_back, waits=())
        out = []
        for c in collectives:
            if c.inter_node or c.host:
                out.append((c, self.time_s(c)))
                continue
            fast = quick.time_s(c)
            calls = max(c.calls, 1)
            share = PASS_SHARE.get(c.overlaps)
            before, waits = (compute_s * share / calls, calls) if share else (compute_s, min(c.calls, 1))
            out.append((c, fast + waits * self._wait(c, before)))
        return out

    def _wait(self, c: Collective, before_s: float) -> float:
        """What one call of `c` waits on top of its back-to-back time after `before_s` of compute."""
        points = []
        for m in self.waits:
            after = collective_time(c, m.after.get(c.op) or m.after["all_reduce"])
            quick = collective_time(c, m.back_to_back.get(c.op) or m.back_to_back["all_reduce"])
            points.append((m.burst_s, max(after - quick, 0.0) / max(c.calls, 1)))
        if before_s <= points[0][0]:
            return points[0][1]
        if before_s >= points[-1][0]:
            return points[-1][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if x0 <= before_s <= x1:
                return y0 + (y1 - y0) * math.log(before_s / x0) / math.log(x1 / x0)
        return points[-1][1]

    def time_s(self, c: Collective) -> float:
        if c.host:
            return collective_time(c, self.host or _default_host_link())
        links = self.inter if c.inter_node else self.intra
        if links is None:
            raise UserError(
                f"{self.name} describes no link between nodes",
                setting="--interconnect",
                fix="add an inter-node profile, e.g. --interconnect nvlink4,ib400 (or a commbench "
                "measured over several nodes)",
            )
        link = links.get(c.op) or links["all_reduce"]
        if c.inter_node and self.rails and c.per_node > 1:
            # k rings at once, each across its own adapter, none faster than the links inside a node.
            inside = self.intra.get(c.op) or self.intra["all_reduce"]
            beta = max(link.beta_s_per_byte / c.per_node, inside.beta_s_per_byte)
            link = Link(link.alpha_s, beta)
        return collective_time(c, link)


# ------------------------------------------------------------------------------------------ fabrics


@functools.cache
def _default_host_link() -> Link:
    return load_profile(HOST_LINK).link


def profile_names() -> list[str]:
    return composition.profile_names("interconnect")


@dataclass(frozen=True)
class Profile:
    name: str
    scope: str  # intra | inter | both
    link: Link
    about: str  # the file's first comment line
    efficiency: float
    per_device: bool = False  # an adapter per device (between nodes): see Fabric.rails


def load_profile(name: str) -> Profile:
    """conf/interconnect/NAME.yaml, or a YAML file of yours given by its path."""
    import yaml

    path = composition.profile_file("interconnect", name, setting="--interconnect", what="interconnect")
    text = path.read_text()
    spec = yaml.safe_load(text) or {}
    try:
        scope = str(spec.get("scope", "both"))
        efficiency = float(spec.get("efficiency", 1.0))
        link = Link.of(
            bandwidth_GBps=float(spec["bandwidth_GBps"]),
            latency_us=float(spec["latency_us"]),
            efficiency=efficiency,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"{path} lacks a number for {exc}",
            setting="--interconnect",
            fix="give bandwidth_GBps, latency_us (efficiency, scope) as conf/interconnect/nvlink4.yaml does",
        ) from exc
    if scope not in PROFILE_SCOPES or not 0 < efficiency <= 1:
        raise UserError(
            f"{path}: scope {scope!r}, efficiency {efficiency}",
            setting="--interconnect",
            fix=f"scope is one of {', '.join(PROFILE_SCOPES)}; efficiency in (0, 1]",
        )
    first = text.splitlines()[0] if text else ""
    per_device = bool(spec.get("per_device", False))
    return Profile(path.stem, scope, link, first.lstrip("# ").strip(), efficiency, per_device)


def read_commbench(path: Path) -> tuple[dict[str, Link], dict[str, Any], AfterCompute | None]:
    """A commbench.json's per-operation links (`commbench_links`), its facts, and, for a result after
    compute, the burst, the back-to-back links and the compute stretch (None: calls back to back)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc) from exc
    links, facts = commbench_links(data, path)
    compute = data.get("compute")
    if not compute:
        return links, facts, None
    try:
        stretch = Stretch(float(compute["stretch"]), int(facts.get("threads") or 1))
        burst_s = float(compute["together_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _unreadable(path, exc) from exc
    quick = commbench_links(data, path, "fits_back_to_back")[0]
    return links, facts, AfterCompute(burst_s, links, quick, stretch)


def _unreadable(path: Path, exc: Exception) -> UserError:
    return UserError(
        f"cannot read {path} as a commbench result ({type(exc).__name__}: {exc})",
        setting="--commbench",
        fix="give the commbench.json that python -m ddpexp.commbench wrote (facts, results, fits)",
    )


def commbench_links(
    data: dict[str, Any], path: Path, key: str = "fits"
) -> tuple[dict[str, Link], dict[str, Any]]:
    """Per-operation links from a commbench.json's `data` (read from `path`): its fits (time = alpha +
    bytes x beta, measured on its world size Wb) divided back into one link's: alpha / hops(op, Wb),
    beta / bus_factor(op, Wb), so that the same ring formulas carry them to any W."""
    try:
        facts, fits = data["facts"], data[key]
        world = int(facts["world_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _unreadable(path, exc) from exc
    if world < 2:
        raise UserError(
            f"{path} was measured on {world} rank: no link to fit",
            setting="--commbench",
            fix="run the benchmark on 2 or more ranks",
        )
    links = {}
    for op, fit in fits.items():
        if op in COLLECTIVE_OPS and hops(op, world) and bus_factor(op, world):
            links[op] = Link(
                float(fit["alpha_s"]) / hops(op, world), float(fit["beta_s_per_byte"]) / bus_factor(op, world)
            )
    if "all_reduce" not in links:
        raise UserError(
            f"{path} has no all_reduce fit",
            setting="--commbench",
            fix="run the benchmark with all_reduce among its operations",
        )
    return links, facts


def fabric(
    interconnect: str | None = None, commbench: Path | str | Sequence[Path | str] | None = None
) -> Fabric:
    """The links from profiles (`nvlink4`, or `nvlink4,ib400`: the first that covers each scope) and/or
    commbench.json files (a result's links are intra-node if it ran on one node, else inter-node;
    profiles fill the other scope). Several one-node results, each at its own process count, are used
    each at its count; the first is used at any other."""
    benches = [] if commbench is None else [commbench] if isinstance(commbench, str | Path) else commbench
    if not interconnect and not benches:
        raise UserError(
            "no interconnect given",
            setting="--interconnect",
            fix=f"add --interconnect NAME ({', '.join(profile_names())}) or --commbench commbench.json",
        )
    intra: dict[str, Link] | None = None
    inter: dict[str, Link] | None = None
    notes, names = [], []
    per_node: dict[int, dict[str, Link]] = {}
    after: dict[int, list[AfterCompute]] = {}
    for bench in map(Path, benches):
        links, facts, measured = read_commbench(bench)
        nodes = int(facts.get("nnodes", 1) or 1)
        where = "inter" if nodes > 1 else "intra"
        after_ms = facts.get("after_compute_ms")
        timing = f"each call after {after_ms:g} ms of compute" if after_ms else "calls back to back"
        notes.append(
            f"{where}-node links from {bench} ({facts.get('backend')}, {facts.get('world_size')} ranks "
            f"on {nodes} node(s), host {facts.get('host')}, {timing}): per op, the fit divided by its hops "
            f"and bus factor at that size; all_reduce: {links['all_reduce'].describe()} per link"
        )
        if nodes == 1:
            processes = int(facts["world_size"])
            if processes in per_node and (measured is None or processes not in after):
                raise UserError(
                    f"two commbench results at {processes} processes on one node",
                    setting="--commbench",
                    fix="give one result per process count (or several after compute, each after "
                    "another commbench.after_compute_ms)",
                )
            per_node.setdefault(processes, links)
            intra = intra or links
            if measured is not None:
                if any(m.burst_s == measured.burst_s for m in after.get(processes, [])):
                    raise UserError(
                        f"two commbench results after the same compute at {processes} processes",
                        setting="--commbench",
                        fix="give each process count's results after different commbench.after_compute_ms",
                    )
                after.setdefault(processes, []).append(measured)
        elif inter is None:
            inter = links
        names.append(f"commbench {bench.name}")
    only_inter: list[dict[str, Link]] = []
    rails = False
    for name in [n.strip() for n in (interconnect or "").split(",") if n.strip()]:
        profile = load_profile(name)
        same = dict.fromkeys(COLLECTIVE_OPS, profile.link)
        used: list[str] = []
        if intra is None and profile.scope in ("intra", "both"):
            intra, used = same, [*used, "intra"]
        if inter is None and profile.scope in ("inter", "both"):
            inter, used = same, [*used, "inter"]
            rails = profile.per_device
        if profile.scope == "inter":
            only_inter.append(same)
        notes.append(
            f"{'/'.join(used) or 'unused'}-node link: {profile.name} ({profile.about.rstrip('.')}): "
            f"{profile.link.describe()} per link (peak x efficiency {profile.efficiency:g})"
        )
        names.append(profile.name)
    if intra is None:
        if not only_inter and inter is None:
            raise UserError("no intra-node link", setting="--interconnect", fix="name an intra-node profile")
        intra = only_inter[0] if only_inter else inter
        notes.append("no intra-node profile given: links inside a node taken as the network's")
    assert intra is not None
    by_burst = {w: tuple(sorted(ms, key=lambda m: m.burst_s)) for w, ms in after.items()}
    stretch = {w: ms[-1].stretch for w, ms in by_burst.items()}  # the longest burst's: least disturbed
    fabric = Fabric("+".join(names), intra, inter, tuple(notes), per_node, stretch, by_burst, rails=rails)
    return fabric.at(next(iter(per_node))) if per_node else fabric

"""Cluster profiles (conf/cluster/*.yaml): the devices a plan is for, their links and their price."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..predict.device import Device, load_device

GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    name: str
    devices_per_node: int
    nodes: int
    hardware: Device  # one device's profile (conf/devices)
    intra: str  # conf/interconnect profiles
    inter: str | None
    reserve_gib: float
    price_per_device_hour: float
    accelerator: str | None = None  # SkyPilot's name for the device (--emit skypilot)
    # A share of the peak to time every step at, instead of the per-op model: an override, named as such
    # in the output (a CPU host's profile, which has no per-op model, gives one).
    achieved_mfu: float | None = None
    # Each node's host memory and its bandwidth, where the profile gives them: what offload keeps there
    # and what its optimizer step reads (None: offload is not planned on it).
    host_memory_gib: float | None = None
    host_memory_bandwidth_GBps: float | None = None
    host_memory_efficiency: float = 0.5

    @property
    def device(self) -> str:
        return self.hardware.name

    @property
    def device_type(self) -> str:
        """cuda, or cpu: a device is then a process of one thread on a core of its own (gloo)."""
        return self.hardware.type

    @property
    def memory_gib(self) -> float:
        return self.hardware.memory_gib

    def peak_flops(self, precision: str) -> float:
        """The dense peak its matmuls run at under trainer.precision."""
        return self.hardware.peak_flops(precision)

    @property
    def launch(self) -> list[str]:
        """The overrides a run on it starts with."""
        return (
            ["device=cuda", "backend=nccl"] if self.device_type == "cuda" else ["device=cpu", "backend=gloo"]
        )

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserve_gib) * GIB

    @property
    def interconnect(self) -> str:
        return self.intra if self.inter is None else f"{self.intra},{self.inter}"


def cluster_names() -> list[str]:
    from ..composition import profile_names

    return profile_names("cluster")


def load_cluster(name: str, *, nodes: int | None = None, price: float | None = None) -> Cluster:
    """The profile `name` (a conf/cluster option, or a YAML file), with `nodes` and `price` (per device
    and hour) replacing its own where given; a missing or wrong field is one line naming it."""
    import yaml

    from ..composition import profile_file

    path = profile_file("cluster", name, setting="--cluster", what="cluster profile")
    try:
        raw: Any = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(
            f"{path} is not a readable YAML profile: {' '.join(str(exc).split())[:160]}",
            setting="--cluster",
            fix="save it as UTF-8 YAML, as conf/cluster/8xh100_sxm.yaml is",
        ) from exc
    fields = _Fields(raw if isinstance(raw, dict) else {}, path)
    mfu = raw.get("achieved_mfu") if isinstance(raw, dict) else None
    cluster = Cluster(
        name=path.stem,
        devices_per_node=fields.count("devices_per_node"),
        nodes=fields.count("nodes") if nodes is None else nodes,
        hardware=load_device(fields.value("device"), where=path.name),
        intra=str(fields.value("intra")),
        inter=None if raw.get("inter") is None else str(raw["inter"]),
        achieved_mfu=None if mfu is None else fields.positive("achieved_mfu"),
        reserve_gib=fields.reserve(),
        price_per_device_hour=fields.positive("price_per_device_hour") if price is None else price,
        accelerator=None if raw.get("accelerator") is None else str(raw["accelerator"]),
        **_host(fields, raw),
    )
    if cluster.reserve_gib >= cluster.memory_gib:
        raise fields._missing(
            "reserve_gib",
            f"reserves {cluster.reserve_gib:g} GiB of a {cluster.memory_gib:g} GiB device: nothing is left "
            "to plan with",
        )
    if cluster.achieved_mfu is None and not cluster.hardware.per_op:
        raise UserError(
            f"{cluster.device} has no per-op figures (matmul_efficiency, memory_bandwidth_GBps) and the "
            "profile gives no achieved_mfu",
            setting=f"{path.name}: device",
            fix="name a conf/devices profile (h100_sxm, a100_sxm_80gb...), or set achieved_mfu: 0..1",
        )
    if cluster.achieved_mfu is not None and cluster.achieved_mfu > 1:
        raise UserError(
            f"achieved_mfu is a share of the peak, got {cluster.achieved_mfu}",
            setting=f"{path.name}: achieved_mfu",
            fix="give 0..1 (0.3-0.5 is usual for large transformers)",
        )
    if not cluster.price_per_device_hour > 0 or not math.isfinite(cluster.price_per_device_hour):
        raise UserError(
            f"the price per device and hour must be positive, got {cluster.price_per_device_hour}",
            setting="--price" if price is not None else f"{path.name}: price_per_device_hour",
            fix="give what one device costs you per hour, e.g. --price 2.49",
        )
    if cluster.nodes < 1:
        raise UserError(f"{cluster.nodes} nodes", setting="--nodes", fix="give 1 or more")
    if cluster.nodes > 1 and cluster.inter is None:
        raise UserError(
            f"{path.name} names no link between nodes, and the plan is for {cluster.nodes}",
            setting=f"{path.name}: inter",
            fix="set inter: to a conf/interconnect profile (ib400, eth25...), or plan for --nodes 1",
        )
    return cluster


def _host(fields: _Fields, raw: Any) -> dict[str, float]:
    """The profile's `host:` section (memory_gib, memory_bandwidth_GBps, memory_efficiency), if any."""
    if not isinstance(raw, dict) or raw.get("host") is None:
        return {}
    host = _Fields(fields.mapping("host"), fields.path, prefix="host.")
    out = {
        "host_memory_gib": host.positive("memory_gib"),
        "host_memory_bandwidth_GBps": host.positive("memory_bandwidth_GBps"),
    }
    if host.raw.get("memory_efficiency") is not None:
        share = host.positive("memory_efficiency")
        if share > 1:
            raise host._missing("memory_efficiency", f"is a share of the bandwidth, got {share}: give 0..1")
        out["host_memory_efficiency"] = share
    return out


class _Fields:
    """A profile's mapping, read with one clear line for what is missing or wrong."""

    def __init__(self, raw: dict[str, Any], path: Path, prefix: str = "") -> None:
        self.raw, self.path, self.prefix = raw, path, prefix

    def _missing(self, key: str, what: str) -> UserError:
        return UserError(
            f"{what}", setting=f"{self.path.name}: {self.prefix}{key}", fix="see conf/cluster/8xh100_sxm.yaml"
        )

    def value(self, key: str) -> Any:
        if self.raw.get(key) is None:
            raise self._missing(key, "missing")
        return self.raw[key]

    def mapping(self, key: str) -> dict[str, Any]:
        found = self.value(key)
        if not isinstance(found, dict):
            raise self._missing(key, f"must be a mapping, got {found!r}")
        return found

    def count(self, key: str) -> int:
        """A whole number of things (nodes, devices) above 0: 1.5 nodes is not truncated to 1."""
        found = self.value(key)
        if isinstance(found, bool) or not isinstance(found, int) or found < 1:
            raise self._missing(key, f"must be a whole number, 1 or more, got {found!r}")
        return found

    def reserve(self) -> float:
        """reserve_gib: memory the framework and allocator keep, 0 or more (absent: 0)."""
        found = self.raw.get("reserve_gib")
        if found is None:
            return 0.0
        if isinstance(found, bool) or not isinstance(found, int | float) or not 0 <= found < math.inf:
            raise self._missing("reserve_gib", f"must be 0 or more GiB, got {found!r}")
        return float(found)

    def positive(self, key: str) -> float:
        found = self.value(key)
        if isinstance(found, bool) or not isinstance(found, int | float) or not found > 0:
            raise self._missing(key, f"must be a positive number, got {found!r}")
        return float(found)

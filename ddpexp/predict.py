"""`ddpexp-predict` (`python -m ddpexp.predict`): a cost model that predicts, from one measured run,
the step time and scaling efficiency of the same job on W devices over N nodes, on an interconnect
described by a profile (conf/interconnect/*.yaml) or measured by `ddpexp.commbench`.

    ddpexp-predict RUN_DIR --devices 1,2,4,8,16 --nodes 1,2 --interconnect nvlink4,ib400
    ddpexp-predict RUN_DIR --strategy fsdp --devices 2,3,4 --commbench commbench.json

The pieces, in the order a prediction uses them (docs/cost_model.md says what each assumes):

  the run       metrics.json: step time, metered communication time and bytes per step (the epochs
                after the first), facts (strategy, world, batch, device, cores, threads); config.yaml:
                the model, rebuilt on the meta device for its shapes (or one flat tensor of
                facts.parameters where it cannot be rebuilt)
  the strategy  `Strategy.communication` (what it sends per step: `Collective`s, next to the code that
                sends it) and `Strategy.compute_share` (its share of the step's compute)
  the fabric    per operation, a link's latency alpha and seconds per byte beta, intra- and inter-node;
                a collective costs calls x hops(W) x alpha + bus_factor(W) x bytes x beta on its
                slowest link
  the step      compute (the run's, divided as the strategy divides it, slowed where CPU processes
                share cores) + the communication that does not hide behind the forward/backward pass

`predict_curve` gives the report (device count, efficiency) points to draw next to the measured ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError
from .recorder import steady
from .strategies.comm import COLLECTIVE_OPS, Collective, Overlap, Workload

log = logging.getLogger(__name__)

# The share of a step's compute that the backward pass takes (about twice the forward's for dense
# layers: the gradients of the inputs and of the weights), and so the forward's.
BACKWARD_SHARE = 2 / 3
FORWARD_SHARE = 1 - BACKWARD_SHARE
PROFILE_SCOPES = ("intra", "inter", "both")


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


def bus_factor(op: str, ranks: int) -> float:
    """The bytes that cross each rank's link per byte of the operation's size (nccl-tests' bus factor,
    as ddpexp.commbench uses it): all_reduce 2(W-1)/W, all_gather/reduce_scatter/all_to_all (W-1)/W,
    broadcast and sendrecv 1."""
    if op == "sendrecv":
        return 1.0
    if ranks < 2:
        return 0.0  # one rank: nothing crosses a link
    if op == "broadcast":
        return 1.0
    return 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks


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
class Fabric:
    """The links a prediction uses: per operation, within a node and between nodes (None: not given)."""

    name: str
    intra: dict[str, Link]
    inter: dict[str, Link] | None
    notes: tuple[str, ...] = ()

    def time_s(self, c: Collective) -> float:
        links = self.inter if c.inter_node else self.intra
        if links is None:
            raise UserError(
                f"{self.name} describes no link between nodes",
                setting="--interconnect",
                fix="add an inter-node profile, e.g. --interconnect nvlink4,ib400 (or a commbench "
                "measured over several nodes)",
            )
        return collective_time(c, links.get(c.op) or links["all_reduce"])


# ------------------------------------------------------------------------------------------ fabrics


def profile_dir() -> Path:
    return Path(str(importlib.resources.files("ddpexp.conf"))) / "interconnect"


def profile_names() -> list[str]:
    return sorted(p.stem for p in profile_dir().glob("*.yaml"))


@dataclass(frozen=True)
class Profile:
    name: str
    scope: str  # intra | inter | both
    link: Link
    about: str  # the file's first comment line
    efficiency: float


def load_profile(name: str) -> Profile:
    """conf/interconnect/NAME.yaml, or a YAML file of yours given by its path."""
    import yaml

    path = Path(name) if name.endswith((".yaml", ".yml")) else profile_dir() / f"{name}.yaml"
    if not path.is_file():
        raise UserError(
            f"unknown interconnect {name!r}",
            setting="--interconnect",
            fix=f"choose one of: {', '.join(profile_names())} (conf/interconnect/), or a YAML file's path",
        )
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
    return Profile(path.stem, scope, link, first.lstrip("# ").strip(), efficiency)


def commbench_links(path: Path) -> tuple[dict[str, Link], dict[str, Any]]:
    """Per-operation links from a commbench.json: its fits (time = alpha + bytes x beta, measured on
    its world size Wb) divided back into one link's: alpha / hops(op, Wb), beta / bus_factor(op, Wb),
    so that the same ring formulas carry them to any W."""
    try:
        data = json.loads(path.read_text())
        facts, fits = data["facts"], data["fits"]
        world = int(facts["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"cannot read {path} as a commbench result ({type(exc).__name__}: {exc})",
            setting="--commbench",
            fix="give the commbench.json that python -m ddpexp.commbench wrote (facts, results, fits)",
        ) from exc
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


def fabric(interconnect: str | None = None, commbench: Path | str | None = None) -> Fabric:
    """The links from profiles (`nvlink4`, or `nvlink4,ib400`: the first that covers each scope) and/or
    a commbench.json (its links are intra-node if it ran on one node, else inter-node; profiles fill the
    other scope)."""
    if not interconnect and commbench is None:
        raise UserError(
            "no interconnect given",
            setting="--interconnect",
            fix=f"add --interconnect NAME ({', '.join(profile_names())}) or --commbench commbench.json",
        )
    intra: dict[str, Link] | None = None
    inter: dict[str, Link] | None = None
    notes, names = [], []
    if commbench is not None:
        links, facts = commbench_links(Path(commbench))
        nodes = int(facts.get("nnodes", 1) or 1)
        where = "inter" if nodes > 1 else "intra"
        notes.append(
            f"{where}-node links from {commbench} ({facts.get('backend')}, {facts.get('world_size')} ranks "
            f"on {nodes} node(s), host {facts.get('host')}): per op, the fit divided by its hops and bus "
            f"factor at that size; all_reduce: {links['all_reduce'].describe()} per link"
        )
        intra, inter = (links, None) if nodes == 1 else (None, links)
        names.append(f"commbench {Path(commbench).name}")
    only_inter: list[dict[str, Link]] = []
    for name in [n.strip() for n in (interconnect or "").split(",") if n.strip()]:
        profile = load_profile(name)
        same = dict.fromkeys(COLLECTIVE_OPS, profile.link)
        used: list[str] = []
        if intra is None and profile.scope in ("intra", "both"):
            intra, used = same, [*used, "intra"]
        if inter is None and profile.scope in ("inter", "both"):
            inter, used = same, [*used, "inter"]
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
    return Fabric("+".join(names), intra, inter, tuple(notes))


# ------------------------------------------------------------------------------------------ the run


@dataclass
class MeasuredRun:
    """What a prediction reads from one run: metrics.json's facts, final values and history, and the
    resolved config.yaml where the run directory is at hand."""

    facts: dict[str, Any]
    final: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    path: Path | None = None
    config: Any = None  # the resolved config (OmegaConf), or None

    @classmethod
    def read(cls, path: Path | str) -> MeasuredRun:
        path = Path(path)
        metrics = path / "metrics.json"
        if not metrics.is_file():
            raise UserError(
                f"{path} holds no metrics.json" if path.is_dir() else f"{path} is not a directory",
                setting="RUN_DIR",
                fix="give the run directory a ddpexp run printed ('run dir: ...'), one that trained",
            )
        try:
            data = json.loads(metrics.read_text())
        except ValueError as exc:
            raise UserError(
                f"{metrics} is not JSON ({exc})", setting="RUN_DIR", fix="give a finished run"
            ) from exc
        config = None
        if (path / "config.yaml").is_file():
            from omegaconf import OmegaConf

            config = OmegaConf.load(path / "config.yaml")
        run = cls(data.get("facts") or {}, data.get("final") or {}, data.get("history") or [], path, config)
        run.check()
        return run

    @classmethod
    def of(cls, run: Any) -> MeasuredRun:
        """A run directory, a MeasuredRun, or anything with `facts` and `final` (a report's Run,
        ddpexp.api.Result; their `run_dir`/`path` is read for the config where it exists)."""
        if isinstance(run, MeasuredRun):
            return run
        if isinstance(run, (str, Path)):
            return cls.read(run)
        where = getattr(run, "run_dir", None) or getattr(run, "path", None)
        if where is not None and (Path(where) / "metrics.json").is_file():
            return cls.read(where)
        facts = run["facts"] if isinstance(run, dict) else run.facts
        final = run["final"] if isinstance(run, dict) else run.final
        history = (run.get("history") if isinstance(run, dict) else getattr(run, "history", None)) or []
        measured = cls(dict(facts or {}), dict(final or {}), list(history))
        measured.check()
        return measured

    def check(self) -> None:
        where = self.path or "the run"
        if not self.facts or "world_size" not in self.facts:
            raise UserError(
                f"{where}'s metrics.json has no facts (the run stopped before training, or predates them)",
                setting="RUN_DIR",
                fix="run the job again with this ddpexp (a run of one epoch will do)",
            )
        if not self.epochs("perf/step_time_s"):
            raise UserError(
                f"{where} recorded no step time (perf/step_time_s): it trained no epoch",
                setting="RUN_DIR",
                fix="give a run that finished at least one epoch",
            )

    def epochs(self, key: str) -> list[float]:
        """`key` per epoch, the first left out when there are more (start-up: compilation, caches,
        rendezvous skew); the final value where there is no history."""
        values = [float(h[key]) for h in self.history if key in h]
        if not values and key in self.final:
            values = [float(self.final[key])]
        return steady(values)

    def mean(self, key: str) -> float:
        values = self.epochs(key)
        return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class ModelShape:
    """The run's model on the meta device, and what its inputs look like."""

    model: Any  # nn.Module on the meta device
    input_shape: tuple[int, ...] | None
    input_dtype: Any  # torch.dtype
    note: str | None = None  # how it was obtained, where not from the run's config


def model_shape(run: MeasuredRun) -> ModelShape:
    """The run's model rebuilt from its config.yaml on the meta device (shapes, no memory); where that
    is impossible (no config at hand, the model's code not importable) one flat parameter of
    facts.parameters elements: the bytes stay right, FSDP's padding, buckets and stages do not."""
    import torch
    from torch import nn

    reason = "no config.yaml at hand"
    if run.config is not None:
        try:
            from . import models
            from .preflight import instantiate_data

            info = instantiate_data(run.config.data).info()
            with torch.device("meta"):
                model = models.build(run.config.model, info)
            dtype = torch.long if info.vocab_size is not None else torch.float32
            return ModelShape(model, tuple(info.input_shape), dtype)
        except Exception as exc:  # a model of the user's that does not build here
            reason = f"rebuilding it failed: {' '.join(str(exc).split())[:120]}"
    count = int(run.facts.get("parameters") or 0)
    if count <= 0:
        raise UserError(
            "cannot tell the model's size: no config.yaml and no facts.parameters",
            setting="RUN_DIR",
            fix="give the run directory itself (it holds config.yaml)",
        )
    flat = nn.Module()
    flat.weight = nn.Parameter(torch.empty(count, device="meta"))
    note = f"model taken as one flat tensor of {count:,} parameters ({reason})"
    return ModelShape(flat, None, torch.float32, note)


def target_strategy(
    run: MeasuredRun, name: str | None = None, overrides: Sequence[str] = ()
) -> tuple[Any, Any]:
    """(strategy, its settings): `name` is a conf/strategy option (ddp, fsdp_no_reshard...) or a
    registered strategy; None: the run's own, with its settings. `overrides`: KEY=VALUE of its settings."""
    import yaml
    from omegaconf import OmegaConf

    from . import strategies

    strategies.load_builtins()
    if name is None:
        if run.config is not None:
            section = OmegaConf.to_container(run.config.strategy, resolve=True)
        else:
            section = {"name": run.facts["strategy"], **(run.facts.get("strategy_settings") or {})}
    else:
        option = Path(str(importlib.resources.files("ddpexp.conf"))) / "strategy" / f"{name}.yaml"
        section = {"name": name}
        if option.is_file():
            spec = yaml.safe_load(option.read_text()) or {}
            schema = [d for d in spec.pop("defaults", []) if isinstance(d, str) and d.endswith("_schema")]
            section = {**spec, "name": schema[0].removesuffix("_schema") if schema else name}
    assert isinstance(section, dict)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(
                f"{item!r} is not KEY=VALUE", setting="--set", fix="e.g. --set reshard_after_forward=false"
            )
        section[key.removeprefix("strategy.")] = yaml.safe_load(value)
    strategy, settings = strategies.resolve(section)
    return strategy, settings


# ------------------------------------------------------------------------------------------ the host


@dataclass(frozen=True)
class Host:
    """Where compute runs. On a CPU host the processes of a node share its cores: a process gets
    min(threads, cores / processes) of them (threads: trainer.threads if the run set it, else the
    fair share ddpexp gives by default, cores // processes, at least 1)."""

    device_type: str
    cores: int
    threads: int | None  # trainer.threads as the run set it; None: ddpexp's default rule

    def cores_per_process(self, processes: int, threads: int | None = None) -> float:
        if self.device_type != "cpu":
            return 1.0  # an accelerator per process: nothing shared
        chosen = threads or self.threads or max(1, self.cores // max(processes, 1))
        return min(float(chosen), self.cores / max(processes, 1))

    def overlap_efficiency(self, processes: int) -> float:
        """How much of a hideable communication can hide: on an accelerator it runs on its own engines
        (1); on a CPU host gloo's threads need cores of their own, so it hides only where the ranks
        leave cores free."""
        if self.device_type != "cpu":
            return 1.0
        busy = processes * (self.threads or max(1, self.cores // max(processes, 1)))
        return 1.0 if busy < self.cores else 0.0


def host_of(run: MeasuredRun) -> Host:
    facts = run.facts
    threads = None
    if run.config is not None:
        threads = run.config.get("trainer", {}).get("threads")
    cores = int(facts.get("host_cpus") or os.cpu_count() or 1)
    return Host(str(facts.get("device_type", "cpu")), cores, int(threads) if threads else None)


# ------------------------------------------------------------------------------------------ prediction


def hidden_s(timed: Sequence[tuple[Collective, float]], compute_s: float, efficiency: float) -> float:
    """Communication time that hides behind compute: per pass (forward: 1/3 of the compute, backward:
    2/3), what may overlap it, less its last call (which starts when the pass has nothing left to
    compute: DDP's last bucket, FSDP's last reduce-scatter), up to the pass's time x efficiency."""
    hidden = 0.0
    for phase, share in ((Overlap.forward, FORWARD_SHARE), (Overlap.backward, BACKWARD_SHARE)):
        items = [(c, t) for c, t in timed if c.overlaps == phase and t > 0]
        if not items:
            continue
        total = sum(t for _, t in items)
        tail = max(t / max(c.calls, 1) for c, t in items)
        hidden += min(max(total - tail, 0.0), efficiency * share * compute_s)
    return hidden


@dataclass(frozen=True)
class Point:
    """One predicted size. `note` is set (and the numbers are NaN) where the strategy cannot run there."""

    devices: int
    nodes: int
    world: int
    compute_s: float
    comm_s: float  # every collective's time, hidden or not
    exposed_s: float  # what the step waits for
    step_s: float
    samples_per_s: float
    efficiency: float  # throughput / (devices x the single-device throughput)
    counted_bytes: float  # what comm/bytes_per_step would show
    timed: tuple[tuple[Collective, float], ...] = ()
    note: str | None = None


@dataclass
class Predictor:
    """Everything a prediction needs, read once: the run, its model, the target strategy, the fabric."""

    run: MeasuredRun
    shape: ModelShape
    strategy: Any
    settings: Any
    fabric: Fabric
    host: Host
    overlap: float | None = None  # overrides Host.overlap_efficiency
    notes: list[str] = field(default_factory=list)
    compute_run_s: float = 0.0  # per step, as the run measured it (its exposed communication removed)
    work_s: float = 0.0  # the global batch's compute on one device (one core on a CPU host)
    single_s: float = 0.0  # the global batch's compute on one device (the whole host on a CPU)

    @classmethod
    def build(
        cls,
        run: Any,
        *,
        interconnect: str | None = None,
        commbench: Path | str | None = None,
        strategy: str | None = None,
        settings: Sequence[str] = (),
        overlap: float | None = None,
    ) -> Predictor:
        measured = MeasuredRun.of(run)
        target, target_settings = target_strategy(measured, strategy, settings)
        predictor = cls(
            measured,
            model_shape(measured),
            target,
            target_settings,
            fabric(interconnect, commbench),
            host_of(measured),
            overlap,
        )
        predictor._read_compute()
        return predictor

    # -------------------------------------------------------------------- reading the run

    def workload(self, devices: int, nodes: int, strategy: Any = None, settings: Any = None) -> Workload:
        from .validate import HostFacts

        strategy, settings = strategy or self.strategy, settings or self.settings
        facts = self.run.facts
        device_type = str(facts.get("device_type", "cpu"))
        if strategy.uses_process_group:
            host = HostFacts(cuda_devices=devices // max(nodes, 1), nccl=True, gloo=True, mpi=False)
            per_process = strategy.devices_per_process(settings, device_type=device_type, host=host)
            if devices % (per_process * nodes):
                raise UserError(
                    f"{devices} devices on {nodes} node(s) do not make whole processes of "
                    f"{per_process} device(s)",
                    setting="devices",
                    fix=f"use a multiple of {per_process * nodes}",
                )
            world = devices // per_process
        else:
            world = 1
        return Workload(
            model=self.shape.model,
            devices=devices,
            world=world,
            nodes=nodes,
            global_batch=int(facts.get("global_batch_size") or 1),
            accumulate=int(facts.get("accumulate") or 1),
            device_type=device_type,
            input_shape=self.shape.input_shape,
            input_dtype=self.shape.input_dtype,
        )

    def _read_compute(self) -> None:
        """The run's compute per step: its step time less the metered communication that did not hide
        (found as the fixed point of step = compute + comm - hidden(compute), the comm split over its
        collectives as the fabric would split it); then the global batch's compute on one device."""
        facts = self.run.facts
        step = self.run.mean("perf/step_time_s")
        comm = self.run.mean("comm/time_per_step_s")
        strategy, settings = target_strategy(self.run)
        devices, nodes = int(facts.get("devices") or 1), int(facts.get("nnodes") or 1)
        job = self.workload(devices, nodes, strategy, settings)
        metered = [c for c in strategy.communication(settings, job=job) if c.counted > 0]
        try:
            weights = [self.fabric.time_s(c) for c in metered]
        except UserError:  # a multi-node run read with an intra-node fabric: split by bytes instead
            weights = [c.bytes for c in metered]
        timed = (
            [(c, comm * w / sum(weights)) for c, w in zip(metered, weights, strict=True)]
            if sum(weights)
            else []
        )
        efficiency = self._overlap(job.procs_per_node)
        compute = step - comm
        for _ in range(100):
            compute = step - comm + hidden_s(timed, compute, efficiency) if timed else step - comm
        self.compute_run_s = max(compute, 1e-12)
        share = strategy.compute_share(settings, job=job)
        processes = job.procs_per_node if strategy.uses_process_group else 1
        threads = int(facts.get("threads") or 1)  # runs from before facts.threads: 1 per process
        self.work_s = self.compute_run_s * self.host.cores_per_process(processes, threads) / share
        self.single_s = self.work_s / self.host.cores_per_process(1)
        hidden = max(self.compute_run_s - (step - comm), 0.0)
        self.notes.append(
            f"compute per step read from the run ({facts.get('strategy')} on {devices} device(s), the epochs "
            f"after the first): step {step * 1e3:.3g} ms - metered communication {comm * 1e3:.3g} ms, of "
            f"which {hidden * 1e3:.3g} ms modelled as hidden = {self.compute_run_s * 1e3:.3g} ms; "
            "communication the "
            "run does not meter counts as compute here"
        )

    def _overlap(self, processes: int) -> float:
        return self.overlap if self.overlap is not None else self.host.overlap_efficiency(processes)

    # -------------------------------------------------------------------- predicting

    def point(self, devices: int, nodes: int = 1) -> Point:
        try:
            job = self.workload(devices, nodes)
            collectives = self.strategy.communication(self.settings, job=job)
            share = self.strategy.compute_share(self.settings, job=job)
            timed = tuple((c, self.fabric.time_s(c)) for c in collectives)
        except UserError as exc:
            nan = math.nan
            return Point(devices, nodes, 0, nan, nan, nan, nan, nan, nan, nan, note=str(exc))
        processes = job.procs_per_node if self.strategy.uses_process_group else 1
        compute = self.work_s * share / self.host.cores_per_process(processes)
        comm = sum(t for _, t in timed)
        exposed = comm - hidden_s(timed, compute, self._overlap(processes))
        step = compute + exposed
        return Point(
            devices=devices,
            nodes=nodes,
            world=job.world,
            compute_s=compute,
            comm_s=comm,
            exposed_s=exposed,
            step_s=step,
            samples_per_s=job.global_batch / step,
            efficiency=self.single_s / (devices * step),
            counted_bytes=sum(c.counted for c, _ in timed),
            timed=timed,
        )

    def points(self, devices: Sequence[int], nodes: Sequence[int] = (1,)) -> list[Point]:
        return [self.point(d, n) for n in nodes for d in devices if d >= n and d % n == 0]


def predict_curve(
    run: Any,
    devices: Sequence[int],
    *,
    interconnect: str | None = None,
    commbench: Path | str | None = None,
    strategy: str | None = None,
    settings: Sequence[str] = (),
    nodes: int = 1,
) -> list[tuple[int, float]]:
    """(devices, predicted scaling efficiency) for the report's scaling plot: `run` is a run directory
    or anything with `facts` and `final` (a report's Run, an api.Result); sizes the strategy cannot
    take are left out. Raises UserError for bad input."""
    predictor = Predictor.build(
        run, interconnect=interconnect, commbench=commbench, strategy=strategy, settings=settings
    )
    out = []
    for d in devices:
        point = predictor.point(d, nodes)
        if point.note is None:
            out.append((d, point.efficiency))
    return out


def predicted_bytes(run: Any, *, strategy: str | None = None, settings: Sequence[str] = ()) -> float:
    """What comm/bytes_per_step should show for the run's own size (the model's count of what the
    strategy's meter records), for checking the model against a measurement."""
    measured = MeasuredRun.of(run)
    target, target_settings = target_strategy(measured, strategy, settings)
    shape = model_shape(measured)
    predictor = Predictor(
        measured, shape, target, target_settings, Fabric("none", {}, None), host_of(measured)
    )
    facts = measured.facts
    job = predictor.workload(int(facts.get("devices") or 1), int(facts.get("nnodes") or 1))
    return sum(c.counted for c in target.communication(target_settings, job=job))


# ------------------------------------------------------------------------------------------ printing


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.2f}"


def render(predictor: Predictor, points: Sequence[Point]) -> str:
    run, facts = predictor.run, predictor.run.facts
    label = predictor.settings.name
    defaults = type(predictor.settings)()
    changed = {
        f.name: getattr(predictor.settings, f.name)
        for f in dataclasses.fields(predictor.settings)
        if f.name not in ("name", "module")
        and getattr(predictor.settings, f.name) != getattr(defaults, f.name)
    }
    if changed:
        label += " " + " ".join(f"{k}={getattr(v, 'value', v)}" for k, v in changed.items())
    gb = int(facts.get("global_batch_size") or 1)
    lines = [
        f"run: {run.path or '(facts)'}: {facts.get('strategy')} on {facts.get('devices')} "
        f"{facts.get('device_type')} "
        f"device(s), {facts.get('nnodes', 1)} node(s), global batch {gb}: "
        f"{run.mean('perf/step_time_s') * 1e3:.3g} ms/step, {run.mean('perf/samples_per_s'):,.0f} samples/s",
        f"predicting: {label} on {predictor.fabric.name}; one device computes a global batch in "
        f"{predictor.single_s * 1e3:.3g} ms ({gb / predictor.single_s:,.0f} samples/s)",
        "",
    ]
    header = (
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
    rows = []
    for p in points:
        if p.note is not None:
            rows.append((str(p.devices), str(p.nodes), *["-"] * 7))
            continue
        rows.append(
            (
                str(p.devices),
                str(p.nodes),
                _ms(p.compute_s),
                _ms(p.comm_s),
                _ms(p.exposed_s),
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
                f"      {c.what}: {c.op} over {c.ranks} ranks, {c.bytes:,.0f} bytes in {c.calls} call(s), "
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


# ------------------------------------------------------------------------------------------ command line


def _sizes(text: str, what: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise UserError(
            f"{text!r} is not a list of positive counts", setting=what, fix=f"e.g. {what} 1,2,4,8"
        )
    return sizes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpexp-predict",
        description="Predict a run's step time and scaling efficiency on W devices over N nodes.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (it holds metrics.json)")
    p.add_argument("--devices", default="1,2,4,8", help="device counts W, comma-separated (default 1,2,4,8)")
    p.add_argument("--nodes", default="1", help="node counts N, comma-separated (default 1)")
    p.add_argument(
        "--interconnect",
        help="profile(s) from conf/interconnect (nvlink4, or nvlink4,ib400: intra- then inter-node), "
        "or a YAML file",
    )
    p.add_argument("--commbench", type=Path, help="a commbench.json whose fitted alpha/beta to use")
    p.add_argument("--strategy", help="predict this strategy (a conf/strategy option) instead of the run's")
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the predicted strategy (repeatable), e.g. --set comm_hook=bf16",
    )
    p.add_argument(
        "--overlap-efficiency", type=float, help="share of the hideable communication that hides (0-1)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.overlap_efficiency is not None and not 0 <= args.overlap_efficiency <= 1:
            raise UserError(
                f"{args.overlap_efficiency} is not a share", setting="--overlap-efficiency", fix="give 0..1"
            )
        devices, nodes = _sizes(args.devices, "--devices"), _sizes(args.nodes, "--nodes")
        predictor = Predictor.build(
            args.run_dir,
            interconnect=args.interconnect,
            commbench=args.commbench,
            strategy=args.strategy,
            settings=args.settings,
            overlap=args.overlap_efficiency,
        )
        points = predictor.points(devices, nodes)
        if not points:
            raise UserError(
                "no device count is a multiple of a node count",
                setting="--devices",
                fix="e.g. --devices 2,4 --nodes 1,2",
            )
    except UserError as exc:
        print(f"ddpexp-predict: error: {exc}", file=sys.stderr)
        return exc.exit_code
    wider = [p for p in points if p.devices > 1]
    if args.strategy is None and wider and all(p.note is not None for p in wider):
        # The usual baseline is a one-device run; the strategy to spread it is this command's flag.
        print(
            f"ddpexp-predict: {predictor.strategy.name} runs on one device: add --strategy ddp (or fsdp, "
            "zero, naive_allreduce, ...; python -m ddpexp --help lists them) to predict it on more"
        )
    print(render(predictor, points))
    return 0


if __name__ == "__main__":
    sys.exit(main())

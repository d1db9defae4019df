"""The predictor: the run's compute per step (its metered communication taken out), divided as the
target strategy divides it, plus what that strategy sends on the fabric and cannot hide."""

from __future__ import annotations

import importlib.resources
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..strategies.comm import PASS_SHARE, Collective, Workload
from .interconnect import Fabric, Stretch, fabric
from .measured import MeasuredRun
from .shapes import ModelShape, model_shape


def target_strategy(run: MeasuredRun, name: str | None = None, overrides: Sequence[str] = ()) -> Any:
    """The strategy to predict, bound to its settings: `name` is a conf/strategy option (ddp,
    fsdp_no_reshard...) or a registered strategy; None: the run's own, with its settings.
    `overrides`: KEY=VALUE of its settings."""
    import yaml
    from omegaconf import OmegaConf

    from .. import strategies

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
    return strategies.resolve(section)


# ------------------------------------------------------------------------------------------ the host


@dataclass(frozen=True)
class Host:
    """Where compute runs. On a CPU host the processes of a node share its cores: a process gets
    min(threads, cores / processes) of them (threads: trainer.threads if the run set it, else the
    fair share ddpexp gives by default, cores // processes, at least 1)."""

    device_type: str
    cores: int
    threads: int | None  # trainer.threads as the run set it; None: ddpexp's default rule

    def threads_per_process(self, processes: int, threads: int | None = None) -> int:
        return threads or self.threads or max(1, self.cores // max(processes, 1))

    def cores_per_process(self, processes: int, threads: int | None = None) -> float:
        if self.device_type != "cpu":
            return 1.0  # an accelerator per process: nothing shared
        return min(float(self.threads_per_process(processes, threads)), self.cores / max(processes, 1))

    def speed(
        self, processes: int, threads: int | None = None, stretch: dict[int, Stretch] | None = None
    ) -> float:
        """How many cores' worth of compute one of `processes` processes gets: the cores it is given,
        or, where a commbench after compute measured this many processes with the same threads, one
        process alone over the stretch they measured (it holds what sharing the cores, caches and
        memory bandwidth costs: more than the division of cores says)."""
        measured = (stretch or {}).get(processes)
        chosen = self.threads_per_process(processes, threads)
        if self.device_type == "cpu" and measured is not None and measured.threads == chosen:
            return min(float(chosen), float(self.cores)) / measured.factor
        return self.cores_per_process(processes, threads)

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
    for phase, share in PASS_SHARE.items():
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
    overhead_s: float = 0.0  # from a calibration run (Predictor.calibrate), part of step_s


@dataclass
class Predictor:
    """Everything a prediction needs, read once: the run, its model, the target strategy, the fabric."""

    run: MeasuredRun
    shape: ModelShape
    strategy: Any  # bound to its settings (strategies.resolve)
    fabric: Fabric
    host: Host
    overlap: float | None = None  # overrides Host.overlap_efficiency
    notes: list[str] = field(default_factory=list)
    compute_run_s: float = 0.0  # per step, as the run measured it (its exposed communication removed)
    work_s: float = 0.0  # the global batch's compute on one device (one core on a CPU host)
    single_s: float = 0.0  # the global batch's compute on one device (the whole host on a CPU)
    overhead_s: float = 0.0  # per step at every size, from a run of the predicted strategy (calibrate)

    @classmethod
    def build(
        cls,
        run: Any,
        *,
        interconnect: str | None = None,
        commbench: Path | str | Sequence[Path | str] | None = None,
        strategy: str | None = None,
        settings: Sequence[str] = (),
        overlap: float | None = None,
        calibration: Any = None,
    ) -> Predictor:
        measured = MeasuredRun.of(run)
        predictor = cls(
            measured,
            model_shape(measured),
            target_strategy(measured, strategy, settings),
            fabric(interconnect, commbench),
            host_of(measured),
            overlap,
        )
        predictor._read_compute()
        if calibration is not None:
            predictor.calibrate(calibration)
        return predictor

    def calibrate(self, run: Any) -> None:
        """Calibrate on a run of the predicted strategy itself, at a size of its own: what it measured
        beyond the prediction there (a strategy's own work each step, such as FSDP's hooks and copies,
        which a run of another strategy cannot show) is paid at every size predicted. The held-out
        validation calibrates this way on W = 2 and predicts 3 and 4 (docs/cost_model.md)."""
        measured = MeasuredRun.of(run)
        name, predicted = target_strategy(measured).settings.name, self.strategy.settings.name
        if name != predicted:
            raise UserError(
                f"the calibration run is {name}, the prediction is for {predicted}",
                setting="--calibrate",
                fix=f"calibrate on a run of {predicted} (or predict --strategy {name})",
            )
        batch = measured.facts.get("global_batch_size"), self.run.facts.get("global_batch_size")
        if batch[0] != batch[1]:
            raise UserError(
                f"the calibration run's global batch is {batch[0]}, the predicted run's {batch[1]}",
                setting="--calibrate",
                fix="calibrate on a run with the same model and global batch",
            )
        facts = measured.facts
        devices, nodes = int(facts.get("devices") or 1), int(facts.get("nnodes") or 1)
        self.overhead_s = 0.0
        there = self.point(devices, nodes)
        if there.note is not None:
            raise UserError(
                f"the calibration run's size cannot be predicted: {there.note}",
                setting="--calibrate",
                fix="calibrate on a run at a size the strategy runs at",
            )
        step = measured.mean("perf/step_time_s")
        self.overhead_s = step - there.step_s
        self.notes.append(
            f"calibrated on {measured.path or 'a run'} ({name} on {devices} device(s)): {step * 1e3:.3g} "
            f"ms/step measured against {there.step_s * 1e3:.3g} predicted, so every size pays "
            f"{self.overhead_s * 1e3:+.3g} ms a step"
        )

    # -------------------------------------------------------------------- reading the run

    def workload(self, devices: int, nodes: int, strategy: Any = None) -> Workload:
        from ..plan import HostFacts

        strategy = strategy or self.strategy
        facts = self.run.facts
        device_type = str(facts.get("device_type", "cpu"))
        if strategy.uses_process_group:
            host = HostFacts(cuda_devices=devices // max(nodes, 1), nccl=True, gloo=True, mpi=False)
            per_process = strategy.devices_per_process(device_type=device_type, host=host)
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
            precision=self.precision,
            activation_checkpointing=self.activation_checkpointing,
            fp8_all_gather=bool(self._trainer("fp8_all_gather")),
        )

    def _trainer(self, name: str) -> Any:
        """The run's trainer.<name> (None where its config does not say)."""
        config = self.run.config
        return config.get("trainer", {}).get(name) if config is not None else None

    @property
    def activation_checkpointing(self) -> str:
        """The run's trainer.activation_checkpointing (none where its config does not say)."""
        return str(self._trainer("activation_checkpointing") or "none")

    @property
    def precision(self) -> str:
        """The run's trainer.precision (fp32 where its config does not say)."""
        from ..config import Precision

        value = self._trainer("precision")
        return Precision.of(value).name if value is not None else "fp32"

    def _read_compute(self) -> None:
        """The run's compute per step: its step time less the metered communication that did not hide
        (found as the fixed point of step = compute + comm - hidden(compute), the comm split over its
        collectives as the fabric would split it); then the global batch's compute on one device."""
        facts = self.run.facts
        step = self.run.mean("perf/step_time_s")
        comm = self.run.mean("comm/time_per_step_s")
        strategy = target_strategy(self.run)
        devices, nodes = int(facts.get("devices") or 1), int(facts.get("nnodes") or 1)
        job = self.workload(devices, nodes, strategy)
        metered = [c for c in strategy.communication(job=job) if c.counted > 0 and c.timed and not c.host]
        try:
            weights = [t for _, t in self.fabric.at(job.procs_per_node).timed(metered, step - comm)]
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
        share = strategy.compute_share(job=job)
        processes = job.procs_per_node if strategy.uses_process_group else 1
        threads = int(facts.get("threads") or 1)  # runs from before facts.threads: 1 per process
        self.work_s = self.compute_run_s * self.host.speed(processes, threads, self.fabric.stretch) / share
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
            self._check_devices(devices)
            job = self.workload(devices, nodes)
            collectives = self.strategy.communication(job=job)
            share = self.strategy.compute_share(job=job)
            processes = job.procs_per_node if self.strategy.uses_process_group else 1
            compute = self.work_s * share / self.host.speed(processes, stretch=self.fabric.stretch)
            timed = tuple(self.fabric.at(job.procs_per_node).timed(collectives, compute))
        except UserError as exc:
            nan = math.nan
            return Point(devices, nodes, 0, nan, nan, nan, nan, nan, nan, nan, note=str(exc))
        comm = sum(t for _, t in timed)
        exposed = comm - hidden_s(timed, compute, self._overlap(processes))
        step = max(compute + exposed + self.overhead_s, 1e-12)
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
            counted_bytes=sum(c.counted for c, _ in timed if not c.host),
            timed=timed,
            overhead_s=self.overhead_s,
        )

    def _check_devices(self, devices: int) -> None:
        """A one-process strategy spreads over GPUs only (DataParallel): on a CPU host it runs one
        replica however many devices are asked for, so a larger size predicts nothing real."""
        if devices > 1 and not self.strategy.uses_process_group and self.host.device_type != "cuda":
            raise UserError(
                f"{self.strategy.settings.name} needs GPUs for more than one device: on a "
                f"{self.host.device_type} host it runs one replica",
                setting="--devices",
                fix="predict a process-group strategy (--strategy ddp, fsdp, zero)",
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


def predicted_bytes(
    run: Any,
    *,
    strategy: str | None = None,
    settings: Sequence[str] = (),
    offload: bool = False,
    kind: str | None = None,
) -> float:
    """What comm/bytes_per_step should show for the run's own size (the model's count of what the
    strategy's meter records), for checking the model against a measurement; `offload`: what
    comm/bytes_per_step/offload should (the copies between host and device memory) instead; `kind`:
    what comm/bytes_per_step/<kind> should, of the collectives declared with that kind."""
    measured = MeasuredRun.of(run)
    target = target_strategy(measured, strategy, settings)
    predictor = Predictor(
        measured, model_shape(measured), target, Fabric("none", {}, None), host_of(measured)
    )
    facts = measured.facts
    job = predictor.workload(int(facts.get("devices") or 1), int(facts.get("nnodes") or 1))
    declared = [c for c in target.communication(job=job) if c.host == offload]
    return sum(c.counted for c in declared if kind is None or c.kind == kind)

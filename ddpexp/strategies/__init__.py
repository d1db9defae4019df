"""Strategies: one module per way of spreading training over devices, behind one typed contract.

A strategy is a subclass of `Strategy[C]`, where C is its own config dataclass (a `StrategyConfig`
subclass holding exactly the settings it understands). `@register` next to the class makes it
available by name and stores C in Hydra's ConfigStore as `<name>_schema`, which the strategy's YAML
lists in its defaults; a setting another strategy owns then fails at composition, naming the key.

Adding a strategy = one module named after it (the class with its `name`, its config dataclass,
`@register`) + one YAML in conf/strategy/ (`defaults: [<name>_schema, _self_]`). The YAML's first
comment line is its line in `--help`; `report_columns` declares the report's columns for scalars
of its own. A strategy of your own lives anywhere importable: its YAML sets `name:` and
`module: your.module`, which ddpexp imports in the parent and in every worker before use
(tests/tiny_strategy.py with tests/conf/strategy/tiny.yaml is one).

What the contract covers, in the order a run uses it:
  launch arithmetic   uses_process_group, devices_per_process, default_nprocs, pinned_devices
  data layout         data_layout: which shard of every global batch each rank reads (default: its own)
  before launch       check (against the plan), check_model (on a model built on the meta device)
  in each worker      wrap -> Wrapped, build_optimizer, compile (trainer.compile)
  checkpoints         model_state / load_model_state, optimizer_state / load_optimizer_state: full,
                      unsharded state in plain containers, whatever the strategy holds per rank
  cost model          communication (what it sends per optimizer step, as `Collective`s),
                      compute_share (its share of the step's compute) and held (what each rank
                      holds of the model's states and computes, as `Held`), read by ddpexp.predict
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from ..config import StrategyConfig
from ..errors import UserError
from ..optim import OptimizerSpec
from ..tasks import Loss
from .comm import Collective, CommMeter, Held, Workload

if TYPE_CHECKING:
    from ..context import RunContext
    from ..plan import HostFacts, Plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportColumn:
    """A column of the report for scalars a strategy logs of its own (through `Wrapped.extra_metrics`):
    its heading and the tags shown in it, last epoch's values joined by "/", each in its format."""

    heading: str
    tags: tuple[str, ...]
    formats: tuple[str, ...] = ("{:.2f}",)

    def to_dict(self) -> dict[str, Any]:
        return {"heading": self.heading, "tags": list(self.tags), "formats": list(self.formats)}


@dataclass
class DataParallelConfig(StrategyConfig):
    """Settings every strategy that keeps a whole model per rank (replicated or sharded) shares."""

    # Convert BatchNorm layers to synchronized BatchNorm (statistics over the global batch).
    sync_bn: bool = False


# Modules of this package that hold no strategy; every other module registers the one it is named after.
NOT_STRATEGIES = frozenset({"comm", "syncbn"})

# Why fp16's loss scaling cannot run under a strategy (Strategy.fp16_conflict, refused in pre-flight;
# the engine says the same of what wrap returned).
FP16_OWN_STEP = "fp16 needs loss scaling inside the strategy's own training step, which it does not do"
FP16_OWN_STEPS = (
    "fp16's loss scaling may skip an optimizer step on one rank alone, and this strategy's ranks, "
    "which step on gradients of their own, would then fall out of step"
)
FP16_FIX = "use trainer.precision=bf16 (no loss scaling needed) or fp32"

C = TypeVar("C", bound=StrategyConfig)
TrainStep = Callable[[Any, torch.Tensor, float, Loss], "torch.Tensor | None"]


@dataclass
class Wrapped:
    """What the engine trains, so that it never needs to know which strategy it runs.

    ``module`` is called for training forward passes; ``base`` is the plain model underneath (its
    parameters are what the optimizer steps, unless the strategy builds the optimizer itself);
    ``eval_module`` runs evaluation on this process's shard without any collective (default:
    ``base``; a multi-device pipeline for model parallelism). ``no_sync`` suppresses gradient
    synchronisation for all but the last micro-batch of an accumulated step; ``sync_grads`` runs after
    the last backward of a step, before the optimizer. ``sync_buffers`` makes this rank's buffers
    (BatchNorm running statistics) those of rank 0 before every evaluation and save, so that the
    distributed evaluation scores exactly what model.pt holds (default: broadcast ``base``'s buffers
    from rank 0; a strategy whose ranks hold different parts of the model replaces it).
    """

    module: nn.Module
    base: nn.Module
    no_sync: Callable[[], AbstractContextManager[object]] = field(default=nullcontext)
    sync_grads: Callable[[], None] = field(default=lambda: None)
    eval_module: nn.Module | None = None
    comm: CommMeter | None = None  # set by strategies that communicate gradients (and measure it)
    sync_buffers: Callable[[], None] | None = None
    # True when the training module's forward is itself collective (FSDP gathers parameters): every
    # rank then runs as many eval forwards as the rank with the most eval batches (see Engine.evaluate).
    collective_eval: bool = False
    # A strategy whose ranks do not each run the whole model forward and backward (a pipeline stage, a
    # parameter server) replaces the engine's micro-batch: train_step(inputs, targets, scale, loss)
    # runs it with the task's loss, (outputs, targets) -> the micro-batch's mean loss (backward of
    # loss x scale, scale = 1/accumulate), and returns that mean loss, detached, or None on a rank
    # that computes no loss. eval_module may likewise return None from
    # its forward on a rank that scores nothing (Engine.evaluate then skips that batch).
    train_step: TrainStep | None = None
    # Scalars of the strategy's own for each training epoch (pipe/bubble_frac...), merged into the
    # epoch's values by the engine. Called on every rank at the same point: it may reduce over ranks.
    extra_metrics: Callable[[], dict[str, float]] | None = None
    # Where each rank holds only part of the gradients (a pipeline stage's): the whole model's gradient
    # norm from this rank's parameters, for trainer.clip_grad_norm. Collective: every rank calls it.
    grad_norm: Callable[[list[nn.Parameter]], torch.Tensor] | None = None
    # True where each rank steps its optimizer on gradients of its own, never synchronised (local SGD,
    # DiLoCo): fp16's loss scaler could then skip a step on one rank alone, so the engine refuses fp16.
    own_steps: bool = False
    # False where the strategy casts the parameters itself (FSDP's mixed-precision policy gathers them in
    # bf16): the engine then runs the forward without trainer.precision's autocast.
    autocast: bool = True

    def __post_init__(self) -> None:
        if self.eval_module is None:
            self.eval_module = self.base
        if self.comm is not None:
            from . import syncbn

            syncbn.meter_into(self.base, self.comm)  # the statistics' all-reduces count too
        if self.sync_buffers is None:
            from .. import distributed

            base = self.base
            self.sync_buffers = lambda: distributed.broadcast_buffers(base)


class Strategy(ABC, Generic[C]):
    """One way of spreading training over devices, bound to its settings (`self.settings`, the
    strategy's section of the config under its schema C): `resolve` makes one per process from the
    config. Subclasses set `name` and `schema` and implement `wrap`; everything else has the behaviour
    of a plain replicated model as its default."""

    name: ClassVar[str]
    schema: ClassVar[type[StrategyConfig]]
    # One process per rank with torch.distributed (spawned, or torchrun's); False: one process only.
    uses_process_group: ClassVar[bool] = True
    # The report's columns for this strategy's own scalars (recorded in each run's facts).
    report_columns: ClassVar[tuple[ReportColumn, ...]] = ()

    def __init__(self, settings: C) -> None:
        self.settings = settings

    @classmethod
    def parse(cls, section: Any) -> C:
        """The strategy's section of the config as its own dataclass. A key it does not have (forced
        in with ++, or in a YAML of your own) is refused naming the strategies that do have it."""
        try:
            plain = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else section
            merged = OmegaConf.merge(OmegaConf.structured(cls.schema), plain)
            settings = OmegaConf.to_object(merged)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "key", None)
            raise UserError(
                " ".join(str(exc).splitlines()[0].split()),
                setting=f"strategy.{key}" if key else "strategy",
                fix=setting_hint(str(key)) if key else f"check the settings of strategy={cls.name}",
            ) from exc
        return settings  # type: ignore[return-value]

    def changed_settings(self) -> dict[str, Any]:
        """The settings that differ from the schema's defaults (fsdp: reshard_after_forward false; ddp:
        comm_hook bf16), as JSON values: what tells two variants of one strategy apart."""
        defaults = self.schema()
        return {
            f.name: value.value if isinstance(value, Enum) else value
            for f in fields(self.settings)
            if f.name not in ("name", "module")
            and (value := getattr(self.settings, f.name)) != getattr(defaults, f.name)
        }

    # ------------------------------------------------------------------------- launch arithmetic

    def devices_per_process(self, *, device_type: str, host: HostFacts) -> int:
        return 1

    def default_nprocs(self, *, device_type: str, host: HostFacts, devices_per_process: int) -> int:
        """Processes per node when dist.nprocs is not set: one per device group, 2 on a CPU host."""
        if device_type == "cuda":
            return max(host.cuda_devices // devices_per_process, 1)
        return 2

    def pinned_devices(self) -> tuple[int, ...]:
        """The GPUs each process drives, when the strategy names them; empty: the plan assigns them by
        local rank (see `Plan.process_devices`)."""
        return ()

    def data_layout(self, *, world_size: int) -> list[int]:
        """The data shard each rank reads, by rank: every rank its own (data parallelism) by default.
        Ranks that share a shard (the stages of one pipeline; a parameter server, which reads but
        ignores one) see the same batches; the number of distinct shards splits the global batch."""
        return list(range(world_size))

    # ------------------------------------------------------------------------- before launch

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        """Refuse what cannot work with this plan (a UserError naming the setting and the fix)."""

    def fp16_conflict(self, *, world_size: int) -> str | None:
        """Why fp16 mixed precision cannot train under this strategy at `world_size` ranks (its own
        training step, or ranks that step apart: FP16_OWN_STEP, FP16_OWN_STEPS), or None."""
        return None

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model the strategy cannot handle; `model` lives on the meta device."""

    # ------------------------------------------------------------------------- in each worker

    @abstractmethod
    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        """Put the model on this process's device(s) and wrap it for training."""

    def build_optimizer(self, wrapped: Wrapped, make: OptimizerSpec) -> torch.optim.Optimizer:
        return make(wrapped.base.parameters())

    def compile(self, wrapped: Wrapped) -> None:
        """trainer.compile: torch.compile what trains, whole, as wrapped."""
        wrapped.module = torch.compile(wrapped.module)  # type: ignore[assignment]

    # ------------------------------------------------------------------------- checkpoints
    # Called on every rank at the same point (a strategy may need a collective); rank 0 writes.

    def model_state(self, wrapped: Wrapped) -> dict[str, torch.Tensor]:
        return wrapped.base.state_dict()

    def load_model_state(self, wrapped: Wrapped, state: dict[str, torch.Tensor]) -> None:
        wrapped.base.load_state_dict(state)

    def optimizer_state(self, wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)

    # ------------------------------------------------------------------------- cost model (ddpexp.predict)
    # Pure: they read shapes from `job.model` (on the meta device) and never communicate. A setting the
    # model cannot describe (a size that does not split) raises UserError, which the prediction reports
    # for that size instead of a number.

    def communication(self, *, job: Workload) -> list[Collective]:
        """What this strategy sends in one optimizer step of `job`: the collectives, their bytes and
        what they may hide behind (see `Collective`). Default: nothing (one process, or a strategy
        that does not describe its communication: it is then predicted as free)."""
        return []

    def compute_share(self, *, job: Workload) -> float:
        """The share of one device's compute for the whole global batch that lies on a step's critical
        path at `job`'s size: 1/world by default (data parallelism, every rank a copy of the model)."""
        return 1.0 / job.world

    def held(self, *, job: Workload) -> list[Held]:
        """What each rank holds of the model's states and computes (`Held`, one per rank): by default
        every rank a whole copy, computing one micro-batch of its 1/world share of the global batch."""
        samples = job.global_batch / job.world / job.accumulate
        return [Held.replica(job.model, samples)] * job.world


_REGISTRY: dict[str, type[Strategy[Any]]] = {}
S = TypeVar("S", bound=type[Strategy[Any]])


def register(cls: S) -> S:
    """Class decorator: make the strategy available by name, and its schema to Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    _REGISTRY[cls.name] = cls
    # The node carries the strategy's name, so neither the schema nor the YAML has to repeat it.
    ConfigStore.instance().store(group="strategy", name=f"{cls.name}_schema", node=cls.schema(name=cls.name))
    return cls


def builtin_names() -> list[str]:
    """The strategies shipped with ddpexp: this package's modules, each named after its strategy."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in NOT_STRATEGIES)


def load_builtins() -> None:
    for name in builtin_names():
        importlib.import_module(f"{__name__}.{name}")


def get(name: str, module: str | None = None) -> type[Strategy[Any]]:
    """The registered strategy class `name`, importing `module` (or the built-in module) first if needed."""
    if name not in _REGISTRY:
        target = module or (f"{__name__}.{name}" if name in builtin_names() else None)
        if target is not None:
            try:
                importlib.import_module(target)
            except ImportError as exc:
                raise UserError(
                    f"cannot import {target} ({exc})",
                    setting="strategy.module",
                    fix="make the module importable from the directory you run in (or PYTHONPATH)",
                ) from exc
    if name not in _REGISTRY:
        where = f"{module} does not register it" if module else "no module registers it"
        raise UserError(
            f"unknown strategy {name!r} ({where})",
            setting="strategy",
            fix=f"choose one of: {', '.join(sorted(_REGISTRY))}; for your own, decorate it with "
            "ddpexp.strategies.register and set strategy.module",
        )
    return _REGISTRY[name]


def resolve(section: Any) -> Strategy[Any]:
    """The strategy a config's `strategy` section names, bound to its settings under its schema."""
    cls = get(section["name"], section.get("module"))
    return cls(cls.parse(section))


def setting_hint(key: str) -> str:
    """The fix for a strategy setting given to a strategy that does not have it."""
    owners = sorted(n for n, s in _REGISTRY.items() if key in {f.name for f in fields(s.schema)})
    if not owners:
        return "python -m ddpexp --cfg job strategy=NAME lists a strategy's settings"
    return f"strategy.{key} is a setting of " + ", ".join(f"strategy={n}" for n in owners)


def maybe_sync_bn(model: nn.Module, enabled: bool, device_type: str) -> nn.Module:
    """Convert BatchNorm to synchronized BatchNorm when asked (before wrapping)."""
    if not enabled:
        return model
    from . import syncbn

    if not syncbn.has_batchnorm(model):
        log.warning("strategy.sync_bn=true but the model has no BatchNorm layer: nothing to synchronize")
    return syncbn.convert(model, device_type)

"""ddp_mp: DDP combined with model parallelism. Each process owns K devices (strategy.stages); the
model's `stages()` are grouped into K consecutive parts placed one per device, activations move from
device to device, and DDP wraps the multi-device module (no device_ids). G GPUs => G/K processes.
On CPU every part sits on the CPU, so the same code path runs and is tested without GPUs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import UserError, require_positive
from . import Strategy, Wrapped, maybe_sync_bn, register
from .comm import Collective, Workload
from .ddp import (
    DdpConfig,
    check_settings,
    ddp_communication,
    ddp_kwargs,
    register_comm_hook,
    warn_powersgd_restarts,
)

if TYPE_CHECKING:
    from ..context import RunContext
    from ..plan import HostFacts, Plan


@dataclass
class DdpMpConfig(DdpConfig):
    # Devices each process owns; the model is split into this many consecutive parts, one per device.
    stages: int = 2


@register
class DdpMp(Strategy[DdpMpConfig]):
    name = "ddp_mp"
    schema = DdpMpConfig

    def devices_per_process(self, *, device_type: str, host: HostFacts) -> int:
        require_positive({"strategy.stages": self.settings.stages})  # before any arithmetic divides by it
        return self.settings.stages

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        check_settings(self.settings)  # every ddp setting applies, strategy.comm_hook included

    def check_model(self, model: nn.Module) -> None:
        n = len(model_stages(model))
        if n < self.settings.stages:
            raise UserError(
                f"{type(model).__name__} splits into at most {n} stages, not {self.settings.stages}",
                setting="strategy.stages",
                fix=f"use strategy.stages<={n}",
            )
        refuse_ties_across(model, group(model_stages(model), self.settings.stages))

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = maybe_sync_bn(model, self.settings.sync_bn, ctx.device.type)
        pipeline = StageChain(group(model_stages(model), self.settings.stages), list(ctx.devices))
        ddp = DistributedDataParallel(
            pipeline, **ddp_kwargs(self.settings)
        )  # multi-device module: no device_ids
        return Wrapped(
            module=ddp,
            base=model,
            no_sync=ddp.no_sync,
            eval_module=pipeline,
            comm=register_comm_hook(ddp, self.settings, measure=measure_comm),
        )

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        warn_powersgd_restarts(wrapped)  # called when training resumes from a checkpoint
        super().load_optimizer_state(wrapped, optimizer, state)

    def communication(self, *, job: Workload) -> list[Collective]:
        """ddp's over the processes, plus the activations (forward) and their gradients (backward)
        that cross from each device to the next inside a process, once per micro-batch and boundary,
        one after the other (the parts run in turn, no pipelining). Not metered."""
        out = ddp_communication(self.settings, job=job)
        if self.settings.stages < 2:
            return out
        micro = job.global_batch / job.accumulate / job.world
        sizes = boundary_bytes(group(model_stages(job.model), self.settings.stages), job, micro)
        hops = 2 * (self.settings.stages - 1) * job.accumulate
        what = "activations and their gradients between a process's devices (not metered)"
        if not sizes:
            what += "; their size unknown: latency only"
        return [*out, Collective(what, "sendrecv", float(hops * max(sizes, default=0)), 2, calls=hops)]


def model_stages(model: nn.Module) -> list[nn.Module]:
    """The model's own split into consecutive stages (its `stages()` method), or a clear refusal."""
    stages = getattr(model, "stages", None)
    if not callable(stages):
        raise UserError(
            f"{type(model).__name__} does not say how to split into stages (no stages() method)",
            setting="strategy",
            fix="use a model that defines stages() (convnet, mlp), or strategy=ddp",
        )
    return list(stages())


def refuse_ties_across(model: nn.Module, parts: list[nn.Module], setting: str = "strategy.stages") -> None:
    """A tensor that two parts hold (tied weights) cannot live on two devices or processes at once.
    `setting`: the degree that asks for the parts (nd's strategy.pp)."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for index, part in enumerate(parts):
        for t in part.state_dict(keep_vars=True).values():
            if owner.setdefault(id(t), index) != index:
                shared.add(id(t))
    names = [name for name, t in model.state_dict(keep_vars=True).items() if id(t) in shared]
    if names:
        raise UserError(
            f"{', '.join(names[:3])} would be in two stages at once (tied weights): each stage holds "
            "its own weights, on its own device or process",
            setting=setting,
            fix=f"untie them in the model (e.g. model.tie_embeddings=false), use fewer {setting} "
            "(tied layers in one stage), or strategy=ddp",
        )


class StageChain(nn.Module):
    """Consecutive parts of one model on consecutive devices; the forward pass moves activations along."""

    def __init__(self, parts: list[nn.Module], devices: list[torch.device]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(part.to(device) for part, device in zip(parts, devices, strict=True))
        self.devices = devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part, device in zip(self.parts, self.devices, strict=True):
            x = part(x.to(device, non_blocking=True))
        return x


def group(stages: list[nn.Module], k: int) -> list[nn.Module]:
    """K consecutive groups of stages, each at least one, whose largest holds the fewest parameters
    (the linear partition, exact): a model of equal blocks gets as many blocks in each group as they
    divide into, as Megatron-LM splits layers, whatever its embeddings weigh."""
    sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
    n = len(stages)
    k = max(1, min(k, n))
    prefix = list(itertools.accumulate(sizes, initial=0))
    # best[j][i]: the smallest largest group splitting the first i stages into j groups; cut: where
    # its last group starts.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for start in range(j - 1, i):
                load = max(best[j - 1][start], prefix[i] - prefix[start])
                if load < best[j][i]:
                    best[j][i], cut[j][i] = load, start
    edges, i = [n], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        edges.append(i)
    edges.reverse()
    return [nn.Sequential(*stages[a:b]) for a, b in itertools.pairwise(edges)]


def boundary_bytes(parts: list[nn.Module], job: Workload, samples: float) -> list[int]:
    """Bytes of the activations each part hands to the next for a micro-batch of `samples`, found by
    running the parts on the meta device (shapes only). [] where the job's input shape is unknown or
    the parts do not run on the meta device (the cost model then leaves the activations out)."""
    if job.input_shape is None or samples < 1:
        return []
    sizes = []
    try:
        with torch.no_grad():
            x = torch.empty((round(samples), *job.input_shape), dtype=job.input_dtype, device="meta")
            for part in parts[:-1]:
                x = part(x)
                sizes.append(x.numel() * x.element_size())
    except Exception:  # a model whose forward needs real values: its activations stay unmodelled
        return []
    return sizes

"""dp: torch.nn.DataParallel in one process. Every step scatters the global batch over the GPUs,
replicates the model onto each, gathers the outputs on the first, and reduces gradients there. On a
machine without GPUs it runs as a single replica on the CPU (said at start, recorded as replicas=1),
so CPU sweeps that include dp still complete."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch.nn import DataParallel

from ..errors import UserError
from . import Wrapped, refuse_extras, refuse_sync_bn

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn

    from ..context import RunContext
    from ..validate import HostFacts

log = logging.getLogger(__name__)

USES_PROCESS_GROUP = False


def devices_per_process(cfg: DictConfig, device_type: str, host: HostFacts) -> int:
    if device_type != "cuda":
        return 1
    ids = cfg.strategy.device_ids
    return len(ids) if ids is not None else host.cuda_devices


def device_ids(cfg: DictConfig, device_type: str, host: HostFacts) -> list[int] | None:
    if device_type != "cuda":
        return None
    ids = cfg.strategy.device_ids
    return list(ids) if ids is not None else list(range(host.cuda_devices))


def check(cfg: DictConfig, device_type: str, host: HostFacts) -> None:
    refuse_sync_bn(cfg, "dp")
    refuse_extras(cfg, "dp")
    ids = cfg.strategy.device_ids
    if ids is None:
        return
    if device_type != "cuda":
        raise UserError(
            "device_ids needs GPUs and this run is on the CPU",
            setting="strategy.device_ids",
            fix="leave strategy.device_ids unset on CPU (dp then runs one CPU replica)",
        )
    bad = [i for i in ids if not 0 <= i < host.cuda_devices]
    if not ids or bad or len(set(ids)) != len(ids):
        raise UserError(
            f"{list(ids)} is not a list of distinct visible GPUs (0..{host.cuda_devices - 1})",
            setting="strategy.device_ids",
            fix=f"use ids from 0 to {host.cuda_devices - 1}, or null for all",
        )


def wrap(model: nn.Module, *, ctx: RunContext, cfg: DictConfig) -> Wrapped:
    model = model.to(ctx.device)
    if ctx.device.type == "cuda":
        dp = DataParallel(model, device_ids=[d.index for d in ctx.devices], output_device=ctx.device)
    else:
        log.warning("dp: no GPU in this run, so DataParallel runs a single replica on the CPU")
        dp = DataParallel(model)  # without GPUs DataParallel simply calls the module
    return Wrapped(module=dp, base=model, eval_module=dp)

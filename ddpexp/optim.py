"""Optimizers (sgd | adamw), the LR scaling rule and the LR schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .config import OptimizerName, ScaleRule, Schedule
from .errors import UserError

# torch's own refusals (its ValueError messages), by the setting each names; Nesterov's first, since
# it also names momentum.
_REFUSED_BY_TORCH = (
    ("nesterov", "optim.nesterov", "set optim.momentum > 0, or optim.nesterov=false"),
    ("learning rate", "optim.lr", "set optim.lr > 0"),
    ("momentum", "optim.momentum", "set optim.momentum to 0 or more (0.9 is usual)"),
    ("weight_decay", "optim.weight_decay", "set optim.weight_decay to 0 or more"),
    ("epsilon", "optim.eps", "set optim.eps to a small positive number, e.g. 1e-8"),
    ("beta", "optim.betas", "set optim.betas to two numbers in [0, 1), e.g. [0.9,0.999]"),
)


def check(cfg: DictConfig) -> None:
    """Refuse what the optimizer would refuse, before anything starts (its numbers finite: validate
    refuses a nan or infinite setting anywhere): the LR positive, the schedule within the LR it starts
    from, then the optimizer's own checks (momentum, weight decay, betas, eps, Nesterov), so that
    torch's refusal speaks here rather than in every worker."""
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise UserError(
            f"the cosine schedule ends at lr x min_lr_ratio; {cfg.min_lr_ratio} is outside 0..1 (a "
            "negative learning rate ascends the loss, one above the peak is no decay)",
            setting="optim.min_lr_ratio",
            fix="use optim.min_lr_ratio between 0 and 1 (e.g. 0.1)",
        )
    if not 0 < cfg.gamma <= 1:
        raise UserError(
            f"the step schedule multiplies the learning rate by gamma every step_size steps; {cfg.gamma} "
            "is outside (0, 1]",
            setting="optim.gamma",
            fix="use optim.gamma between 0 and 1 (e.g. 0.1), or optim.schedule=constant",
        )
    if cfg.lr <= 0:
        raise UserError(f"must be positive, got {cfg.lr}", setting="optim.lr", fix="set optim.lr > 0")
    made = _spec(cfg, lr=cfg.lr)
    kwargs = {k: v for k, v in made.kwargs.items() if k != "fused"}  # fused: the device decides
    try:
        # No parameters: the optimizer checks its settings, then stops at the empty list before it adds
        # a parameter group (which would import torch._dynamo, seconds of this command's start-up).
        made.cls([], **kwargs)
    except ValueError as exc:
        said = str(exc)
        if said == "optimizer got an empty parameter list":
            return
        for word, setting, fix in _REFUSED_BY_TORCH:
            if word in said.lower():
                raise UserError(f"{made.cls.__name__} refuses it: {said}", setting=setting, fix=fix) from exc
        raise UserError(
            f"{made.cls.__name__} refuses it: {said}", setting="optim", fix="check optim.*"
        ) from exc


def scaled_lr(cfg: DictConfig, global_batch: int) -> float:
    """The learning rate actually used: optim.lr scaled by the rule for this global batch size.
    linear: lr * B / B_ref (Goyal et al.); sqrt: lr * sqrt(B / B_ref); none: lr."""
    ratio = global_batch / cfg.ref_batch_size
    factor = {ScaleRule.none: 1.0, ScaleRule.linear: ratio, ScaleRule.sqrt: math.sqrt(ratio)}[
        ScaleRule(cfg.scale_rule)
    ]
    return float(cfg.lr * factor)


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer `optim.*` describes: its class and keyword arguments (all but the parameters).
    Calling it on parameters builds it; a strategy that wraps the class (zero) reads both."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def spec(cfg: DictConfig, *, lr: float | None = None) -> OptimizerSpec:
    """The one definition of which optimizer the settings build (lr: the scaled LR, default optim.lr)."""
    check(cfg)
    return _spec(cfg, lr=lr)


def _spec(cfg: DictConfig, *, lr: float | None) -> OptimizerSpec:
    lr = cfg.lr if lr is None else lr
    impl = {} if cfg.fused is None else {"fused": bool(cfg.fused)}
    if OptimizerName(cfg.name) == OptimizerName.sgd:
        sgd = {"momentum": cfg.momentum, "nesterov": cfg.nesterov, "weight_decay": cfg.weight_decay}
        return OptimizerSpec(torch.optim.SGD, {"lr": lr, **sgd, **impl})
    adamw = {"betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    return OptimizerSpec(torch.optim.AdamW, {"lr": lr, **adamw, **impl})


def build(
    params: Iterable[torch.nn.Parameter], cfg: DictConfig, *, lr: float | None = None
) -> torch.optim.Optimizer:
    return spec(cfg, lr=lr)(params)


def lr_factor(cfg: Any, step: int, total_steps: int) -> float:
    """Multiplier of the used LR at optimizer step `step` (0-based): linear warmup over warmup_steps,
    then constant, step decay (x gamma every step_size) or cosine decay to min_lr_ratio."""
    warm = cfg.warmup_steps
    if step < warm:
        return (step + 1) / warm
    t = step - warm
    if cfg.schedule == "step":
        return float(cfg.gamma ** (t // cfg.step_size))
    if cfg.schedule == "cosine":
        span = max(total_steps - warm, 1)
        progress = min(t / span, 1.0)
        return float(cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return 1.0


def build_schedule(
    optimizer: torch.optim.Optimizer, cfg: DictConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """None for a constant LR without warmup. It runs every optimizer step, so it reads a plain copy
    of the settings: a LambdaLR over the DictConfig cost ~60 us per step (~5% of a small MLP's step)."""
    if Schedule(cfg.schedule) == Schedule.constant and not cfg.warmup_steps:
        return None
    plain = SimpleNamespace(**OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))  # type: ignore[arg-type]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(plain, step, total_steps))


def optimizer_states(optim_cfg: Any) -> int:
    """State tensors the optimizer keeps per parameter, each the parameter's size: SGD's momentum
    buffer (none without momentum), AdamW's two moments."""
    if str(optim_cfg.name) == "sgd":
        return 1 if optim_cfg.momentum else 0
    return 2

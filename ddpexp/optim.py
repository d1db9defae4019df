"""Optimizers (closed choice: sgd | adamw, validated before launch)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from omegaconf import DictConfig

from .errors import UserError

OPTIMIZERS = ("sgd", "adamw")


def check(cfg: DictConfig) -> None:
    if cfg.name not in OPTIMIZERS:
        raise UserError(
            f"unknown optimizer {cfg.name!r}", setting="optim.name", fix=f"use one of {OPTIMIZERS}"
        )
    if cfg.lr <= 0:
        raise UserError(f"must be positive, got {cfg.lr}", setting="optim.lr", fix="set optim.lr > 0")


def build(params: Iterable[torch.nn.Parameter], cfg: DictConfig) -> torch.optim.Optimizer:
    check(cfg)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
    )

"""Typed schema of the whole configuration.

The YAML files in conf/ fill these dataclasses; Hydra validates every override against them, so a
misspelt key (`trainer.epochz=3`) or a bad enum value (`init=foo`) fails at composition time with
the exact key named. Open-ended things (model, data) are `_target_` dicts instead: any importable
build function works, see conf/model and conf/data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class InitMethod(str, Enum):
    env = "env"  # MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE from the environment (torchrun's way)
    tcp = "tcp"  # tcp://addr:port with explicit rank and world size
    file = "file"  # file:// on a path every rank can see


class LoaderMode(str, Enum):
    auto = "auto"  # device-resident when the dataset is in-memory tensors, else DataLoader
    device = "device"  # whole dataset as tensors on the training device, batches by indexing
    dataloader = "dataloader"  # torch DataLoader + DistributedSampler (the tutorials' way)


@dataclass
class StrategyConfig:
    # Which strategy module wraps the model: one file per name in ddpexp/strategies/.
    name: str = MISSING
    # Convert BatchNorm layers to synchronized BatchNorm (statistics over the global batch) before
    # wrapping. Strategies with a process group only (ddp, ddp_mp, naive_allreduce).
    sync_bn: bool = False
    # dp only: the GPUs DataParallel replicates over (None: every visible GPU).
    device_ids: list[int] | None = None
    # ddp_mp only: devices each process owns; the model is split into this many pipeline stages.
    stages: int = 2


@dataclass
class DistConfig:
    # Processes per node when ddpexp launches its own workers. None: one per GPU, or 2 without GPUs.
    nprocs: int | None = None
    # Rendezvous address for init=env/tcp. Self-launch is one node, so loopback is right.
    master_addr: str = "127.0.0.1"
    # None: a free port is picked for every job (sweeps run jobs side by side without clashes).
    master_port: int | None = None
    # Timeout for process-group operations (collectives, barriers, rendezvous).
    timeout_s: float = 600.0
    # init=file only: the rendezvous file, on a path every rank can see. None: a fresh file in the run
    # directory. An existing file is refused (a stale one would join the wrong run); removed at the end.
    init_file: str | None = None


@dataclass
class LoaderConfig:
    mode: LoaderMode = LoaderMode.auto
    # DataLoader path only: worker processes per rank and pinned host memory (None: when on CUDA).
    num_workers: int = 0
    pin_memory: bool | None = None


@dataclass
class OptimConfig:
    # sgd | adamw (ddpexp/optim.py). lr is the learning rate at the configured global batch size.
    name: str = MISSING
    lr: float = 0.01
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only
    nesterov: bool = False  # sgd only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw only
    eps: float = 1e-8  # adamw only


@dataclass
class TrainerConfig:
    epochs: int = 10
    # Stop after this many optimizer steps even if epochs remain (None: run all epochs; 0: only
    # evaluate the initial weights).
    max_steps: int | None = None
    # GLOBAL batch: samples per optimizer step summed over all ranks. Each of W ranks gets batch/W,
    # so runs with the same batch_size are comparable across strategies and world sizes.
    batch_size: int = 64
    # Global eval batch (None: same as batch_size). Eval counts every sample exactly once.
    eval_batch_size: int | None = None
    eval_every_epochs: int = 1
    # Train loss is accumulated on the device and read (one host sync) every this many steps.
    log_every_steps: int = 10
    # Progress bar on rank 0. None: only when the output is a terminal.
    progress: bool | None = None


@dataclass
class Config:
    strategy: StrategyConfig = MISSING
    model: dict[str, Any] = MISSING
    data: dict[str, Any] = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    # auto | nccl | gloo | mpi (auto: nccl with GPUs, gloo without).
    backend: str = "auto"
    init: InitMethod = InitMethod.env
    # auto | cpu | cuda. auto: cuda when available.
    device: str = "auto"
    # Seeds model init (identical on every rank), data order and per-rank random streams.
    seed: int = 0


def register_schema() -> None:
    """Make the schema available to conf/config.yaml's defaults list as `config_schema`."""
    ConfigStore.instance().store(name="config_schema", node=Config)

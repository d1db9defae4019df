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
    # ddp, ddp_mp: DDP's gradient bucket size in MB (None: DDP's default, 25). naive_allreduce: None
    # = one all_reduce per parameter, a size = gradients flattened into buckets of that size.
    bucket_cap_mb: float | None = None
    # ddp, ddp_mp: DistributedDataParallel settings. gradient_as_bucket_view saves a gradient copy;
    # static_graph lets DDP optimise a graph that never changes; broadcast_buffers (None: on, except
    # with sync_bn, where BatchNorm statistics are already global) re-sends rank 0's buffers each
    # forward; find_unused_parameters is for models whose forward skips parameters (slower).
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    broadcast_buffers: bool | None = None
    find_unused_parameters: bool = False


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
    # Restart the workers this many times after a failure; each restart resumes from the run's newest
    # valid checkpoint (from scratch if there is none). Under torchrun use its --max-restarts instead.
    max_restarts: int = 0


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
    # Fused kernels (one kernel for all parameters). None: torch's default (foreach where supported).
    fused: bool | None = None
    # LR scaling with the global batch: lr_used = lr * f(batch_size / ref_batch_size), f = none |
    # linear | sqrt. Logged (facts.lr_used) so runs at different batch sizes stay comparable.
    scale_rule: str = "none"
    ref_batch_size: int = 64
    # LR schedule over optimizer steps: constant | step | cosine, after `warmup_steps` of linear warmup.
    schedule: str = "constant"
    warmup_steps: int = 0
    step_size: int = 1000  # step: multiply by gamma every step_size optimizer steps
    gamma: float = 0.1
    min_lr_ratio: float = 0.0  # cosine: final lr = lr_used * min_lr_ratio


@dataclass
class TrainerConfig:
    epochs: int = 10
    # Stop after this many optimizer steps even if epochs remain (None: run all epochs; 0: only
    # evaluate the initial weights).
    max_steps: int | None = None
    # GLOBAL batch: samples per optimizer step summed over all ranks. Each of W ranks gets batch/W,
    # so runs with the same batch_size are comparable across strategies and world sizes.
    batch_size: int = 64
    # Per-rank batch instead (weak scaling): if set, the global batch is this x world size x accumulate
    # and trainer.batch_size is ignored.
    batch_per_rank: int | None = None
    # Global eval batch (None: same as batch_size). Eval counts every sample exactly once.
    eval_batch_size: int | None = None
    eval_every_epochs: int = 1
    # Train loss is accumulated on the device and read (one host sync) every this many steps. Each log
    # point costs ~0.2 ms on rank 0 (TensorBoard scalars), so not every step.
    log_every_steps: int = 50
    # Progress bar on rank 0. None: only when the output is a terminal.
    progress: bool | None = None
    # Also evaluate every this many optimizer steps (None: at epoch ends only).
    eval_every_steps: int | None = None
    # train | eval. eval: score the weights of trainer.resume without training.
    mode: str = "train"
    # 32 | bf16 | fp16 (autocast; fp16 uses a GradScaler and needs CUDA).
    precision: str = "32"
    # Micro-batches per optimizer step. Global batch = per-rank micro-batch x accumulate x world size.
    accumulate: int = 1
    # Clip the (synchronised) gradient to this total L2 norm (None: no clipping).
    clip_grad_norm: float | None = None
    # torch.compile the training model; channels_last memory format for 4-D inputs (conv nets, GPU).
    compile: bool = False
    channels_last: bool = False
    # Time the gradient communication (DDP comm hook / around the all-reduces) and log comm/* scalars.
    measure_comm: bool = True
    # torch.use_deterministic_algorithms(True) (slower; same results run to run on the same machine).
    deterministic: bool = False
    # null: start fresh. auto: continue from the newest valid checkpoint in the run directory (fresh
    # if none). A path: that checkpoint file (refused if missing or unreadable).
    resume: str | None = None


@dataclass
class CheckpointConfig:
    # Save every this many epochs and/or optimizer steps (null: never on that trigger).
    every_epochs: int | None = 1
    every_steps: int | None = None
    # Periodic checkpoints kept (older ones deleted); best.pt is kept separately.
    keep_last_k: int = 2
    # Which eval metric decides best.pt, and whether higher (max) or lower (min) is better.
    best_metric: str = "eval/acc"
    best_mode: str = "max"


@dataclass
class Config:
    strategy: StrategyConfig = MISSING
    model: dict[str, Any] = MISSING
    data: dict[str, Any] = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
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

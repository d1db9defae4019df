"""Typed schema of the whole configuration.

The YAML files in conf/ fill these dataclasses; Hydra validates every override against them, so a
misspelt key (`trainer.epochz=3`) or a bad enum value (`init=foo`) fails at composition time with
the exact key named. Closed choices are Enums, so Hydra refuses a value outside them the same way.

The `strategy` section has no schema here: every strategy module declares its own dataclass (a
subclass of `StrategyConfig`) and registers it in the ConfigStore as `<name>_schema`, which its YAML
file lists in its defaults. `strategy=ddp strategy.stages=2` then fails at composition with
"Key 'stages' not in 'DdpConfig'". Open-ended things (model, data) are `_target_` dicts instead:
any importable build function works, see conf/model and conf/data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from omegaconf import MISSING

from .commbench.settings import CommbenchConfig


class InitMethod(StrEnum):
    env = "env"  # MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE from the environment (torchrun's way)
    tcp = "tcp"  # tcp://addr:port with explicit rank and world size
    file = "file"  # file:// on a path every rank can see


class LoaderMode(StrEnum):
    auto = "auto"  # device-resident when the dataset is in-memory tensors, else DataLoader
    device = "device"  # whole dataset as tensors on the training device, batches by indexing
    dataloader = "dataloader"  # torch DataLoader + DistributedSampler (the tutorials' way)


class StartMethod(StrEnum):
    forkserver = "forkserver"  # fork workers from a process that imported torch once (fast start)
    spawn = "spawn"  # a fresh interpreter per worker (slower start; nothing shared at all)


class Device(StrEnum):
    auto = "auto"  # cuda when a GPU is visible, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Precision(Enum):
    # `trainer.precision=32` arrives as the integer 32, which OmegaConf matches by value; `fp32` by name.
    fp32 = 32
    bf16 = "bf16"  # autocast to bfloat16 (CPU and GPU)
    fp16 = "fp16"  # autocast to float16 with a GradScaler (CUDA only)
    fp8 = "fp8"  # bf16, with the blocks' linear layers in float8 (ddpexp/float8.py)

    @classmethod
    def of(cls, value: Any) -> Precision:
        """The member a setting names: as composed (a member), or as a saved config.yaml has it (a name)."""
        if isinstance(value, str) and value in cls.__members__:
            return cls[value]
        return cls(value)

    @property
    def autocast_dtype(self) -> Any:
        """The torch dtype the engine autocasts to (None: no autocast); fp8's is around the float8
        layers' products (ddpexp/float8.py)."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(self.name)


class Fp8Recipe(StrEnum):
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class Mode(StrEnum):
    train = "train"
    eval = "eval"  # score the weights of trainer.resume (or model.weights) without training


class OptimizerName(StrEnum):
    sgd = "sgd"
    adamw = "adamw"


class ScaleRule(StrEnum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class Schedule(StrEnum):
    constant = "constant"
    step = "step"
    cosine = "cosine"


class ActivationCheckpointing(StrEnum):
    none = "none"  # keep every activation the backward needs
    full = "full"  # keep only each block's input; recompute the block during the backward
    selective = "selective"  # keep the outputs of matmuls, convolutions and attention; recompute the rest
    # as selective, but every second matmul of a block recomputed too (torchtitan's op-level policy)
    selective_half = "selective_half"


class OnNonFinite(StrEnum):
    stop = "stop"  # fail the run with the step where the loss stopped being finite
    warn = "warn"  # log a warning and go on


class BestMode(StrEnum):
    max = "max"
    min = "min"


@dataclass
class StrategyConfig:
    """What every strategy's own schema starts with (ddpexp/strategies/<name>.py declares the rest)."""

    # The registered strategy that wraps the model (ddpexp.strategies.register).
    name: str = MISSING
    # For a strategy of your own: the Python module that registers it (imported before use, in the
    # parent and in every worker). Built-in strategies leave it unset.
    module: str | None = None


@dataclass
class DistConfig:
    # Processes per node when ddpexp launches its own workers. None: the strategy's default (one per
    # GPU, or 2 without GPUs, for the data-parallel strategies).
    nprocs: int | None = None
    # Self-launch on several machines: run the same command on each, with nnodes the machine count and
    # node_rank this machine's place (0: the one at master_addr, which makes the run directory; the
    # others join it, so it must be on a filesystem every node sees). Global rank = node_rank x nprocs
    # + local rank. Needs master_port; node 0's launcher also listens on master_port + 1.
    nnodes: int = 1
    node_rank: int = 0
    # Rendezvous address for init=env/tcp. Loopback on one machine; with nnodes > 1, node 0's address.
    master_addr: str = "127.0.0.1"
    # None: a free port is picked for every job (sweeps run jobs side by side without clashes).
    master_port: int | None = None
    # Timeout for process-group operations (collectives, barriers, rendezvous).
    timeout_s: float = 600.0
    # Self-launched runs: a rank whose training makes no progress (no batch done) for this long is
    # declared hung: its Python stack goes to its log and the run stops, naming it. Start-up and
    # checkpoint writing get dist.timeout_s instead. None: no hang detection.
    hang_timeout_s: float | None = 120.0
    # init=file only: the rendezvous file, on a path every rank can see. None: a fresh file in the run
    # directory. An existing file is refused (a stale one would join the wrong run); removed at the end.
    init_file: str | None = None
    # Restart the workers this many times after a failure; each restart resumes from the run's newest
    # valid checkpoint (from scratch if there is none). Under torchrun use its --max-restarts instead.
    max_restarts: int = 0
    # How self-launched workers start: forked from a server that imported torch once, or spawned.
    start_method: StartMethod = StartMethod.forkserver
    # Allow more CPU worker processes on this host than 4 per core (refused otherwise: hundreds of
    # processes on a few cores stall the machine rather than train). Workers that cannot fit in the
    # memory available are refused all the same.
    oversubscribe: bool = False
    # Refuse, before anything starts, a run whose ranks on this machine cannot hold their model states
    # (parameters, gradients, optimizer state: the memory model's count) in its available memory.
    # false: start anyway (memory freed meanwhile, or swap you mean to use).
    memory_check: bool = True


@dataclass
class LoaderConfig:
    mode: LoaderMode = LoaderMode.auto
    # DataLoader path only: worker processes per rank and pinned host memory (None: when on CUDA).
    num_workers: int = 0
    pin_memory: bool | None = None


@dataclass
class OptimConfig:
    # ddpexp/optim.py builds it. lr is the learning rate at the configured global batch size.
    name: OptimizerName = MISSING
    lr: float = 0.01
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only
    nesterov: bool = False  # sgd only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw only
    eps: float = 1e-8  # adamw only
    # Fused kernels (one kernel for all parameters). None: torch's default (foreach where supported).
    fused: bool | None = None
    # LR scaling with the global batch: lr_used = lr * f(batch_size / ref_batch_size). Logged
    # (facts.lr_used) so runs at different batch sizes stay comparable.
    scale_rule: ScaleRule = ScaleRule.none
    ref_batch_size: int = 64
    # LR schedule over optimizer steps, after `warmup_steps` of linear warmup.
    schedule: Schedule = Schedule.constant
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
    mode: Mode = Mode.train
    precision: Precision = Precision.fp32
    # With precision=fp8, how each tensor cast to float8 is scaled: tensorwise (one scale per tensor,
    # torchtitan's default) or rowwise (one per row: more accurate, slower).
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    # With precision=fp8 (tensorwise) under FSDP (fsdp, nd's dp_shard): all-gather the float8 layers'
    # weights in float8, cast before the gather, instead of in bf16 (half the bytes of those weights).
    fp8_all_gather: bool = False
    # Micro-batches per optimizer step. Global batch = per-rank micro-batch x accumulate x world size.
    accumulate: int = 1
    # Clip the (synchronised) gradient to this total L2 norm (None: no clipping).
    clip_grad_norm: float | None = None
    # torch.compile the training model; channels_last memory format for 4-D inputs (conv nets, GPU).
    compile: bool = False
    channels_last: bool = False
    # Activation checkpointing of the model's declared blocks (shard_units(), else stages()): trade
    # compute for memory by recomputing activations in the backward. full: recompute each block whole;
    # selective: keep matmul/convolution/attention outputs, recompute the cheap ops between them.
    # Same parameters as none; mem/activations_mb shows what it saves (docs/training.md).
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    # Measure the communication (DDP comm hook / around the collectives) and log comm/* scalars: bytes
    # on every step; time on one optimizer step in time_comm_every_steps (the first of each epoch among
    # them), from which each epoch's comm time is estimated. On DDP the meter is a Python comm hook
    # (~0.1 ms per step on a 2-core CPU, README "The DDP loop against a hand-written one").
    measure_comm: bool = True
    time_comm_every_steps: int = 10
    # Run each job of a sweep (-m) this many times, same seed, into repeat=0..N-1 sub-directories: the
    # report shows their median and min-max, so a difference smaller than the spread reads as none.
    repeats: int = 1
    # Peak FLOP/s of one device, for model FLOPs utilisation (perf/mfu, models that declare
    # flops_per_token on data with tokens). null: A100, H100 and H200 GPUs from NVIDIA's datasheets
    # (ddpexp/flops.py); not reported on CPUs, which have no table.
    peak_flops: float | None = None
    # Intra-op CPU threads per process. null: OMP_NUM_THREADS if set, else the cores available to the
    # job divided by the processes on this host (2 ranks on 2 cores: 1 each), so ranks never
    # oversubscribe the cores and timings stay comparable. Recorded in metrics.json's facts.
    threads: int | None = None
    # torch.use_deterministic_algorithms(True) (slower; same results run to run on the same machine).
    deterministic: bool = False
    # A NaN or infinite training loss (checked at log points and epoch ends: no extra host sync).
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    # null: start fresh. auto: continue from the newest valid checkpoint in the run directory (fresh
    # if none). A path: that checkpoint file (refused if missing or unreadable).
    resume: str | None = None
    # On SIGTERM, SIGUSR1 or SIGUSR2 (what Slurm and submitit send before preemption or the time
    # limit): every rank saves a checkpoint at the same step boundary soon after, the run ends
    # `preempted` with exit code 128 + the signal, and a requeued job (submitit) resumes from it.
    # null: on under Slurm or submitit, off elsewhere (there SIGTERM stops at once, as Ctrl-C does).
    # Self-launched and in-process runs only (torchrun stops its workers itself).
    checkpoint_on_signal: bool | None = None


@dataclass
class CheckpointConfig:
    # Save every this many epochs and/or optimizer steps (null: never on that trigger).
    every_epochs: int | None = 1
    every_steps: int | None = None
    # Periodic checkpoints kept (older ones deleted); best.pt is kept separately.
    keep_last_k: int = 2
    # The one definition of "best" (best.pt, metrics.json's `best`, the report): this eval metric,
    # higher (max) or lower (min) being better. null: the task's own (eval/acc max; regression:
    # eval/mse min), see ddpexp/tasks.py.
    best_metric: str | None = None
    best_mode: BestMode | None = None


@dataclass
class Config:
    strategy: Any = MISSING  # typed by the chosen strategy's own schema (see the module docstring)
    model: dict[str, Any] = MISSING
    data: dict[str, Any] = MISSING
    task: dict[str, Any] = MISSING  # loss and eval metrics (conf/task, ddpexp/tasks.py)
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # auto | nccl | gloo | mpi, or per device type: cpu:gloo,cuda:nccl (auto: nccl with GPUs, gloo without).
    backend: str = "auto"
    init: InitMethod = InitMethod.env
    device: Device = Device.auto
    # Seeds model init (identical on every rank), data order and per-rank random streams.
    seed: int = 0
    # Which of trainer.repeats' runs this job is (set by ddpexp; the report pools the repeats).
    repeat: int = 0
    # The collective benchmark's settings (python -m ddpexp.commbench, conf/commbench.yaml); null in a
    # training run. A job whose config has them runs the benchmark in its workers instead of training.
    commbench: CommbenchConfig | None = None

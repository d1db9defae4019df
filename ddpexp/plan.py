"""The launch plan of one job and the host facts it is made from: plain data, decided once in the parent.

`validate.plan()` makes a `Plan` from a config and `HostFacts`; everything below the launcher (the
workers' context, strategies, commbench) reads it. This module imports nothing of ddpexp, so any
layer may use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HostFacts:
    """What this machine can do, probed once in the parent (tests build it by hand)."""

    cuda_devices: int
    nccl: bool
    gloo: bool
    mpi: bool
    # This process's OpenMP threads spin where its workers' sleep (host.waits_unlike_its_workers): a
    # one-process CPU run then starts a worker of its own rather than run here.
    spinning_threads: bool = False

    @classmethod
    def probe(cls, *, spinning_threads: bool = False) -> HostFacts:
        import torch
        import torch.distributed as dist

        return cls(
            cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            nccl=dist.is_available() and dist.is_nccl_available(),
            gloo=dist.is_available() and dist.is_gloo_available(),
            mpi=dist.is_available() and dist.is_mpi_available(),
            spinning_threads=spinning_threads,
        )


@dataclass(frozen=True)
class ExternalWorld:
    """The process layout an external launcher (torchrun) decided for us."""

    world_size: int
    local_world_size: int


@dataclass(frozen=True)
class Plan:
    strategy: str
    launcher: str  # inprocess | spawn | torchrun
    device_type: str  # cpu | cuda
    backend: str | None  # None: no process group (single-process strategies)
    init: str
    world_size: int
    nprocs_per_node: int
    devices_per_process: int
    global_batch: int
    per_rank_batch: int
    eval_per_rank_batch: int
    replicas: int  # model replicas sharing one global batch (world size; DataParallel: its GPUs)
    # Data shards of each global batch (Strategy.data_layout): the world size, unless ranks share a
    # shard (pipeline stages, a parameter server). per_rank_batch = global / (data_parallel x accumulate).
    data_parallel: int = 0
    shard_of_rank: tuple[int, ...] = ()
    # The GPUs one process drives when the strategy names them (dp's strategy.device_ids); empty: local
    # rank r drives devices r x devices_per_process onwards.
    pinned_devices: tuple[int, ...] = ()
    # trainer.precision (fp32, bf16, fp16): a strategy that casts parameters itself (FSDP's mixed-precision
    # policy) decides from it whether the engine autocasts.
    precision: str = "fp32"
    # trainer.activation_checkpointing: a strategy whose backward runs twice over a block (a zero-bubble
    # pipeline schedule) refuses the modes that allow one.
    activation_checkpointing: str = "none"

    def __post_init__(self) -> None:
        if not self.data_parallel:  # a plan.json written before data layouts existed
            object.__setattr__(self, "data_parallel", self.world_size)
        layout = tuple(self.shard_of_rank) or tuple(range(self.world_size))  # from JSON: a list
        object.__setattr__(self, "shard_of_rank", layout)
        object.__setattr__(self, "pinned_devices", tuple(self.pinned_devices))

    def process_devices(self, local_rank: int) -> tuple[torch.device, ...]:
        """The devices the process of `local_rank` drives; its batches go to the first."""
        import torch

        count = self.devices_per_process
        if self.device_type != "cuda":
            return tuple(torch.device("cpu") for _ in range(count))
        ids = self.pinned_devices or range(local_rank * count, (local_rank + 1) * count)
        return tuple(torch.device("cuda", i) for i in ids)

    @property
    def devices(self) -> int:
        """Devices training in parallel: GPUs on CUDA; on CPU a process's "devices" are the same cores,
        so processes count."""
        return self.world_size * (self.devices_per_process if self.device_type == "cuda" else 1)

    def steps_per_epoch(self, train_samples: int, accumulate: int) -> int:
        """Optimizer steps one epoch of `train_samples` gives (each rank's shard in whole micro-batches)."""
        return train_samples // self.data_parallel // self.per_rank_batch // accumulate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(**d)

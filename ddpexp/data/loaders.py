"""Per-rank batch iterators. Two paths, one sample order:

- device-resident (`TensorLoader`): the split lives as tensors on the training device and batches are
  drawn by indexing, with no per-sample Python work at all;
- DataLoader (`TorchLoader`): torch's DataLoader, for data that needs per-sample CPU transforms or does
  not fit in memory.

Both draw from one `ShardOrder`, which gives every rank exactly the samples DistributedSampler would
give it for the same seed, epoch and world size (`distributed_order`), so switching paths never changes
what is trained on. Evaluation shards
are exact: rank r takes samples r, r+W, r+2W... with no padding, so each sample is counted once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import UserError
from .source import Split

Batch = tuple[Any, torch.Tensor]


class Loader(Protocol):
    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order; the next iteration begins at batch `start` (resuming mid-epoch)."""
        ...

    def __iter__(self) -> Iterator[Batch]: ...
    def __len__(self) -> int: ...


def distributed_order(
    n: int, *, rank: int, world: int, seed: int, epoch: int, shuffle: bool = True
) -> torch.Tensor:
    """The indices DistributedSampler(drop_last=False) yields on `rank`: a permutation seeded with
    seed + epoch, padded by wrapping around to a multiple of `world`, then every world-th element."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(n)
    total = math.ceil(n / world) * world
    if total > n:
        order = torch.cat([order, order.repeat(math.ceil((total - n) / n))[: total - n]])
    return order[rank:total:world]


def num_batches(samples: int, batch_size: int, *, train: bool) -> int:
    """Training drops the last partial batch (every optimizer step sees the whole global batch);
    evaluation keeps it (every sample is scored)."""
    return samples // batch_size if train else math.ceil(samples / batch_size)


def exact_shard(n: int, *, rank: int, world: int) -> torch.Tensor:
    """Evaluation shard: no shuffling, no padding, every sample on exactly one rank."""
    return torch.arange(rank, max(n, rank), world)  # empty when there are fewer samples than ranks


class ShardOrder(Sampler[int]):
    """The order in which one rank visits its shard of a split: DistributedSampler's permutation for
    training (`distributed_order`), the exact shard for evaluation. Both loader paths draw from it, so
    they cannot disagree. As a Sampler (the DataLoader path) its next iteration can begin `skip`
    samples in, so a resumed epoch loads nothing it will not use."""

    def __init__(self, n: int, *, rank: int, world: int, seed: int, train: bool) -> None:
        self.n, self.rank, self.world, self.seed, self.train = n, rank, world, seed, train
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch = epoch
        self.skip = skip

    def indices(self) -> torch.Tensor:
        if self.train:
            return distributed_order(
                self.n, rank=self.rank, world=self.world, seed=self.seed, epoch=self.epoch
            )
        return exact_shard(self.n, rank=self.rank, world=self.world)

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return iter(self.indices()[skip:].tolist())

    def __len__(self) -> int:
        if self.train:  # padded to a multiple of the world size, like DistributedSampler
            return math.ceil(self.n / self.world)
        return max(0, math.ceil((self.n - self.rank) / self.world))


class TensorLoader:
    """Batches by indexing tensors that already sit on the training device."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        batch_size: int,
        rank: int,
        world: int,
        seed: int,
        device: torch.device,
        train: bool,
    ) -> None:
        self.x = x.to(device)
        self.y = y.to(device)
        self.batch_size = batch_size
        self.device = device
        self.order = ShardOrder(len(y), rank=rank, world=world, seed=seed, train=train)
        self.start = 0
        self._len = num_batches(len(self.order), batch_size, train=train)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.order.set_epoch(epoch)
        self.start = start

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Batch]:
        idx = self.order.indices().to(self.device)
        b = self.batch_size
        start, self.start = self.start, 0
        for i in range(start, self._len):
            sel = idx[i * b : (i + 1) * b]
            yield self.x.index_select(0, sel), self.y.index_select(0, sel)


class TorchLoader:
    """torch DataLoader on the host; batches are moved to the device as they come."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        rank: int,
        world: int,
        seed: int,
        device: torch.device,
        train: bool,
        collate: Any,
        num_workers: int,
        pin_memory: bool,
    ) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        self.batch_size = batch_size
        self.sampler = ShardOrder(n, rank=rank, world=world, seed=seed, train=train)
        self._len = num_batches(len(self.sampler), batch_size, train=train)
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=train,
            collate_fn=collate,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=num_workers > 0,
        )
        self.device = device
        self.non_blocking = pin_memory

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sampler.set_epoch(epoch, start * self.batch_size)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Batch]:
        try:
            for inputs, targets in self.loader:
                yield (
                    to_device(inputs, self.device, self.non_blocking),
                    targets.to(self.device, non_blocking=self.non_blocking),
                )
        except UserError as exc:
            raise _from_loader_worker(exc) from None


def _from_loader_worker(exc: UserError) -> UserError:
    """A UserError a DataLoader worker raised (a dataset naming a damaged file) comes back as a new one
    whose message is the worker's whole traceback: its one line again, which ends that traceback."""
    prefix = f"{UserError.__module__}.{UserError.__name__}: "
    last = str(exc).rstrip().splitlines()[-1]
    if not str(exc).startswith("Caught UserError") or not last.startswith(prefix):
        return exc
    return UserError(last[len(prefix) :])


def to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device, non_blocking) for o in obj)
    return obj


def choose_mode(requested: str, split: Split, device: torch.device) -> str:
    """`auto` keeps the data on the device when the split is plain tensors that fit comfortably."""
    if requested == "dataloader":
        return "dataloader"
    fits = split.tensors is not None and _fits(split.tensors, device)
    if requested == "device":
        if split.tensors is None:
            raise UserError(
                "this dataset needs per-sample transforms, so it cannot be held as device tensors",
                setting="loader.mode",
                fix="use loader.mode=dataloader (or auto)",
            )
        return "device"
    return "device" if fits else "dataloader"


def _fits(tensors: tuple[torch.Tensor, ...], device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # the tensors are already in host memory; indexing them costs nothing extra
    size = sum(t.numel() * t.element_size() for t in tensors)
    return size < 0.25 * torch.cuda.get_device_properties(device).total_memory


def build(
    split: Split,
    *,
    mode: str,
    batch_size: int,
    rank: int,
    world: int,
    seed: int,
    device: torch.device,
    train: bool,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Loader:
    loader: Loader
    if mode == "device":
        assert split.tensors is not None
        x, y = split.tensors
        loader = TensorLoader(
            x, y, batch_size=batch_size, rank=rank, world=world, seed=seed, device=device, train=train
        )
    else:
        loader = _torch_loader(split, batch_size, rank, world, seed, device, train, num_workers, pin_memory)
    if split.batch_dtype is not None:
        loader = Cast(loader, split.batch_dtype)
    if train and split.augment is not None:
        return Augmented(loader, split.augment)
    return loader


class Cast:
    """Batches converted to `dtype` on the device: data stored compactly (uint8 token ids, 1 byte a
    token on every rank) reaches the model and the loss as the int64 they take."""

    def __init__(self, loader: Loader, dtype: torch.dtype) -> None:
        self.loader = loader
        self.dtype = dtype

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.loader.set_epoch(epoch, start)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        dtype = self.dtype
        for inputs, targets in self.loader:
            yield inputs.to(dtype), targets.to(dtype)


class Augmented:
    """Training batches through a batch-level augmentation, applied on the device after loading."""

    def __init__(self, loader: Loader, augment: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.loader = loader
        self.augment = augment

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.loader.set_epoch(epoch, start)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        for inputs, targets in self.loader:
            yield self.augment(inputs), targets


def _torch_loader(
    split: Split,
    batch_size: int,
    rank: int,
    world: int,
    seed: int,
    device: torch.device,
    train: bool,
    num_workers: int,
    pin_memory: bool,
) -> TorchLoader:
    return TorchLoader(
        split.dataset,
        batch_size=batch_size,
        rank=rank,
        world=world,
        seed=seed,
        device=device,
        train=train,
        collate=split.collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )

"""Sample order and sharding: the same samples as DistributedSampler for training, every eval sample
exactly once, and the two loader paths interchangeable."""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddpexp.data import Split
from ddpexp.data.loaders import build, distributed_order, exact_shard


@pytest.mark.parametrize("n", [10, 11, 97, 1438])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("epoch", [0, 5])
def test_distributed_order_matches_distributed_sampler(n: int, world: int, epoch: int):
    data = list(range(n))
    for rank in range(world):
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        ours = distributed_order(n, rank=rank, world=world, seed=7, epoch=epoch).tolist()
        assert ours == list(sampler)


@pytest.mark.parametrize("n", [1, 2, 511, 512])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_exact_shard_counts_every_sample_once(n: int, world: int):
    shards = [exact_shard(n, rank=r, world=world).tolist() for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))


@pytest.mark.parametrize("n", [1, 2, 83, 512])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shard_order_length_is_the_length_of_its_indices(n: int, world: int):
    from ddpexp.data.loaders import ShardOrder

    for train in (True, False):
        for rank in range(world):
            order = ShardOrder(n, rank=rank, world=world, seed=1, train=train)
            assert len(order) == len(order.indices()) == len(list(order))


def _batches(mode: str, split: Split, *, train: bool, rank: int, world: int, epoch: int) -> list[list[int]]:
    loader = build(
        split,
        mode=mode,
        batch_size=8,
        rank=rank,
        world=world,
        seed=3,
        device=torch.device("cpu"),
        train=train,
        num_workers=0,
        pin_memory=False,
    )
    loader.set_epoch(epoch)
    return [y.tolist() for _, y in loader]


@pytest.mark.parametrize("train", [True, False])
def test_device_and_dataloader_paths_yield_identical_batches(train: bool):
    n = 83
    split = Split.from_tensors(torch.arange(n).float().unsqueeze(1), torch.arange(n))
    for world in (1, 2, 3):
        for rank in range(world):
            device = _batches("device", split, train=train, rank=rank, world=world, epoch=2)
            torch_dl = _batches("dataloader", split, train=train, rank=rank, world=world, epoch=2)
            assert device == torch_dl
            if train:  # only full batches: every optimizer step sees the whole global batch
                assert all(len(b) == 8 for b in device)
            else:  # nothing dropped, nothing padded
                assert sum(map(len, device)) == len(exact_shard(n, rank=rank, world=world))


def test_training_order_changes_with_epoch():
    split = Split.from_tensors(torch.zeros(64, 1), torch.arange(64))
    e0 = _batches("device", split, train=True, rank=0, world=2, epoch=0)
    e1 = _batches("device", split, train=True, rank=0, world=2, epoch=1)
    assert e0 != e1


def test_dataloader_path_for_a_plain_dataset():
    n = 20
    ds = TensorDataset(torch.zeros(n, 2), torch.arange(n))
    split = Split(dataset=ds, tensors=None, collate=None)
    got = _batches("dataloader", split, train=False, rank=1, world=2, epoch=0)
    assert functools.reduce(operator.iadd, got, []) == list(range(1, n, 2))

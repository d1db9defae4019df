"""Synchronized BatchNorm on CPU/gloo: DDP on 2 ranks with per-rank batch b must equal ordinary
BatchNorm on the concatenated batch 2b (outputs, gradients, running statistics). Without SyncBN it
must not (the test can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpexp.strategies import syncbn

from .conftest import start_ranks

pytestmark = pytest.mark.multiproc

WORLD, B = 2, 6


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 5),
    )


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(WORLD * B, 3, 8, 8, generator=g) * 3 + 1, torch.randint(
        0, 5, (WORLD * B,), generator=g
    )


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, base: nn.Module) -> dict[str, object]:
    out = model(x)
    F.cross_entropy(out, y).backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad.clone() for n, p in base.named_parameters()},
        "buffers": {n: b.clone() for n, b in base.named_buffers()},
    }


def _rank(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=WORLD)
    x, y = make_batch()
    mine = slice(rank * B, (rank + 1) * B)
    results = {}
    for sync in (True, False):
        base = make_model()
        if sync:
            base = syncbn.convert(base, "cpu")
            assert isinstance(base[1], syncbn.CPUSyncBatchNorm)
        ddp = DistributedDataParallel(base)
        results[sync] = step(ddp, x[mine], y[mine], base)
    torch.save(results, f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[bool, dict]]:
    tmp = tmp_path_factory.mktemp("syncbn")
    start_ranks(_rank, (str(tmp),), nprocs=WORLD)
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    base = make_model()
    x, y = make_batch()
    return step(base, x, y, base)


def _compare(ranks, reference, sync: bool) -> None:
    out = torch.cat([r[sync]["out"] for r in ranks])
    torch.testing.assert_close(out, reference["out"], rtol=1e-4, atol=1e-5)
    for r in ranks:
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(r[sync]["grads"][name], grad, rtol=1e-4, atol=1e-6)
        for name, buf in reference["buffers"].items():
            torch.testing.assert_close(r[sync]["buffers"][name], buf, rtol=1e-5, atol=1e-6)


def test_sync_bn_on_two_ranks_matches_batchnorm_on_the_whole_batch(ranks, reference):
    _compare(ranks, reference, sync=True)


def test_without_sync_bn_it_does_not_match(ranks, reference):
    with pytest.raises(AssertionError):
        _compare(ranks, reference, sync=False)


def test_eval_mode_uses_running_stats_without_communication():
    bn = syncbn.convert(nn.Sequential(nn.BatchNorm2d(3)), "cpu")
    bn.eval()
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(bn(x), x / torch.sqrt(torch.tensor(1 + 1e-5)))  # no process group needed

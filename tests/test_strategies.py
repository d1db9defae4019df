"""Strategy pieces that need no process group: model splitting for ddp_mp, and the plan arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose
from hydra.utils import instantiate
from torch import nn

from ddpexp import models
from ddpexp.composition import conf_dir
from ddpexp.errors import UserError
from ddpexp.plan import HostFacts
from ddpexp.strategies.ddp_mp import StageChain, group
from ddpexp.validate import plan

from .test_gpt_model import PUBLISHED

# The published transformer shapes (billions of parameters) are only built on the meta device, by
# tests/test_gpt_model.py; the trainable sizes of the same model are split here.
MODELS = sorted(f.stem for f in (Path(conf_dir()) / "model").glob("*.yaml") if f.stem not in PUBLISHED)


pytestmark = pytest.mark.usefixtures("hydra_conf")


def test_group_makes_k_nonempty_consecutive_parts():
    stages = [nn.Linear(10, 10), nn.Linear(10, 1000), nn.Linear(1000, 2), nn.Identity()]
    for k in range(1, len(stages) + 1):
        parts = group(stages, k)
        assert len(parts) == k
        flat = [m for part in parts for m in part]
        assert flat == stages


@pytest.mark.parametrize("name", MODELS)
def test_every_shipped_model_splits_into_stages_that_compose_to_its_forward(name: str):
    from ddpexp.data import DataInfo

    cfg = compose(config_name="config", overrides=[f"model={name}", "data=synthetic"])
    if name in ("gcnn", "embbag"):
        info = DataInfo(num_classes=2, input_shape=(128,), vocab_size=50, pad_index=0)
        x = torch.randint(0, 50, (3, 128))
    elif name.startswith("gpt"):
        info = DataInfo(num_classes=256, input_shape=(64,), vocab_size=256)
        x = torch.randint(0, 256, (3, 64))
    else:
        info = instantiate(cfg.data).info()
        x = torch.randn(3, 1, 28, 28)
    model = models.build(cfg.model, info).eval()
    n = len(model.stages())
    for k in range(1, n + 1):
        pipeline = StageChain(group(list(model.stages()), k), [torch.device("cpu")] * k)
        torch.testing.assert_close(pipeline(x), model(x), rtol=0, atol=0)


def _host(gpus: int) -> HostFacts:
    return HostFacts(cuda_devices=gpus, nccl=gpus > 0, gloo=True, mpi=False)


@pytest.mark.parametrize(
    ("overrides", "gpus", "expect"),
    [
        (["strategy=ddp"], 8, dict(world_size=8, backend="nccl", per_rank_batch=8, replicas=8)),
        (["strategy=ddp_mp"], 8, dict(world_size=4, devices_per_process=2, per_rank_batch=16, devices=8)),
        (["strategy=ddp_mp"], 0, dict(world_size=2, devices_per_process=2, devices=2)),
        (["strategy=ddp_mp", "strategy.stages=4"], 8, dict(world_size=2, devices_per_process=4)),
        (["strategy=dp"], 4, dict(world_size=1, replicas=4, devices_per_process=4, per_rank_batch=64)),
        (["strategy=dp", "strategy.device_ids=[1,3]"], 4, dict(replicas=2, devices_per_process=2)),
        (["strategy=dp"], 0, dict(replicas=1, device_type="cpu", devices_per_process=1)),
        (["strategy=naive_allreduce", "backend='cpu:gloo,cuda:nccl'"], 2, dict(backend="cpu:gloo,cuda:nccl")),
        (["strategy=ddp", "dist.nprocs=3", "trainer.batch_size=66"], 0, dict(world_size=3, backend="gloo")),
        (["strategy=ddp", "backend=GLOO"], 0, dict(backend="gloo")),  # torch takes either case
    ],
)
def test_plan(overrides: list[str], gpus: int, expect: dict[str, object]):
    p = plan(compose(config_name="config", overrides=overrides), _host(gpus))
    for key, value in expect.items():
        assert getattr(p, key) == value, key


def test_the_plan_names_each_process_devices():
    """The devices a worker drives are decided in the parent, with the plan: by local rank, or the ones
    dp's strategy.device_ids pins."""
    import torch

    cuda = [torch.device("cuda", i) for i in range(4)]
    pinned = plan(
        compose(config_name="config", overrides=["strategy=dp", "strategy.device_ids=[1,3]"]), _host(4)
    )
    assert pinned.process_devices(0) == (cuda[1], cuda[3])
    two_each = plan(compose(config_name="config", overrides=["strategy=ddp_mp"]), _host(4))
    assert [two_each.process_devices(r) for r in (0, 1)] == [tuple(cuda[:2]), tuple(cuda[2:])]
    on_cpu = plan(compose(config_name="config", overrides=["strategy=ddp_mp"]), _host(0))
    assert on_cpu.process_devices(1) == (torch.device("cpu"), torch.device("cpu"))


def test_gpu_layout_refusals():
    with pytest.raises(UserError, match=r"dist\.nprocs"):
        plan(compose(config_name="config", overrides=["strategy=ddp_mp", "dist.nprocs=3"]), _host(4))
    with pytest.raises(UserError, match="device_ids"):
        plan(compose(config_name="config", overrides=["strategy=dp", "strategy.device_ids=[4]"]), _host(4))


@pytest.mark.parametrize(
    ("overrides", "expect"),
    [
        ([], dict(gradient_as_bucket_view=True, static_graph=False, broadcast_buffers=True)),
        (["strategy.sync_bn=true"], dict(broadcast_buffers=False)),
        (
            [
                "strategy.static_graph=true",
                "strategy.gradient_as_bucket_view=false",
                "strategy.bucket_cap_mb=1",
            ],
            dict(static_graph=True, gradient_as_bucket_view=False, bucket_bytes_cap=2**20),
        ),
        (["strategy.find_unused_parameters=true"], dict(find_unused_parameters=True)),
    ],
)
def test_ddp_settings_reach_distributed_data_parallel(overrides: list[str], expect: dict, tmp_path: Path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddpexp import strategies
    from ddpexp.strategies.ddp import SYNC_BUFFERS_ARG, ddp_kwargs

    cfg = compose(config_name="config", overrides=["strategy=ddp", *overrides])
    settings = strategies.resolve(cfg.strategy).settings
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(4, 2), **ddp_kwargs(settings))
        for name, value in expect.items():
            if name == "broadcast_buffers":  # its name in this torch version
                name = SYNC_BUFFERS_ARG
            assert getattr(ddp, name) == value, name
    finally:
        dist.destroy_process_group()

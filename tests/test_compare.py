"""Comparing strategies: a preset sweep gives one TensorBoard run per job with scalars and hparams
together, communication is measured, and the report turns the sweep into a table and plots whose
numbers are the runs' own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ddpexp
from ddpexp import fsutil, report, runrecord, strategies
from ddpexp.composition import expand
from ddpexp.config import Precision
from ddpexp.report.prediction import prediction
from ddpexp.report.table import table as report_table
from ddpexp.runrecord import strategy_label

from .conftest import PARITY, QUICK, REPO, metrics, run_here

SHORT = [
    "data=synthetic",
    "data.num_train=512",
    "data.num_eval=128",
    "trainer.epochs=2",
    "trainer.progress=false",
]
JOBS = ["strategy=ddp", "strategy=ddp_sync_bn", "strategy=dp", "strategy=single"]


@pytest.fixture(scope="module")
def preset_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("preset")
    result = run_here(cwd, "-m", "experiment=dp_vs_ddp_vs_syncbn", *SHORT, "hydra.sweep.dir=sweep")
    assert result.returncode == 0, result
    return cwd / "sweep"


def _accumulator(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


@pytest.mark.multiproc
def test_one_tensorboard_run_per_job_with_scalars_and_hparams(preset_sweep: Path):
    assert sorted(p.name for p in preset_sweep.iterdir() if p.is_dir()) == JOBS
    events = sorted(p.parent.name for p in preset_sweep.rglob("events.out.tfevents.*"))
    assert events == JOBS  # exactly one event file per job, none in nested sub-runs
    for job in JOBS:
        acc = _accumulator(preset_sweep / job)
        tags = set(acc.Tags()["scalars"])
        assert {
            "eval/acc",
            "perf/samples_per_s",
            "perf/data_wait_frac",
            "mem/peak_mb",
            "summary/best_eval_acc",
        } <= tags
        assert ("perf/comm_share" in tags) == job.startswith("strategy=ddp")
        hp = acc.PluginTagToContent("hparams")
        assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= hp.keys()
        facts = metrics(preset_sweep / job)["facts"]
        assert facts["model"] == "convnet" and facts["global_batch_size"] == 64
        assert facts["devices"] == (2 if job.startswith("strategy=ddp") else 1)
    assert metrics(preset_sweep / "strategy=ddp_sync_bn")["facts"]["sync_bn"] is True


@pytest.mark.multiproc
def test_sync_bn_statistics_and_ddp_s_buffer_broadcast_are_counted_by_kind(preset_sweep: Path):
    """SyncBN's all-reduces are communication too, and so is plain DDP's broadcast of rank 0's
    BatchNorm statistics before each step's forward: counted in comm/bytes_per_step (and their time in
    comm/share), broken down by kind, and equal to what the cost model says they are."""
    from ddpexp.models.convnet import convnet
    from ddpexp.predict import predicted_bytes

    sync = metrics(preset_sweep / "strategy=ddp_sync_bn")["final"]
    plain = metrics(preset_sweep / "strategy=ddp")["final"]
    model = convnet(num_classes=10, input_shape=[1, 28, 28])
    assert "comm/bytes_per_step/sync_bn" not in plain
    assert plain["comm/bytes_per_step/buffers"] == sum(b.numel() * b.element_size() for b in model.buffers())
    plain_total = plain["comm/bytes_per_step/gradients"] + plain["comm/bytes_per_step/buffers"]
    assert plain["comm/bytes_per_step"] == pytest.approx(plain_total, rel=1e-12)
    assert predicted_bytes(preset_sweep / "strategy=ddp") == pytest.approx(plain_total, rel=1e-6)
    assert "comm/bytes_per_step/buffers" not in sync  # its statistics are global: DDP sends no buffers
    assert sync["comm/bytes_per_step/gradients"] == plain["comm/bytes_per_step/gradients"]  # the same
    assert sync["comm/bytes_per_step/sync_bn"] > 0
    total = sync["comm/bytes_per_step/gradients"] + sync["comm/bytes_per_step/sync_bn"]
    assert sync["comm/bytes_per_step"] == pytest.approx(total, rel=1e-12)
    assert predicted_bytes(preset_sweep / "strategy=ddp_sync_bn") == pytest.approx(total, rel=0.01)


@pytest.mark.multiproc
def test_report_has_a_row_per_job_plots_and_the_runs_own_numbers(preset_sweep: Path):
    script = Path(sys.executable).parent / "ddpexp-report"  # the console script users run
    proc = subprocess.run(
        [str(script), str(preset_sweep), "--target", "0.5", "--predict", "localhost_gloo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    stdout = proc.stdout
    text = (preset_sweep / "report.md").read_text()
    for job in JOBS:
        assert f"| {job} |" in text and job in stdout
    for png in ("acc_vs_time.png", "loss_vs_step.png", "throughput.png", "scaling.png"):
        assert (preset_sweep / png).stat().st_size > 5000
    (group,) = report.group_runs(report.find_runs([preset_sweep]))  # one model, data and global batch
    header, rows = report_table(group, 0.5)
    table = {cells[0]: dict(zip(header, cells, strict=True)) for cells in rows}
    assert table["strategy=single"]["vs baseline"] == "baseline"  # single, even where dp is faster
    for job in JOBS:
        m = metrics(preset_sweep / job)
        row = table[job]
        assert row["final"] == f"{100 * m['final']['eval/acc']:.2f}%"
        assert row["best"] == f"{100 * m['best']['eval/acc']:.2f}%"
        per_epoch = [e.value for e in _accumulator(preset_sweep / job).Scalars("perf/samples_per_s")]
        assert [h["perf/samples_per_s"] for h in m["history"]] == pytest.approx(per_epoch, rel=1e-6)
        assert row["samples/s"] == f"{sum(per_epoch[1:]) / len(per_epoch[1:]):,.0f}"
        if job == "strategy=ddp":
            shares = [e.value for e in _accumulator(preset_sweep / job).Scalars("perf/comm_share")]
            assert row["comm share"] == f"{100 * sum(shares) / len(shares):.2f}%"
            assert 0 < shares[-1] < 1 and m["final"]["comm/bytes_per_step"] > 0
    # --predict: the cost model's curves from the group's single run, for each other strategy.
    curves = prediction("localhost_gloo")(group)
    assert {"ddp", "ddp +syncbn"} <= curves.keys(), curves
    assert [d for d, _ in curves["ddp"]] == [1, 2, 3, 4]
    assert all(0 < efficiency <= 1 for _, efficiency in curves["ddp"])


@pytest.mark.multiproc
def test_report_marks_a_crashed_job_instead_of_breaking(preset_sweep: Path, tmp_path: Path):
    copy = tmp_path / "sweep"
    shutil.copytree(preset_sweep, copy, ignore=shutil.ignore_patterns("*.png", "report.md", "*.pt"))
    killed = copy / "strategy=ddp"  # killed hard: status still "running", event file cut short
    m = json.loads((killed / "metrics.json").read_text())
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    m["status"] = "running"
    m["owner"] = runrecord.owner_record(int(gone.stdout))  # a process that has ended
    (killed / "metrics.json").write_text(json.dumps(m))
    (events,) = killed.glob("events.out.tfevents.*")
    events.write_bytes(events.read_bytes()[:200])
    failed = copy / "strategy=dp"
    (failed / "metrics.json").write_text(
        json.dumps({"status": "failed", "facts": {"strategy": "dp"}, "error": "x"})
    )
    report.main([str(copy)])
    text = (copy / "report.md").read_text()
    assert "| strategy=ddp | crashed |" in text and "| strategy=dp | failed |" in text  # no live process
    assert "| strategy=single | completed |" in text
    m["owner"] = runrecord.owner_record(os.getpid())  # its owner alive: running
    (killed / "metrics.json").write_text(json.dumps(m))
    report.main([str(copy)])
    assert "| strategy=ddp | running |" in (copy / "report.md").read_text()
    del m["owner"]  # a record from before owners: running while a live ddpexp process holds its sweep
    (killed / "metrics.json").write_text(json.dumps(m))
    with fsutil.claim(copy):  # type: ignore[union-attr]
        report.main([str(copy)])
    assert "| strategy=ddp | running |" in (copy / "report.md").read_text()


def test_naive_buckets_pack_parameters_up_to_the_cap():
    from ddpexp.strategies.naive_allreduce import buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 10, 300_000, 5)]
    assert [[p.numel() for p in b] for b in buckets(params, None)] == [[1000], [10], [300_000], [5]]
    packed = buckets(params, 1.0)  # 1 MiB = 262,144 floats
    assert [[p.numel() for p in b] for b in packed] == [[5], [300_000], [10, 1000]]


@pytest.mark.multiproc
def test_bucketed_naive_allreduce_trains_like_ddp(parity_sweep: Path, tmp_path: Path):
    result = run_here(
        tmp_path, "strategy=naive_allreduce", "strategy.bucket_cap_mb=0.05", *PARITY, "hydra.run.dir=r"
    )
    assert result.returncode == 0, result
    naive = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    ddp = torch.load(parity_sweep / "strategy=ddp" / "model.pt", weights_only=True)
    for name in ddp:
        torch.testing.assert_close(naive[name], ddp[name], rtol=1e-5, atol=1e-6)
    assert metrics(tmp_path / "r")["final"]["comm/bytes_per_step"] > 0


@pytest.mark.multiproc
def test_sync_bn_ddp_trains_like_single_process_batchnorm(preset_sweep: Path, tmp_path: Path):
    """With the BatchNorm ConvNet, ddp+sync_bn equals single on the same global batch, weights and
    running statistics alike; plain ddp (per-rank statistics) does not (the preset sweep's runs)."""
    bn = ["model=convnet", "data=synthetic", "trainer.progress=false", "trainer.max_steps=5"]
    runs = {"single": ["strategy=single"], "ddp_sync_bn": ["strategy=ddp_sync_bn"]}
    runs["fsdp_sync_bn"] = ["strategy=fsdp", "strategy.sync_bn=true"]
    for name, args in runs.items():
        result = run_here(tmp_path, *args, *bn, f"hydra.run.dir={name}")
        assert result.returncode == 0, result
    reference = torch.load(tmp_path / "single" / "model.pt", weights_only=True)
    assert any("running_var" in name for name in reference)
    for run in ("ddp_sync_bn", "fsdp_sync_bn"):
        synced = torch.load(tmp_path / run / "model.pt", weights_only=True)
        for name, value in reference.items():
            torch.testing.assert_close(
                synced[name].to(value.dtype), value, rtol=1e-4, atol=1e-5, msg=(run, name)
            )
    assert metrics(tmp_path / "ddp_sync_bn")["facts"]["sync_bn"] is True
    single, local = (
        torch.load(preset_sweep / f"strategy={s}" / "model.pt", weights_only=True) for s in ("single", "ddp")
    )
    assert not all(
        torch.allclose(local[n].float(), v.float(), rtol=1e-4, atol=1e-5) for n, v in single.items()
    )


@pytest.mark.usefixtures("hydra_conf")
@pytest.mark.parametrize(
    ("preset", "jobs"),
    [
        ("dp_vs_ddp_vs_syncbn", 4),
        ("scaling", 6),
        ("backends_and_init", 6),
        ("allreduce", 6),
        ("sharding", 6),
        ("architectures", 8),
        ("gpt_strategies", 11),
        ("frontier", 14),
        ("long_context", 2),
    ],
)
def test_every_preset_expands_into_its_sweep(preset: str, jobs: int):
    from ddpexp.plan import HostFacts
    from ddpexp.preflight import check_job

    def comp(overrides: list[str]):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)

    _, expanded, varying = expand([f"experiment={preset}"], multirun=True, compose=comp)
    assert len(expanded) == jobs and varying
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    for job in expanded:  # every job of every preset runs on a CPU-only machine
        check_job(comp(job), host, multirun=True)


@pytest.mark.usefixtures("hydra_conf")
def test_a_preset_key_given_on_the_command_line_is_one_job_as_hydra_runs_it():
    """`-m experiment=sharding strategy=zero`: Hydra's sweeper keeps the command line's strategy, so
    pre-flight checks the one job Hydra will run, not one per preset option."""

    def comp(overrides: list[str]):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)

    _, expanded, varying = expand(["experiment=sharding", "strategy=zero"], multirun=True, compose=comp)
    assert [o for o in expanded[0] if o.startswith("strategy=")] == ["strategy=zero"] and len(expanded) == 1
    assert "strategy" not in varying


SHARDING = {  # experiment=sharding's jobs: strategy option -> (strategy, the settings that differ)
    "ddp": ("ddp", {}),
    "zero": ("zero", {}),
    "fsdp": ("fsdp", {}),
    "fsdp_no_reshard": ("fsdp", {"reshard_after_forward": False}),
    "ddp_bf16": ("ddp", {"comm_hook": "bf16"}),
    "ddp_powersgd": ("ddp", {"comm_hook": "powersgd"}),
}


def _strategy_preset(name: str) -> tuple[Any, list[list[str]], list[str]]:
    """A preset that sweeps strategy variants only: (compose, its jobs' overrides, the variants)."""

    def comp(overrides: list[str]):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)

    _, expanded, varying = expand([f"experiment={name}"], multirun=True, compose=comp)
    assert varying == {"strategy"}
    options = [o.removeprefix("strategy=") for job in expanded for o in job if o.startswith("strategy=")]
    return comp, expanded, options


@pytest.mark.usefixtures("hydra_conf")
def test_sharding_preset_runs_each_variant_on_the_same_resnet_and_batch_and_labels_them_apart():
    """Composition only: six jobs, one per strategy variant, ResNet-18 on CIFAR-shaped synthetic data
    at one global batch; the settings each run records (facts.strategy_settings, from
    Strategy.changed_settings) give six labels."""
    comp, expanded, options = _strategy_preset("sharding")
    assert options == list(SHARDING)
    labels = set()
    for job, option in zip(expanded, options, strict=True):
        cfg = comp(job)
        strategy, settings = SHARDING[option]
        assert cfg.strategy.name == strategy
        assert strategies.resolve(cfg.strategy).changed_settings() == settings
        assert cfg.model._target_ == "ddpexp.models.resnet.resnet18" and not cfg.model.cifar_stem
        assert (cfg.data._target_, list(cfg.data.shape)) == ("ddpexp.data.synthetic.synthetic", [3, 32, 32])
        assert (cfg.trainer.batch_size, cfg.trainer.batch_per_rank, cfg.trainer.accumulate) == (64, None, 1)
        labels.add(strategy_label({"strategy": strategy, "strategy_settings": settings}))
    assert labels == {
        "ddp",
        "zero",
        "fsdp",
        "fsdp reshard_after_forward=false",
        "ddp comm_hook=bf16",
        "ddp comm_hook=powersgd",
    }


ARCHITECTURES = {  # experiment=architectures' jobs: option -> (strategy, settings that differ, world size)
    "ddp": ("ddp", {}, 2),
    "naive_allreduce": ("naive_allreduce", {}, 2),
    "naive_allreduce_ring": ("naive_allreduce", {"algorithm": "ring"}, 2),
    "ps": ("ps", {}, 3),
    "ps_async": ("ps", {"mode": "async"}, 3),
    "ddp_mp": ("ddp_mp", {}, 2),
    "pipeline": ("pipeline", {}, 2),
    "pipeline_1f1b": ("pipeline", {"schedule": "1f1b"}, 2),
}


@pytest.mark.usefixtures("hydra_conf")
def test_architectures_preset_runs_each_variant_on_the_same_convnet_and_batch_and_labels_them_apart():
    """Composition only: eight jobs, one per strategy variant, the BatchNorm-free ConvNet on digits at
    one global batch on a CPU (ps: a server and two workers); eight distinct labels in the report."""
    from ddpexp.plan import HostFacts
    from ddpexp.preflight import check_job

    comp, expanded, options = _strategy_preset("architectures")
    assert options == list(ARCHITECTURES)
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    labels = set()
    for job, option in zip(expanded, options, strict=True):
        cfg = comp(job)
        strategy, settings, world = ARCHITECTURES[option]
        assert cfg.strategy.name == strategy
        assert strategies.resolve(cfg.strategy).changed_settings() == settings
        assert cfg.model._target_ == "ddpexp.models.convnet.convnet" and cfg.model.batch_norm is False
        assert cfg.data._target_ == "ddpexp.data.digits.digits"
        plan = check_job(cfg, host, multirun=True)
        assert (plan.world_size, plan.global_batch) == (world, 64)
        labels.add(strategy_label({"strategy": strategy, "strategy_settings": settings}))
    assert labels == {
        "ddp",
        "naive_allreduce",
        "naive_allreduce algorithm=ring",
        "ps",
        "ps mode=async",
        "ddp_mp",
        "pipeline",
        "pipeline schedule=1f1b",
    }


GPT_STRATEGIES = {  # experiment=gpt_strategies' jobs: option -> (strategy, settings that differ, world size)
    "single": ("single", {}, 1),
    "ddp": ("ddp", {}, 2),
    "zero": ("zero", {}, 2),
    "fsdp": ("fsdp", {}, 2),
    "fsdp_no_reshard": ("fsdp", {"reshard_after_forward": False}, 2),
    "ddp_bf16": ("ddp", {"comm_hook": "bf16"}, 2),
    "naive_allreduce": ("naive_allreduce", {}, 2),
    "pipeline": ("pipeline", {}, 2),
    "pipeline_1f1b": ("pipeline", {"schedule": "1f1b"}, 2),
    "ps": ("ps", {}, 3),
    "ddp_mp": ("ddp_mp", {}, 2),
}


@pytest.mark.usefixtures("hydra_conf")
def test_gpt_strategies_preset_runs_every_strategy_on_gpt_small_and_the_stdlib_at_one_batch():
    """Composition only: eleven jobs, one per strategy variant, gpt_small on the standard library's
    source (task=lm, AdamW) at one global batch of 16 windows, 2 ranks (ps: 2 workers + its server);
    eleven distinct labels in the report. trainer.repeats=2 runs them in two rounds."""
    from ddpexp.plan import HostFacts
    from ddpexp.preflight import check_job, with_repeats

    comp, expanded, options = _strategy_preset("gpt_strategies")
    assert options == list(GPT_STRATEGIES)
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    labels = set()
    for job, option in zip(expanded, options, strict=True):
        cfg = comp(job)
        strategy, settings, world = GPT_STRATEGIES[option]
        assert cfg.strategy.name == strategy
        assert strategies.resolve(cfg.strategy).changed_settings() == settings
        assert (cfg.model._target_, cfg.model.n_layer, cfg.model.dim) == ("ddpexp.models.gpt.gpt", 4, 256)
        assert cfg.data._target_ == "ddpexp.data.python_stdlib.python_stdlib" and cfg.data.block_size == 128
        assert (cfg.task._target_, cfg.optim.name) == ("ddpexp.tasks.LanguageModel", "adamw")
        plan = check_job(cfg, host, multirun=True)
        assert (plan.world_size, plan.global_batch) == (world, 16)
        labels.add(strategy_label({"strategy": strategy, "strategy_settings": settings}))
    assert len(labels) == len(GPT_STRATEGIES)
    _, rounds, _ = expand(
        with_repeats(["experiment=gpt_strategies", "trainer.repeats=2"], multirun=True),
        multirun=True,
        compose=comp,
    )
    assert [(job[0], job[1].removeprefix("strategy=")) for job in rounds] == [
        (f"repeat={r}", option) for r in range(2) for option in GPT_STRATEGIES
    ]


PARALLELISMS = {  # experiment=parallelisms' jobs: option -> (strategy, settings that differ)
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "nd_2d": ("nd", {"tp": 2}),
    "nd_2d_sp": ("nd", {"tp": 2, "sequence_parallel": True}),
    "nd_hsdp": ("nd", {"dp_replicate": 2}),
    "nd_pp_tp": ("nd", {"pp": 2, "tp": 2}),
    "nd_pp_fsdp": ("nd", {"pp": 2}),
}


@pytest.mark.usefixtures("hydra_conf")
def test_parallelisms_preset_runs_each_mesh_on_gpt_small_at_world_4_and_one_batch():
    """Composition only: one job per mesh (with ddp and fsdp beside them), gpt_small on the standard
    library's source at one global batch of 16 windows, 4 ranks each, every mesh the issue lists at
    world 4 (dp_shard x tp, with sequence parallelism, HSDP, pp x tp, pp x dp_shard), each label apart."""
    from ddpexp.plan import HostFacts
    from ddpexp.preflight import check_job

    comp, expanded, options = _strategy_preset("parallelisms")
    assert options == list(PARALLELISMS)
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    labels, meshes = set(), set()
    for job, option in zip(expanded, options, strict=True):
        cfg = comp(job)
        strategy, settings = PARALLELISMS[option]
        resolved = strategies.resolve(cfg.strategy)
        assert (cfg.strategy.name, resolved.changed_settings()) == (strategy, settings)
        assert (cfg.model.n_layer, cfg.model.dim, cfg.task._target_) == (4, 256, "ddpexp.tasks.LanguageModel")
        plan = check_job(cfg, host, multirun=True)
        assert (plan.world_size, plan.global_batch) == (4, 16)
        labels.add(strategy_label({"strategy": strategy, "strategy_settings": settings}))
        if strategy == "nd":
            d = resolved.degrees(4)
            meshes.add((d.dp_replicate, d.dp_shard, d.tp, d.pp))
    assert len(labels) == len(PARALLELISMS)
    assert meshes == {(1, 2, 2, 1), (2, 2, 1, 1), (1, 1, 2, 2), (1, 2, 1, 2)}


MOE_LAYOUTS = {  # experiment=moe's jobs: option -> (strategy, settings that differ)
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "nd_ep": ("nd", {"ep": 2}),
    "nd_ep4": ("nd", {"ep": 4}),
    "nd_pp_ep": ("nd", {"pp": 2, "ep": 2}),
    "nd_ep_tp": ("nd", {"ep": 2, "tp": 2, "sequence_parallel": True}),
}


@pytest.mark.usefixtures("hydra_conf")
def test_moe_preset_runs_the_mixture_of_experts_under_data_and_expert_parallelism_at_world_4():
    """Composition only: gpt_moe_small (8 experts, top-2) at one global batch on 4 ranks under ddp,
    fsdp, ep 2 and ep 4 over dp_shard 4, pp 2 x dp_shard 2 x ep 2, and dp_shard 2 x ep 2 x tp 2, each
    passing pre-flight."""
    from ddpexp.plan import HostFacts
    from ddpexp.preflight import check_job

    comp, expanded, options = _strategy_preset("moe")
    assert options == list(MOE_LAYOUTS)
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    meshes = set()
    for job, option in zip(expanded, options, strict=True):
        cfg = comp(job)
        strategy, settings = MOE_LAYOUTS[option]
        resolved = strategies.resolve(cfg.strategy)
        assert (cfg.strategy.name, resolved.changed_settings()) == (strategy, settings)
        assert (cfg.model.moe.experts, cfg.model.moe.top_k) == (8, 2)
        plan = check_job(cfg, host, multirun=True)
        assert (plan.world_size, plan.global_batch) == (4, 16)
        if strategy == "nd":
            d = resolved.degrees(4)
            meshes.add((d.pp, d.dp_shard, d.tp, resolved.settings.ep))
    assert meshes == {(1, 4, 1, 2), (1, 4, 1, 4), (2, 2, 1, 2), (1, 2, 2, 2)}


def test_report_shows_the_pipeline_bubble_and_ps_staleness_only_for_the_runs_that_log_them(tmp_path: Path):
    """Fabricated runs (metrics.json only, with the columns each strategy declares, as a run records
    them): pipeline runs show their last epoch's measured bubble next to the textbook one, ps async its
    staleness mean/max; every other run shows "-" there."""
    from ddpexp import strategies

    finals = {
        "strategy=pipeline": {"pipe/bubble_frac": 0.6912, "pipe/bubble_frac_textbook": 0.2},
        "strategy=pipeline_1f1b": {"pipe/bubble_frac": 0.65, "pipe/bubble_frac_textbook": 0.2},
        "strategy=ps_async": {"ps/staleness_mean": 0.981, "ps/staleness_max": 2.0},
        "strategy=ps": {},
        "strategy=ddp": {},
    }
    for name, final in finals.items():
        (tmp_path / name).mkdir()
        strategy = name.removeprefix("strategy=").split("_")[0]
        columns = [c.to_dict() for c in strategies.get(strategy).report_columns]
        facts = {"strategy": strategy, "strategy_columns": columns}
        (tmp_path / name / "metrics.json").write_text(
            json.dumps({"status": "completed", "facts": facts, "final": final, "best": {}, "history": []})
        )
    report.main([str(tmp_path)])
    lines = (tmp_path / "report.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| run |")).strip("| ").split(" | ")
    table = {
        row.split(" | ")[0].removeprefix("| "): dict(zip(header, row.strip("| ").split(" | "), strict=True))
        for row in lines
        if row.startswith("| strategy=")
    }
    bubble, staleness = "bubble: measured/textbook", "staleness: mean/max"
    assert {name: (row[bubble], row[staleness]) for name, row in table.items()} == {
        "strategy=pipeline": ("0.69/0.20", "-"),
        "strategy=pipeline_1f1b": ("0.65/0.20", "-"),
        "strategy=ps_async": ("-", "0.98/2"),
        "strategy=ps": ("-", "-"),
        "strategy=ddp": ("-", "-"),
    }


def test_report_labels_strategy_variants_apart_and_shows_bytes_and_memory(tmp_path: Path):
    """Fabricated runs (metrics.json only): the strategy column names each variant's settings, and the
    table carries comm bytes per step and memory per category next to accuracy."""
    runs = {
        "strategy=fsdp": ({"strategy": "fsdp", "strategy_settings": {}}, 0.5),
        "strategy=fsdp_no_reshard": (
            {"strategy": "fsdp", "strategy_settings": {"reshard_after_forward": False}},
            0.5,
        ),
        "strategy=ddp_bf16": ({"strategy": "ddp", "strategy_settings": {"comm_hook": "bf16"}}, 1.0),
        "strategy=ddp_sync_bn": (
            {"strategy": "ddp", "sync_bn": True, "strategy_settings": {"sync_bn": True}},
            1.0,
        ),
        "strategy=ddp": ({"strategy": "ddp", "sync_bn": False}, 1.0),  # written before strategy_settings
    }
    for name, (facts, share) in runs.items():
        final = {
            "eval/acc": 0.25,
            "comm/bytes_per_step": 22_000_000.0,
            "mem/params_mb": 42.6 * share,
            "mem/grads_mb": 42.6 * share,
            "mem/optim_state_mb": 42.6 * share,
        }
        if name.startswith("strategy=fsdp"):
            final["mem/activations_mb"] = 3.5
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(
            json.dumps({"status": "completed", "facts": facts, "final": final, "best": final, "history": []})
        )
    report.main([str(tmp_path)])
    lines = (tmp_path / "report.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| run |")).strip("| ").split(" | ")
    table = {
        row.split(" | ")[0].removeprefix("| "): dict(zip(header, row.strip("| ").split(" | "), strict=True))
        for row in lines
        if row.startswith("| strategy=")
    }
    assert {name: row["strategy"] for name, row in table.items()} == {
        "strategy=fsdp": "fsdp",
        "strategy=fsdp_no_reshard": "fsdp reshard_after_forward=false",
        "strategy=ddp_bf16": "ddp comm_hook=bf16",
        "strategy=ddp_sync_bn": "ddp +syncbn",
        "strategy=ddp": "ddp",
    }
    assert table["strategy=fsdp"]["comm bytes/step"] == "22,000,000"
    assert table["strategy=fsdp"]["per rank MB: params/grads/optim/act"] == "21.30/21.30/21.30/3.50"
    # a run recorded before activations were measured
    assert table["strategy=ddp"]["per rank MB: params/grads/optim/act"] == "42.60/42.60/42.60/-"
    assert table["strategy=ddp"]["final"] == "25.00%"


def test_report_refuses_a_directory_without_runs(tmp_path: Path):
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    assert exit_info.value.code == 2


@pytest.mark.multiproc
def test_distributed_evaluation_equals_single_scoring_the_saved_model(preset_sweep: Path, tmp_path: Path):
    """With BatchNorm and no sync_bn each rank's running statistics drift apart; they are made equal
    (rank 0's, which model.pt holds) before every evaluation and save, so the run's own eval/loss is
    what `single` measures on model.pt, for every strategy (the preset sweep's, plus the other two)."""
    result = run_here(
        tmp_path, "-m", "strategy=naive_allreduce,ddp_mp", "model=convnet", *SHORT, "hydra.sweep.dir=more"
    )
    assert result.returncode == 0, result
    runs = [preset_sweep / s for s in JOBS] + [
        tmp_path / "more" / f"strategy={s}" for s in ("naive_allreduce", "ddp_mp")
    ]
    for run in runs:
        scored = run_here(
            tmp_path,
            "strategy=single",
            "model=convnet",
            *SHORT,
            "trainer.mode=eval",
            f'trainer.resume="{run / "model.pt"}"',
            f"hydra.run.dir=eval-{run.name.replace('=', '-')}",
        )
        assert scored.returncode == 0, scored
        ours = metrics(run)["final"]
        theirs = metrics(tmp_path / f"eval-{run.name.replace('=', '-')}")["final"]
        assert ours["eval/acc"] == theirs["eval/acc"], run.name
        assert ours["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-6, abs=0), run.name


def test_hparams_view_shows_what_the_sweep_varies_and_every_run_with_its_status(tmp_path: Path, monkeypatch):
    """TensorBoard's HParams view, read back with tensorboard's own reader: written at the start (a run
    that fails still shows, with its status), `differs` (what TensorBoard puts first and ticks) set on
    what the sweep varies plus strategy, world size, sync_bn and threads only, metrics with the report's
    definitions."""
    from tensorboard.plugins.hparams import api_pb2, metadata

    monkeypatch.chdir(tmp_path)
    results = ddpexp.sweep([*QUICK, "trainer.max_steps=4", "optim.lr=0.05,1e10", "hydra.sweep.dir=sweep"])
    by_lr = {r.facts["lr"]: r for r in results}
    assert by_lr[0.05].status == "completed" and by_lr[1e10].status == "failed"  # NaN loss
    for lr, result in by_lr.items():
        acc = _accumulator(result.run_dir)
        content = acc.PluginTagToContent("hparams")
        experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
        shown = {h.name for h in experiment.hparam_infos if h.differs}
        assert shown == {"strategy", "world_size", "sync_bn", "threads", "optim.lr"}, shown
        assert {"backend", "global_batch_size", "model", "threads"} <= {
            h.name for h in experiment.hparam_infos
        }
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        assert (
            start.hparams["optim.lr"].number_value == lr
            and start.hparams["strategy"].string_value == "single"
        )
        end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
        assert end.status == (api_pb2.STATUS_SUCCESS if lr == 0.05 else api_pb2.STATUS_FAILURE)
    scalars = _accumulator(by_lr[0.05].run_dir).Scalars
    history = metrics(by_lr[0.05].run_dir)["history"]
    assert scalars("perf/samples_per_s")[-1].value == pytest.approx(history[-1]["perf/samples_per_s"])
    assert scalars("eval/acc")[-1].value == pytest.approx(100 * history[-1]["eval/acc"])  # in %
    assert scalars("mem/peak_mb")[-1].value == pytest.approx(history[-1]["mem/peak_mb"])


@pytest.mark.parametrize("preset", [False, True], ids=["command line", "preset"])
def test_repeats_take_turns(tmp_path: Path, monkeypatch, preset: bool):
    """trainer.repeats=N runs the sweep N times in rounds, every job once per round, as bench.py's
    variants take turns: a drift in the machine's speed then slows every strategy alike, instead of all
    N repeats of whichever strategy ran while it lasted. Also when a preset sets the sweep
    (hydra.sweeper.params, which Hydra would otherwise put outermost)."""
    monkeypatch.chdir(tmp_path)
    sweep = ["experiment=one_process"] if preset else ["strategy=single,dp"]  # tests/conf/experiment
    results = ddpexp.sweep(
        [*sweep, *QUICK, "trainer.max_steps=1", "trainer.repeats=2", "hydra.sweep.dir=s"],
        config_dir=str(REPO / "tests" / "conf"),
    )
    order = [(r.facts["repeat"], r.facts["strategy"]) for r in results]
    assert order == [(0, "single"), (0, "dp"), (1, "single"), (1, "dp")], order


def test_repeats_run_each_job_n_times_and_the_report_pools_them(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = ddpexp.sweep([*QUICK, "trainer.max_steps=3", "trainer.repeats=3", "hydra.sweep.dir=sweep"])
    assert sorted(r.facts["repeat"] for r in results) == [0, 1, 2]
    assert sorted(r.run_dir.name for r in results) == ["repeat=0", "repeat=1", "repeat=2"]
    assert all(r.status == "completed" and r.facts["seed"] == 0 for r in results)  # the same job again
    (group,) = report.group_runs(report.find_runs([tmp_path / "sweep"]))
    (row,) = group.rows
    assert len(row.runs) == 3


@pytest.mark.usefixtures("hydra_conf")
def test_frontier_preset_runs_fp8_and_bf16_under_fsdp_offload_and_every_schedule():
    """Composition only: each of fsdp, fsdp_offload and the five pipeline schedules in bf16 and in fp8,
    gpt_small at one global batch on 2 ranks (the pipelines as 2 stages), every job passing pre-flight
    on this CPU-only host."""
    from ddpexp.plan import HostFacts
    from ddpexp.preflight import check_job

    def comp(overrides: list[str]):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)

    _, expanded, varying = expand(["experiment=frontier"], multirun=True, compose=comp)
    assert varying == {"strategy", "trainer.precision"}
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    seen = set()
    for job in expanded:
        cfg = comp(job)
        plan = check_job(cfg, host, multirun=True)
        assert (plan.world_size, plan.global_batch, cfg.model.n_layer) == (2, 16, 4)
        resolved = strategies.resolve(cfg.strategy)
        schedule = str(cfg.strategy.get("schedule", "")) or None
        offload = getattr(resolved.settings, "offload", False)
        seen.add((resolved.name, offload, schedule, Precision.of(cfg.trainer.precision).name))
    schedules = {s for _, _, s, _ in seen if s}
    assert schedules == {"1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"}
    assert {("fsdp", True, None, "fp8"), ("fsdp", False, None, "bf16")} <= seen
    assert len(seen) == 14


@pytest.mark.usefixtures("hydra_conf")
def test_long_context_preset_splits_each_sequence_over_a_ring_or_not_at_one_batch():
    """Composition only: fsdp and nd_cp (cp 2, FSDP over both ranks) on gpt_small at 1,024 tokens a
    sequence, one global batch of 8 sequences on 2 ranks, both passing pre-flight here."""
    from ddpexp.plan import HostFacts
    from ddpexp.preflight import check_job

    def comp(overrides: list[str]):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)

    _, expanded, varying = expand(["experiment=long_context"], multirun=True, compose=comp)
    assert varying == {"strategy"}
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    cps = []
    for job in expanded:
        cfg = comp(job)
        plan = check_job(cfg, host, multirun=True)
        assert (plan.world_size, plan.global_batch, cfg.model.block_size, cfg.data.block_size) == (
            2,
            8,
            1024,
            1024,
        )
        cps.append(getattr(strategies.resolve(cfg.strategy).settings, "cp", 1))
    assert cps == [1, 2]

"""Comparing strategies: a preset sweep gives one TensorBoard run per job with scalars and hparams
together, communication is measured, and the report turns the sweep into a table and plots whose
numbers are the runs' own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddpexp import report
from ddpexp.composition import expand

from .conftest import PARITY, metrics, run_here

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
            "hparams/final_eval_acc",
        } <= tags
        assert ("comm/share" in tags) == job.startswith("strategy=ddp")
        hp = acc.PluginTagToContent("hparams")
        assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= hp.keys()
        facts = metrics(preset_sweep / job)["facts"]
        assert facts["model"] == "convnet" and facts["global_batch_size"] == 64
        assert facts["devices"] == (2 if job.startswith("strategy=ddp") else 1)
    assert metrics(preset_sweep / "strategy=ddp_sync_bn")["facts"]["sync_bn"] is True


@pytest.mark.multiproc
def test_report_has_a_row_per_job_plots_and_the_runs_own_numbers(preset_sweep: Path):
    script = Path(sys.executable).parent / "ddpexp-report"  # the console script users run
    proc = subprocess.run(
        [str(script), str(preset_sweep), "--target", "0.5"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    stdout = proc.stdout
    text = (preset_sweep / "report.md").read_text()
    for job in JOBS:
        assert f"| {job} |" in text and job in stdout
    for png in ("acc_vs_time.png", "loss_vs_step.png", "throughput.png", "scaling.png"):
        assert (preset_sweep / png).stat().st_size > 5000
    runs = {r.name: r for r in report.find_runs([preset_sweep])}
    table = {row[0]: row for row in report.rows(list(runs.values()), 0.5)}
    for job in JOBS:
        m = metrics(preset_sweep / job)
        row = table[job]
        assert row[5] == f"{100 * m['final']['eval/acc']:.2f}%"
        assert row[6] == f"{100 * m['best']['eval/acc']:.2f}%"
        per_epoch = [e.value for e in _accumulator(preset_sweep / job).Scalars("perf/samples_per_s")]
        assert [h["perf/samples_per_s"] for h in m["history"]] == pytest.approx(per_epoch, rel=1e-6)
        assert row[8] == f"{sum(per_epoch[1:]) / len(per_epoch[1:]):,.0f}"
        if job == "strategy=ddp":
            shares = [e.value for e in _accumulator(preset_sweep / job).Scalars("comm/share")]
            assert row[11] == f"{100 * sum(shares) / len(shares):.2f}%"
            assert 0 < shares[-1] < 1 and m["final"]["comm/bytes_per_step"] > 0


@pytest.mark.multiproc
def test_report_marks_a_crashed_job_instead_of_breaking(preset_sweep: Path, tmp_path: Path):
    copy = tmp_path / "sweep"
    shutil.copytree(preset_sweep, copy, ignore=shutil.ignore_patterns("*.png", "report.md", "*.pt"))
    killed = copy / "strategy=ddp"  # killed hard: status still "running", event file cut short
    m = json.loads((killed / "metrics.json").read_text())
    m["status"] = "running"
    (killed / "metrics.json").write_text(json.dumps(m))
    (events,) = killed.glob("events.out.tfevents.*")
    events.write_bytes(events.read_bytes()[:200])
    failed = copy / "strategy=dp"
    (failed / "metrics.json").write_text(
        json.dumps({"status": "failed", "facts": {"strategy": "dp"}, "error": "x"})
    )
    report.main([str(copy)])
    text = (copy / "report.md").read_text()
    assert "| strategy=ddp | incomplete |" in text and "| strategy=dp | failed |" in text
    assert "| strategy=single | completed |" in text


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
    [("dp_vs_ddp_vs_syncbn", 4), ("scaling", 6), ("backends_and_init", 6), ("allreduce", 6)],
)
def test_every_preset_expands_into_its_sweep(preset: str, jobs: int):
    from ddpexp.preflight import check_job
    from ddpexp.validate import HostFacts

    def comp(overrides: list[str]):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)

    _, expanded, varying = expand([f"experiment={preset}"], multirun=True, compose=comp)
    assert len(expanded) == jobs and varying
    host = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)
    for job in expanded:  # every job of every preset runs on a CPU-only machine
        check_job(comp(job), host, multirun=True)


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

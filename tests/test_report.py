"""The report answers "which strategy, and at what cost" without flattering anyone: runs are grouped by
(model, data, global batch), measured against their group's `single` run, repeats pooled with their
spread, and every reason to distrust a number (impossible efficiency, oversubscription, no baseline,
load from others, jobs that overlapped) named in the table and on stdout. All on fabricated runs:
metrics.json files, and a few TensorBoard events where time matters."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpexp import report
from ddpexp.report import cli as report_cli
from ddpexp.report import plots as report_plots
from ddpexp.report import scaling_plot
from ddpexp.report.table import COLUMNS

from .conftest import QUICK, run_here

T0 = 1_800_000_000.0  # job start of the first fabricated job (epoch seconds)
GAP_S = 10.0  # between one job's end and the next one's start


@pytest.fixture(autouse=True)
def _no_plots(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing four PNGs takes ~1 s a report: only the test about plots draws them."""
    if "plots" not in request.node.name:
        monkeypatch.setattr(report_cli, "plots", lambda *args, **kwargs: [])


def fabricate(
    root: Path,
    name: str,
    *,
    strategy: str = "single",
    devices: int = 1,
    samples_per_s: float = 100.0,
    start: float = T0,
    job_s: float = 30.0,
    final_acc: float = 0.9,
    reached_at: float | None = None,
    **facts: Any,
) -> Path:
    """One completed run: metrics.json whose history gives `samples_per_s` after a warm-up epoch; with
    `reached_at`, an event file whose eval/acc first reaches 0.96 that many seconds after the job start."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    all_facts = {
        "strategy": strategy,
        "strategy_settings": {},
        "devices": devices,
        "world_size": devices,
        "nprocs_per_node": devices,
        "replicas": devices,
        "model": "mlp",
        "data": "synthetic",
        "global_batch_size": 64,
        "per_rank_batch_size": 64 // devices,
        "device_type": "cpu",
        "backend": None if strategy in ("single", "dp") else "gloo",
        "best_metric": "eval/acc",
        "best_mode": "max",
        "seed": 0,
        "host": "vm",
        "host_cpus": 4,
        "threads": 1,
        "job_started_at": start,
        "job_ended_at": start + job_s,
        "load_avg_start": 0.5,
        "load_avg_end": 1.0,
        **facts,
    }
    history = [{"epoch": 1, "perf/samples_per_s": 1.0}, {"epoch": 2, "perf/samples_per_s": samples_per_s}]
    final = {"epoch": 2, "eval/acc": final_acc}
    metrics = {
        "status": "completed",
        "started_at": start + 5.0,  # the recorder starts after spawn and start-up
        "wall_s": job_s - 6.0,
        "time_to_first_step_s": 7.0,
        "facts": {k: v for k, v in all_facts.items() if v != "absent"},
        "final": final,
        "best": final,
        "history": history,
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    if reached_at is not None:
        write_events(run_dir, [(0.5, 10, start + reached_at / 2), (0.96, 20, start + reached_at)])
    return run_dir


def write_events(run_dir: Path, points: list[tuple[float, int, float]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir))
    for value, step, wall in points:
        writer.add_scalar("eval/acc", value, global_step=step, walltime=wall)
        writer.add_scalar("train/loss", 1.0 / step, global_step=step, walltime=wall)
    writer.close()


def sweep(root: Path, jobs: list[tuple[str, dict[str, Any]]]) -> Path:
    """Jobs one after the other on one host, GAP_S apart (as a sequential sweep runs them)."""
    start = T0
    for name, settings in jobs:
        settings = {"start": start, **settings}
        fabricate(root, name, **settings)
        start = settings["start"] + settings.get("job_s", 30.0) + GAP_S
    return root


def run_report(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report.main(list(args))
    return out.getvalue()


def md_tables(text: str) -> dict[str, dict[str, str]]:
    """report.md's rows (every group's) by run name, each as {column: cell}."""
    rows, header = {}, list(COLUMNS)
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if line.startswith("| run |"):
            header = cells  # COLUMNS, then the columns the group's strategies declare
        elif line.startswith("| ") and not line.startswith("|---"):
            row = dict(zip(header, cells, strict=True))
            rows[row["run"]] = row
    return rows


# A sequential sweep on 2 cores, every job keeping both busy for 120 s: the 1-minute load climbs to
# about 2 during a job, and the next job starts with most of it still there (decaying over the 10 s gap).
CLEAN_LOAD = {"host_cpus": 2, "job_s": 120.0, "load_avg_end": 2.0}
CLEAN = [
    ("strategy=single", {"samples_per_s": 100.0, "threads": 2, "load_avg_start": 0.3, **CLEAN_LOAD}),
    (
        "strategy=dp",
        {"strategy": "dp", "samples_per_s": 98.0, "threads": 2, "load_avg_start": 1.7, **CLEAN_LOAD},
    ),
    (
        "strategy=ddp",
        {"strategy": "ddp", "devices": 2, "samples_per_s": 160.0, "load_avg_start": 1.7, **CLEAN_LOAD},
    ),
]


def test_groups_by_model_data_and_batch_and_never_share_a_baseline(tmp_path: Path):
    sweep(
        tmp_path,
        [
            ("model=mlp,strategy=single", {"samples_per_s": 100.0}),
            ("model=mlp,strategy=ddp", {"strategy": "ddp", "devices": 2, "samples_per_s": 160.0}),
            ("model=convnet,strategy=single", {"model": "convnet", "samples_per_s": 50.0}),
            (
                "model=convnet,strategy=ddp",
                {"model": "convnet", "strategy": "ddp", "devices": 2, "samples_per_s": 90.0},
            ),
            (
                "batch=128,strategy=ddp",
                {"strategy": "ddp", "devices": 2, "samples_per_s": 300.0, "global_batch_size": 128},
            ),
        ],
    )
    stdout = run_report(str(tmp_path))
    text = (tmp_path / "report.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert [h.split(" — ")[0] for h in headings] == [
        "## convnet on synthetic, global batch 64",
        "## mlp on synthetic, global batch 64",
        "## mlp on synthetic, global batch 128",
    ]
    rows = md_tables(text)
    assert rows["model=mlp,strategy=ddp"]["scaling eff."] == "0.80"  # 160/2 over mlp's single 100
    assert rows["model=convnet,strategy=ddp"]["scaling eff."] == "0.90"  # 90/2 over convnet's 50, not 100
    assert rows["batch=128,strategy=ddp"]["scaling eff."] == "-"  # no single at batch 128: none borrowed
    assert "mlp on synthetic, global batch 128: no baseline" in stdout


def test_the_baseline_is_single_even_when_a_one_device_dp_is_faster(tmp_path: Path):
    sweep(
        tmp_path,
        [
            ("strategy=dp", {"strategy": "dp", "samples_per_s": 103.0}),
            ("strategy=single", {"samples_per_s": 100.0}),
        ],
    )
    run_report(str(tmp_path))
    rows = md_tables((tmp_path / "report.md").read_text())
    assert (rows["strategy=single"]["scaling eff."], rows["strategy=single"]["vs baseline"]) == (
        "1.00",
        "baseline",
    )
    assert (rows["strategy=dp"]["scaling eff."], rows["strategy=dp"]["vs baseline"]) == (
        "1.03",
        "1.03x faster (n=1)",
    )
    run_report(str(tmp_path), "--baseline", "dp")  # named: a strategy label (or a run's name)
    rows = md_tables((tmp_path / "report.md").read_text())
    assert (rows["strategy=dp"]["vs baseline"], rows["strategy=single"]["scaling eff."]) == (
        "baseline",
        "0.97",
    )


def _repeats(root: Path) -> Path:
    jobs = []
    for seed, (single, ddp, acc, reached, job_s) in enumerate(
        [(100.0, 150.0, 0.90, 25.0, 30.0), (104.0, 160.0, 0.92, 27.0, 32.0), (110.0, 190.0, 0.94, 35.0, 40.0)]
    ):
        jobs.append(
            (f"seed={seed},strategy=single", {"samples_per_s": single, "seed": seed, "reached_at": 20.0})
        )
        ddp_job = {"strategy": "ddp", "devices": 2, "samples_per_s": ddp, "seed": seed, "final_acc": acc}
        jobs.append((f"seed={seed},strategy=ddp", {**ddp_job, "reached_at": reached, "job_s": job_s}))
    return sweep(root, jobs)


def test_repeats_are_one_row_with_median_range_and_mean_std(tmp_path: Path):
    _repeats(tmp_path)
    stdout = run_report(str(tmp_path), "--target", "0.95")
    rows = md_tables((tmp_path / "report.md").read_text())
    assert sorted(rows) == ["strategy=ddp", "strategy=single"]
    ddp = rows["strategy=ddp"]
    assert ddp["n"] == "3"
    assert ddp["samples/s"] == "160 (150–190)"
    assert ddp["final"] == "92.00% ± 2.00"  # mean ± sample std, in percentage points
    # From the job's start (the recorder started 5 s later): 25, 27, 35 s, not 20, 22, 30.
    assert ddp["time to target (s)"] == "27.0 (25.0–35.0)"
    assert ddp["job time (s)"] == "32.0 (30.0–40.0)"  # job_ended_at - job_started_at
    assert ddp["train time (s)"] == "26.0 (24.0–34.0)"  # wall_s
    assert ddp["scaling eff."] == f"{160 / 2 / 104:.2f}"  # from medians
    assert ddp["vs baseline"] == "1.54x faster"  # ranges 150–190 and 100–110 do not overlap
    assert "strategy=ddp" in stdout and "160 (150–190)" in stdout


def test_ranges_that_overlap_are_no_measurable_difference(tmp_path: Path):
    jobs = []
    for seed, (single, dp, ddp) in enumerate(
        [(100.0, 105.0, 180.0), (110.0, 115.0, 190.0), (120.0, 125.0, 200.0)]
    ):
        jobs += [
            (f"seed={seed},strategy=single", {"samples_per_s": single, "seed": seed}),
            (f"seed={seed},strategy=dp", {"strategy": "dp", "samples_per_s": dp, "seed": seed}),
            (
                f"seed={seed},strategy=ddp",
                {"strategy": "ddp", "devices": 2, "samples_per_s": ddp, "seed": seed},
            ),
        ]
    sweep(tmp_path, jobs)
    run_report(str(tmp_path))
    rows = md_tables((tmp_path / "report.md").read_text())
    assert rows["strategy=dp"]["vs baseline"] == "no measurable difference"  # 105–125 overlaps 100–120
    assert rows["strategy=ddp"]["vs baseline"] == "1.73x faster"  # 190 / 110; 180–200 clear of 100–120


def _warning_cases() -> dict[str, tuple[list[tuple[str, dict[str, Any]]], str, str]]:
    """name → (jobs, the row that is warned, a piece of the warning's text)."""
    single = ("strategy=single", {"samples_per_s": 100.0})
    return {
        "efficiency above 1.05": (
            [single, ("strategy=ddp", {"strategy": "ddp", "devices": 2, "samples_per_s": 230.0})],
            "strategy=ddp",
            "scaling efficiency 1.15 > 1.05 cannot be real: the baseline was probably slowed by other load",
        ),
        "oversubscribed": (
            [
                single,
                ("strategy=ddp", {"strategy": "ddp", "devices": 2, "samples_per_s": 160.0, "threads": 4}),
            ],
            "strategy=ddp",
            "oversubscribed: 2 processes x 4 threads = 8 busy threads on 4 cores",
        ),
        "a session per process": (
            [
                (single[0], {**single[1], "autogroup": True, "sessions": 1}),
                (
                    "strategy=ddp",
                    {
                        "strategy": "ddp",
                        "devices": 2,
                        "samples_per_s": 160.0,
                        "autogroup": True,
                        "sessions": 2,
                    },
                ),
            ],
            "strategy=ddp",
            "its 2 processes had a session each (torchrun starts workers so)",
        ),
        "spinning threads": (
            [
                (single[0], {**single[1], "wait_policy": "default", "threads": 2}),
                (
                    "strategy=ddp",
                    {"strategy": "ddp", "devices": 2, "samples_per_s": 160.0, "wait_policy": "passive"},
                ),
            ],
            "strategy=single",
            "its OpenMP threads spin while they wait",
        ),
        "no baseline": (
            [("strategy=ddp", {"strategy": "ddp", "devices": 2, "samples_per_s": 160.0})],
            "",
            "mlp on synthetic, global batch 64: no baseline (no completed one-process run)",
        ),
        "load changed": (
            [
                single,
                (
                    "strategy=ddp",
                    {"strategy": "ddp", "devices": 2, "samples_per_s": 160.0, "load_avg_end": 3.9},
                ),
            ],
            "strategy=ddp",
            "load changed during the run: 1-min load 0.5 at the start, 3.9 at the end",
        ),
        "busy at the start": (
            [
                single,
                (
                    "strategy=ddp",
                    {
                        "strategy": "ddp",
                        "devices": 2,
                        "samples_per_s": 160.0,
                        "load_avg_start": 3.9,
                        "load_avg_end": 3.9,
                    },
                ),
            ],
            "strategy=ddp",
            "host busy at the start: 1-min load 3.9",
        ),
        "overlapped": (  # the real case: a sweep under a parallel launcher
            [
                ("strategy=single", {"samples_per_s": 61.0}),
                (
                    "strategy=ddp",
                    {"strategy": "ddp", "devices": 2, "samples_per_s": 1752.0, "start": T0 + 2.0},
                ),
            ],
            "strategy=single",
            "ran at the same time as strategy=ddp on host vm (up to 28 s of its 30 s)",
        ),
        "overlapped in containers": (  # two containers of one machine: host names differ, the kernel not
            [
                ("strategy=single", {"samples_per_s": 61.0, "host": "box-a", "machine": "boot-1"}),
                (
                    "strategy=ddp",
                    {
                        "strategy": "ddp",
                        "devices": 2,
                        "samples_per_s": 1752.0,
                        "start": T0 + 2.0,
                        "host": "box-b",
                        "machine": "boot-1",
                    },
                ),
            ],
            "strategy=single",
            "ran at the same time as strategy=ddp on one machine (host names box-a, box-b)",
        ),
    }


def test_jobs_at_the_same_time_on_two_machines_of_one_name_did_not_overlap(tmp_path: Path):
    """Containers named alike on different machines (a cluster's default host name) share nothing."""
    single = ("strategy=single", {"samples_per_s": 100.0, "machine": "boot-1"})
    ddp = ("strategy=ddp", {"strategy": "ddp", "devices": 2, "samples_per_s": 160.0, "start": T0 + 2.0})
    sweep(tmp_path, [single, (ddp[0], {**ddp[1], "machine": "boot-2"})])
    assert "ran at the same time" not in run_report(str(tmp_path))


@pytest.mark.parametrize("case", list(_warning_cases()))
def test_each_warning_is_in_the_table_and_on_stdout(tmp_path: Path, case: str):
    jobs, warned, text = _warning_cases()[case]
    sweep(tmp_path, jobs)
    stdout = run_report(str(tmp_path))
    md = (tmp_path / "report.md").read_text()
    (line,) = [line for line in stdout.splitlines() if text in line]
    number = re.match(r"warning \[(\d+)\]: ", line)
    assert number, line
    assert f"- [{number[1]}] warning: " in md and text in md
    if warned:
        assert f"[{number[1]}]" in md_tables(md)[warned]["warnings"].split()


def test_a_clean_sweep_has_no_warning(tmp_path: Path):
    sweep(tmp_path, CLEAN)
    stdout = run_report(str(tmp_path))
    assert "warning" not in stdout
    rows = md_tables((tmp_path / "report.md").read_text())
    assert {row["warnings"] for row in rows.values()} == {"-"}
    assert rows["strategy=ddp"]["scaling eff."] == "0.80"


def test_the_report_says_what_the_runs_ran_on_and_that_dp_on_cpu_is_one_replica(tmp_path: Path):
    sweep(tmp_path, CLEAN)
    stdout = run_report(str(tmp_path))
    assert (
        "mlp on synthetic, global batch 64 — CPU, gloo, 2 cores on host vm; baseline: strategy=single"
        in stdout
    )
    assert "note: strategy=dp: dp had 1 replica: on CPU DataParallel runs one replica" in stdout
    rows = md_tables((tmp_path / "report.md").read_text())
    ddp = rows["strategy=ddp"]
    assert (ddp["device"], ddp["backend"], ddp["procs/host"], ddp["threads"], ddp["replicas"]) == (
        "cpu",
        "gloo",
        "2",
        "1",
        "2",
    )


def test_job_time_without_job_ended_at_is_the_recorders_close_minus_the_job_start(tmp_path: Path):
    fabricate(tmp_path, "strategy=single", job_ended_at="absent")  # started_at = start + 5, wall_s = 24
    fabricate(tmp_path, "older", job_ended_at="absent", job_started_at="absent")
    run_report(str(tmp_path))
    rows = md_tables((tmp_path / "report.md").read_text())
    assert rows["strategy=single"]["job time (s)"] == "29.0"
    assert rows["older"]["job time (s)"] == "31.0"  # time_to_first_step_s + wall_s


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_csv_and_json_hold_one_record_per_row_with_numbers(tmp_path: Path, fmt: str):
    _repeats(tmp_path)
    run_report(str(tmp_path), "--format", fmt, "--target", "0.95")
    path = tmp_path / f"report.{fmt}"
    assert not (tmp_path / "report.md").exists()
    if fmt == "json":
        records = {r["run"]: r for r in json.loads(path.read_text())}
        assert isinstance(records["strategy=ddp"]["samples_per_s_median"], float)
    else:
        with path.open() as f:
            cells = {r["run"]: r for r in csv.DictReader(f)}
        assert (cells["strategy=ddp"]["samples_per_s_median"], cells["strategy=ddp"]["n"]) == ("160.0", "3")
        records = {name: {k: _parse(v) for k, v in r.items()} for name, r in cells.items()}
    ddp = records["strategy=ddp"]
    assert (ddp["model"], ddp["global_batch_size"], ddp["n"]) == ("mlp", 64, 3)
    assert (ddp["samples_per_s_median"], ddp["samples_per_s_min"], ddp["samples_per_s_max"]) == (
        160,
        150,
        190,
    )
    assert ddp["final_mean"] == pytest.approx(0.92) and ddp["final_std"] == pytest.approx(0.02)
    assert ddp["time_to_target_s_median"] == pytest.approx(27.0, abs=1e-3)
    assert ddp["scaling_efficiency"] == pytest.approx(160 / 2 / 104)
    assert ddp["vs_baseline"] == "1.54x faster" and ddp["baseline"] == "strategy=single"
    assert records["strategy=single"]["job_time_s_median"] == 30


def _parse(cell: str) -> Any:
    try:
        return int(cell)
    except ValueError:
        pass
    try:
        return float(cell)
    except ValueError:
        return cell


def test_plots_show_percent_a_target_line_integer_device_ticks_and_predictions(tmp_path: Path):
    _repeats(tmp_path)
    run_report(str(tmp_path), "--target", "0.95")
    for png in ("acc_vs_time.png", "loss_vs_step.png", "throughput.png", "scaling.png"):
        assert (tmp_path / png).stat().st_size > 5000
    groups = report.group_runs(report.find_runs([tmp_path]))
    palette = report_plots.colours(groups)
    assert palette == {
        "ddp": pytest.approx((0.1216, 0.4667, 0.7059, 1.0), abs=1e-3),
        "single": pytest.approx((1.0, 0.498, 0.0549, 1.0), abs=1e-3),
    }

    from matplotlib.container import ErrorbarContainer

    (ax,) = report_plots.accuracy_figure(groups, palette=palette, title="t", target=0.95).axes
    assert ax.get_ylabel() == "eval accuracy (%)"
    target = [line for line in ax.get_lines() if line.get_label() == "target 95%"]
    assert target and list(target[0].get_ydata()) == [95.0, 95.0]
    assert max(max(line.get_ydata()) for line in ax.get_lines()) == pytest.approx(96.0)  # in %, not 0.96

    (ax,) = report_plots.throughput_figure(groups, palette=palette, title="t").axes
    assert {t.get_text() for t in ax.texts} == {"160 (n=3)", "104 (n=3)"}
    spans = {
        tuple(segment[:, 0])
        for bar in ax.containers
        if isinstance(bar, ErrorbarContainer)
        for segment in bar.lines[2][0].get_segments()
    }
    assert spans == {(150, 190), (100, 110)}  # min-max of the repeats

    predicted = {"ddp": [(4, 0.7), (1, 1.0), (2, 0.8)]}
    (ax,) = scaling_plot.scaling_figure(groups, palette=palette, title="t", predicted=predicted).axes
    assert list(ax.get_xticks()) == [1, 2, 4]
    (line,) = [line for line in ax.get_lines() if line.get_label() == "ddp (predicted)"]
    assert line.get_linestyle() == "--" and line.get_color() == palette["ddp"]
    assert list(line.get_xdata()) == [1, 2, 4]
    assert (
        scaling_plot.plot_scaling(groups, tmp_path / "predicted.png", predicted=predicted)
        == tmp_path / "predicted.png"
    )


def test_a_sweep_ends_with_the_report_command_for_its_directory_and_that_command_works(tmp_path: Path):
    """The last line of `python -m ddpexp -m ...` is the report command for the sweep's own (dated)
    directory; run as printed, in the same directory, it writes the report there."""
    swept = run_here(tmp_path, "-m", *QUICK, "trainer.max_steps=1", "trainer.epochs=1", "seed=0,1")
    assert swept.returncode == 0, swept.stderr
    last = swept.stdout.strip().splitlines()[-1]
    assert last.startswith("report: ddpexp-report multirun/"), swept.stdout
    argv = shlex.split(last.removeprefix("report: "))
    assert (tmp_path / argv[1]).is_dir() and len(list((tmp_path / argv[1]).glob("*/metrics.json"))) == 2
    module = [sys.executable, "-m", "ddpexp.report", *argv[1:]]  # the script, without relying on PATH
    done = subprocess.run(module, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / argv[1] / "report.md").is_file()
    # Two seeds of one configuration are one row (n 2), or two where a fact such as the threads a
    # loaded host left them differs: either way the report ends by naming its file.
    assert done.stdout.strip().splitlines()[-1] == f"report: {argv[1]}/report.md", done.stdout


def sections(text: str) -> dict[str, str]:
    """report.md by section: heading (up to " — ") → its text."""
    parts = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    return {part.splitlines()[0].split(" — ")[0]: part for part in parts}


def _scaling_sweep(root: Path, weak4: float = 320.0) -> Path:
    """experiment=scaling: ddp on 1, 2, 4 processes at global batch 64 (strong) and at 32 per rank
    (weak: global batch 32, 64, 128); no `single` run."""
    jobs = []
    for devices, strong, weak in ((1, 100.0, 90.0), (2, 160.0, 170.0), (4, 240.0, weak4)):
        for per_rank, speed in ((None, strong), (32, weak)):
            batch = 64 if per_rank is None else 32 * devices
            settings = {"strategy": "ddp", "devices": devices, "samples_per_s": speed}
            settings |= {"global_batch_size": batch, "per_rank_batch_size": batch // devices}
            name = f"dist.nprocs={devices},trainer.batch_per_rank={'null' if per_rank is None else per_rank}"
            jobs.append((name, settings))
    return sweep(root, jobs)


def test_scaling_compares_strong_against_the_one_process_run_and_weak_scaling_on_its_own(tmp_path: Path):
    _scaling_sweep(tmp_path)
    stdout = run_report(str(tmp_path))
    assert "no baseline" not in stdout, stdout
    text = (tmp_path / "report.md").read_text()
    parts = sections(text)
    strong = parts["mlp on synthetic, global batch 64"]
    assert "baseline: dist.nprocs=1,trainer.batch_per_rank=null" in strong.splitlines()[0]
    assert "| dist.nprocs=4,trainer.batch_per_rank=null | completed | ddp dist.nprocs=4 " in strong
    assert f"| {240 / 4 / 100:.2f} |" in strong  # 4 processes: 60 per device over the one process's 100
    assert "compared in weak scaling" in parts["mlp on synthetic, global batch 128"]
    weak = parts["mlp on synthetic, 32 samples per rank (weak scaling)"]
    rows = [line.strip("| ").split(" | ") for line in weak.splitlines() if line.startswith("| dist.")]
    assert [(r[2], r[3], r[-1]) for r in rows] == [
        ("1", "32", "baseline"),
        ("2", "64", f"{170 / 2 / 90:.2f}"),
        ("2", "64", f"{160 / 2 / 90:.2f}"),  # the strong run at 2 processes has 32 per rank too
        ("4", "128", f"{320 / 4 / 90:.2f}"),
    ]
    groups = report.group_runs(report.find_runs([tmp_path]))
    fig = scaling_plot.scaling_figure(groups, palette=report_plots.colours(groups), title="t")
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 2 and titles[0].startswith("strong scaling: mlp on synthetic, global batch 64")
    assert titles[1].startswith("mlp on synthetic, 32 samples per rank (weak scaling)")
    # --predict with nothing to predict (global batch 32 has its one-process run only): no empty panel
    palette = report_plots.colours(groups)
    fig = scaling_plot.scaling_figure(groups, palette=palette, title="t", predicted=lambda group: {})
    assert [ax.get_title() for ax in fig.axes] == titles


def test_an_impossible_efficiency_is_marked_where_it_is_drawn(tmp_path: Path):
    _scaling_sweep(tmp_path, weak4=4 * 90 * 3.79)
    groups = report.group_runs(report.find_runs([tmp_path]))
    fig = scaling_plot.scaling_figure(groups, palette=report_plots.colours(groups), title="t")
    strong, weak = fig.axes
    assert not strong.texts
    assert [t.get_text() for t in weak.texts] == ["ddp trainer.batch_per_rank=32: 3.79 impossible"]
    (marked,) = weak.collections[-1:]  # a red ring around the point, its own marker inside
    assert list(marked.get_offsets()[0]) == pytest.approx([4, 3.79])
    assert "impossible" in marked.get_label()
    run_report(str(tmp_path))
    assert f"| {3.79:.2f} (impossible) |" in (tmp_path / "report.md").read_text()


def _labelled(tmp_path: Path) -> list[Any]:
    sweep(
        tmp_path,
        [
            ("strategy=single", {"reached_at": 20.0}),
            ("strategy=ddp_sync_bn", {"strategy": "ddp", "devices": 2, "sync_bn": True, "reached_at": 20.0}),
            ("strategy=ddp,trainer.threads=1", {"strategy": "ddp", "devices": 2, "reached_at": 20.0}),
            (
                "strategy=ddp,trainer.threads=2",
                {"strategy": "ddp", "devices": 2, "threads": 2, "reached_at": 20.0},
            ),
        ],
    )
    return report.group_runs(report.find_runs([tmp_path]))


def test_one_label_per_row_in_the_table_and_every_plot(tmp_path: Path):
    groups = _labelled(tmp_path)
    run_report(str(tmp_path))
    rows = md_tables((tmp_path / "report.md").read_text())
    labels = {row["strategy"] for row in rows.values()}
    assert labels == {"single", "ddp +syncbn", "ddp trainer.threads=1", "ddp trainer.threads=2"}
    palette = report_plots.colours(groups)
    acc = report_plots.accuracy_figure(groups, palette=palette, title="t", target=0.95).axes[0]
    assert set(acc.get_legend_handles_labels()[1]) == labels | {"target 95%"}
    loss = report_plots.loss_figure(groups, palette=palette, title="t").axes[0]
    assert {label.split(" (identical")[0] for label in loss.get_legend_handles_labels()[1]} == labels
    tput = report_plots.throughput_figure(groups, palette=palette, title="t").axes[0]
    assert {t.get_text() for t in tput.get_yticklabels()} == labels
    scaling = scaling_plot.scaling_figure(groups, palette=palette, title="t").axes[0]
    assert set(scaling.get_legend_handles_labels()[1]) - {"linear scaling"} <= labels


def test_coincident_loss_curves_are_each_visible_and_the_legend_says_identical(tmp_path: Path):
    """Equal strategies (the point of parity) draw the same loss curve: every curve keeps a marker of
    its own, where the others leave it visible, and the legend names the curve it repeats; the loss
    axis is logarithmic, so the later steps are not a flat line at the bottom."""
    from torch.utils.tensorboard import SummaryWriter

    names = ("strategy=ddp", "strategy=fsdp", "strategy=single", "strategy=zero")
    for name in names:
        run_dir = fabricate(tmp_path, name, strategy=name.split("=")[1], devices=1 if "single" in name else 2)
        writer = SummaryWriter(log_dir=str(run_dir))
        for step in range(1, 41):
            writer.add_scalar("train/loss", 2.0 / step, global_step=step, walltime=T0 + step)
        writer.close()
    groups = report.group_runs(report.find_runs([tmp_path]))
    ax = report_plots.loss_figure(groups, palette=report_plots.colours(groups), title="t").axes[0]
    lines = [line for line in ax.get_lines() if line.get_label() in ax.get_legend_handles_labels()[1]]
    assert len(lines) == 4
    assert (
        len({line.get_marker() for line in lines} - {"None", "", None}) == 4
    )  # a marker each, all different
    assert len({line.get_markevery() for line in lines}) == 4  # at steps of their own
    assert len({line.get_markersize() for line in lines}) == 4  # rings around the later ones
    identical = [line.get_label() for line in lines if "identical to" in line.get_label()]
    assert identical == ["fsdp (identical to ddp)", "single (identical to ddp)", "zero (identical to ddp)"]
    assert ax.get_yscale() == "log"


def test_throughput_mentions_repeats_only_when_there_are_some_and_many_rows_keep_a_readable_legend(
    tmp_path: Path,
):
    strategies = ("single", "dp", "ddp", "fsdp", "zero", "naive_allreduce", "ps", "ddp_mp")
    for k, name in enumerate(strategies):
        fabricate(tmp_path, f"strategy={name}", strategy=name, devices=1 if k < 2 else 2, reached_at=20.0 + k)
    groups = report.group_runs(report.find_runs([tmp_path]))
    palette = report_plots.colours(groups)
    fig = report_plots.throughput_figure(groups, palette=palette, title="t")
    assert "repeats" not in fig._suptitle.get_text()
    fig = report_plots.accuracy_figure(groups, palette=palette, title="t", target=0.95)
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # beside the curves, not over them
    assert min(text.get_fontsize() for text in legend.get_texts()) >= 8
    assert (
        "repeats"
        in report_plots.throughput_figure(
            report.group_runs(report.find_runs([_repeats(tmp_path / "r")])), palette=palette, title="t"
        )._suptitle.get_text()
    )


def test_identical_predictions_are_one_line_that_names_them(tmp_path: Path):
    _repeats(tmp_path)
    groups = report.group_runs(report.find_runs([tmp_path]))
    same = [(1, 1.0), (2, 0.8), (4, 0.7)]
    predicted = {"ddp": same, "ddp +syncbn": same, "fsdp": [(1, 1.0), (2, 0.75)]}
    (ax,) = scaling_plot.scaling_figure(
        groups, palette=report_plots.colours(groups), title="t", predicted=predicted
    ).axes
    shown = [line.get_label() for line in ax.get_lines() if "predicted" in line.get_label()]
    assert shown == ["ddp, ddp +syncbn (predicted, identical)", "fsdp (predicted)"]


def test_tensorboard_opens_on_what_is_compared_in_percent_without_constant_charts(tmp_path: Path):
    """Scalars: eval/ first (accuracy in %, as the console and the report show it), communication's
    share beside the throughput, no chart of what is constant over a run (bytes per step, resident
    memory, eval samples: one text table instead) and no one-point hparams/ charts; HParams ticks
    threads, and its metrics are the charts' own tags. The report still reads the accuracy right."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    from ddpexp.recorder import Recorder

    facts = {"strategy": "ddp", "world_size": 2, "threads": 1, "accumulate": 1, "job_started_at": T0}
    recorder = Recorder(tmp_path, facts=facts, progress=False)
    recorder.start()
    constant = {"comm/bytes_per_step": 116_536.0, "comm/bytes_per_step/gradients": 116_136.0}
    constant |= {"mem/params_mb": 0.11, "mem/activations_mb": 0.5, "eval/samples": 360.0}
    for epoch, acc in ((1, 0.9), (2, 0.97)):
        values = {"eval/acc": acc, "eval/loss": 0.3, "train/epoch_loss": 0.4, "perf/samples_per_s": 900.0}
        values |= {"comm/share": 0.25, "comm/time_per_step_s": 0.001, "mem/peak_mb": 300.0, **constant}
        recorder.epoch(epoch=epoch, epochs=2, step=10 * epoch, values=values)
    recorder.close("completed")
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    assert tags[:2] == ["eval/acc", "eval/loss"], tags
    assert [e.value for e in acc.Scalars("eval/acc")] == pytest.approx([90.0, 97.0])
    assert {"perf/comm_share", "perf/comm_time_per_step_s", "mem/peak_mb"} <= set(tags)
    constant_tags = ("comm/", "hparams/", "eval/samples", "mem/params", "mem/activations")
    assert not [t for t in tags if t.startswith(constant_tags)], tags
    assert acc.Scalars("summary/best_eval_acc")[0].value == pytest.approx(97.0)
    assert "run/constants/text_summary" in acc.Tags()["tensors"]
    content = acc.PluginTagToContent("hparams")
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    ticked = {h.name for h in experiment.hparam_infos if h.differs}
    assert "threads" in ticked and "accumulate" not in ticked
    metrics = {m.name.tag for m in experiment.metric_infos}
    assert "eval/acc" in metrics and metrics <= set(tags), metrics
    (run,) = report.find_runs([tmp_path])
    assert [v for _, v, _ in run.scalars["eval/acc"]] == pytest.approx([0.9, 0.97])  # back to fractions


def test_plots_of_loss_vs_cost_set_strategies_side_by_side_at_equal_tokens_and_equal_bytes(tmp_path: Path):
    """Runs that communicate differently (every step, every H steps): the bytes each rank sent in the run
    (comm/bytes_per_step x each epoch's steps) in the table and the records, and loss_vs_cost.png, whose
    panels put the training loss against the tokens trained on and against the bytes sent by then."""
    per_step = {"ddp": 4e6, "local_sgd": 1e6}
    for k, (strategy, nbytes) in enumerate(per_step.items()):
        run_dir = fabricate(
            tmp_path,
            f"strategy={strategy}",
            strategy=strategy,
            devices=2,
            start=T0 + 100 * k,
            tokens_per_sample=8,
        )
        m = json.loads((run_dir / "metrics.json").read_text())
        m["history"] = [  # 10 steps, then 10 more; single's measured nothing
            {"epoch": 1, "step": 10, "comm/bytes_per_step": nbytes, "perf/samples_per_s": 1.0},
            {"epoch": 2, "step": 20, "comm/bytes_per_step": nbytes, "perf/samples_per_s": 100.0},
        ]
        m["final"] |= m["history"][-1]
        (run_dir / "metrics.json").write_text(json.dumps(m))
        write_events(run_dir, [(0.5, step, T0 + step) for step in (5, 10, 15, 20)])
    fabricate(tmp_path, "strategy=single", start=T0 + 300)
    run_report(str(tmp_path))
    rows = md_tables((tmp_path / "report.md").read_text())
    assert [rows[f"strategy={s}"]["bytes moved (MB)"] for s in ("ddp", "local_sgd", "single")] == [
        "80.0",
        "20.0",
        "-",
    ]
    (record,) = [
        r
        for r in report.records(report.group_runs(report.find_runs([tmp_path])), 0.9)
        if r["strategy"] == "local_sgd"
    ]
    assert record["bytes_moved"] == 20e6
    assert (tmp_path / "loss_vs_cost.png").stat().st_size > 5000

    groups = report.group_runs(report.find_runs([tmp_path]))
    fig = report_plots.cost_figure(groups, palette=report_plots.colours(groups), title="t")
    by_tokens, by_bytes = fig.axes
    assert by_tokens.get_xlabel() == "tokens trained on" and by_bytes.get_xscale() == "log"
    lines = {line.get_label(): line for line in by_bytes.get_lines()}
    assert sorted(lines) == ["ddp", "local_sgd"]  # single measured no bytes
    assert list(lines["local_sgd"].get_xdata()) == [5e6, 10e6, 15e6, 20e6]
    assert list(lines["ddp"].get_xdata()) == [20e6, 40e6, 60e6, 80e6]
    tokens = {line.get_label(): list(line.get_xdata()) for line in by_tokens.get_lines()}
    assert tokens["ddp"] == tokens["local_sgd"] == [step * 64 * 8 for step in (5, 10, 15, 20)]
    assert list(lines["ddp"].get_ydata()) == pytest.approx([1 / 5, 1 / 10, 1 / 15, 1 / 20])
    # nothing measured, nothing drawn
    alone = report.group_runs(report.find_runs([tmp_path / "strategy=single"]))
    assert alone and report_plots.cost_figure(alone, palette=report_plots.colours(alone), title="t") is None

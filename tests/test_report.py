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
from pathlib import Path
from typing import Any

import pytest

from ddpexp import report
from ddpexp.report import cli as report_cli
from ddpexp.report import plots as report_plots
from ddpexp.report.table import COLUMNS

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
            "mlp on synthetic, global batch 64: no baseline (no completed `single` run)",
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
    (ax,) = report_plots.scaling_figure(groups, palette=palette, title="t", predicted=predicted).axes
    assert list(ax.get_xticks()) == [1, 2, 4]
    (line,) = [line for line in ax.get_lines() if line.get_label() == "ddp (predicted)"]
    assert line.get_linestyle() == "--" and line.get_color() == palette["ddp"]
    assert list(line.get_xdata()) == [1, 2, 4]
    assert (
        report_plots.plot_scaling(groups, tmp_path / "predicted.png", predicted=predicted)
        == tmp_path / "predicted.png"
    )

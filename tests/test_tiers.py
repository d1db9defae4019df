"""The fast tier (tests/tiers.py): chosen from the measured record, within its budget, the same set
whatever is run, and a record that `--record-durations` keeps; and every test's margin under its
timeout, from the same record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from .conftest import REPO
from .tiers import FAST_BUDGET_S, TIMEOUT_SHARE, at_risk, fast_tier, file_seconds, load_record, recorded_s


def entry(call: float, setup: float = 0.0, fixtures: list[str] | None = None) -> dict:
    return {"setup": setup, "call": call, "teardown": 0.0, "fixtures": fixtures or []}


def test_the_tier_takes_the_cheapest_tests_that_fit_the_budget() -> None:
    record = {
        "t::slow": entry(8.0),
        "t::quick": entry(1.0),
        "t::middle": entry(3.0, setup=1.0),
        "t::a": entry(2.0),
    }
    assert fast_tier(record, budget=7.0) == {"t::quick", "t::a", "t::middle"}
    assert fast_tier(record, budget=6.9) == {"t::quick", "t::a"}
    assert fast_tier(record, budget=0.5) == set()


def test_a_shared_fixture_is_counted_once_at_what_its_first_user_paid() -> None:
    """Tests that share a training run made once (a session fixture) look free in the record but for the
    one that made it; in the tier, whichever runs first pays again. They come in together or not at all."""
    trained = ["trained"]
    record = {
        "t::made_it": entry(0.1, setup=40.0, fixtures=trained),
        "t::reads_it": entry(0.1, fixtures=trained),
        "t::reads_it_too": entry(0.2, fixtures=trained),
        "t::plain": entry(5.0),
    }
    assert fast_tier(record, budget=10.0) == {"t::plain"}
    assert fast_tier(record, budget=46.0) == set(record)


def test_the_tier_is_the_same_whatever_is_collected() -> None:
    """`pytest -m fast tests/test_x.py` runs test_x's share of the whole tier, not a tier of its own."""
    tier = fast_tier(load_record(), FAST_BUDGET_S)
    one_file = {nodeid for nodeid in tier if nodeid.startswith("tests/test_cli.py::")}
    assert one_file and len(tier) > len(one_file)


def test_the_recorded_tier_fits_its_budget_and_spans_the_suite() -> None:
    record = load_record()
    tier = fast_tier(record, FAST_BUDGET_S)
    spent = sum(recorded_s(record[nodeid]) for nodeid in tier)
    assert spent <= FAST_BUDGET_S
    files = {nodeid.split("::")[0] for nodeid in record}
    assert len({nodeid.split("::")[0] for nodeid in tier}) >= 0.6 * len(files)


def test_record_durations_merges_each_tests_phases_and_shared_fixtures(tmp_path: Path) -> None:
    """Through pytest-xdist, as `make durations` records: the workers' reports carry each test's broad
    fixtures to the controller, which merges them into the record and keeps the entries it did not run."""
    record = tmp_path / "durations.json"
    record.write_text(json.dumps({"tests/test_gone.py::test_kept": entry(1.5)}))
    unit = "tests/test_tiers.py::test_the_tier_takes_the_cheapest_tests_that_fit_the_budget"
    shared = "tests/test_architecture.py::test_run_returns_the_result_of_a_job_run_in_this_process"
    skipped = "tests/test_gpu.py::test_mixed_precision_on_gpu[bf16]"  # skips without CUDA
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider"),
            *(f"--basetemp={tmp_path / 'base'}", "--record-durations", str(record), unit, shared, skipped),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = load_record(record)
    assert written["tests/test_gone.py::test_kept"] == entry(1.5)
    assert set(written[unit]) == {"setup", "call", "teardown", "fixtures"} and written[unit]["fixtures"] == []
    assert written[shared]["fixtures"] == ["test_architecture.py::single_run"]
    assert written[shared]["setup"] > written[unit]["setup"]  # it trained the shared run
    assert torch.cuda.is_available() or skipped not in written  # a skip here tells nothing of its time


def test_make_test_fast_runs_the_tier_and_nothing_else() -> None:
    """The documented command, collecting instead of running (this environment's Python, no venv made)."""
    proc = subprocess.run(
        [
            "make",
            "test-fast",
            f"PY={sys.executable}",
            "STAMP=",
            "PYTEST_ARGS=--collect-only -q -p no:cacheprovider",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line for line in proc.stdout.splitlines() if "::" in line}
    assert collected and collected <= fast_tier(load_record(), FAST_BUDGET_S)


def test_a_test_that_takes_over_its_share_of_its_timeout_is_named_with_its_numbers() -> None:
    record = {"t::close": entry(160.0, setup=1.0), "t::fine": entry(100.0), "t::new": entry(1.0)}
    timeouts = {"t::close": 300.0, "t::fine": 300.0, "t::unrecorded": 1.0, "t::none": 0.0}
    assert TIMEOUT_SHARE == 0.5
    assert at_risk(record, timeouts) == ["t::close: 161 s recorded of a 300 s timeout"]
    assert at_risk(record, {**timeouts, "t::close": 322.0}) == []


def test_the_suite_runs_longest_file_first_and_every_test_has_a_margin_under_its_timeout() -> None:
    """The suite is collected in the order xdist hands out files: longest first, as recorded. A test that
    took most of its timeout when recorded fails CI on a slower run as if it had hung (the memory
    model's runs, 279 s of 300 when recorded, did). Split such a test, or give it a timeout its work
    needs; the timeouts are as collected now (--show-timeouts), the seconds as recorded."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--show-timeouts"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shown = [line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("timeout ")]
    timeouts = {nodeid: float(seconds) for seconds, nodeid in shown}
    # collected longest file first, as recorded (xdist hands them out in this order)
    files = list(dict.fromkeys(nodeid.split("::")[0] for _, nodeid in shown))
    seconds = file_seconds(load_record())
    assert files[0] == max(seconds, key=seconds.__getitem__)
    assert [seconds.get(f, 0.0) for f in files] == sorted((seconds.get(f, 0.0) for f in files), reverse=True)
    assert (
        len(timeouts) > 1000
        and timeouts["tests/test_tiers.py::test_the_tier_is_the_same_whatever_is_collected"] == 300
    )
    assert at_risk(load_record(), timeouts) == []

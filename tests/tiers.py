"""The fast tier (`pytest -m fast`, `make test-fast`): the tests a developer runs while editing, chosen
from each test's measured seconds (tests/durations.json) so that they fit a budget, cheapest first.

The record is written by `pytest --record-durations tests/durations.json`: a run's setup, call and
teardown seconds per test, merged into the record. A test the record does not hold is not in the tier,
so a new test joins it only once it has been measured. A module- or session-scoped fixture (a shared
training run) is paid by whichever test asks first, so a test's cost counts each such fixture it
needs, at the most any of its users paid to set up, until a test already in the tier has paid it.

The same record orders the suite: pytest-xdist hands out whole files (`--dist loadfile`, Makefile) in
collection order (`--no-loadscope-reorder`), so the files that took longest go first and the short ones
fill in at the end, on whichever worker is free.

And it checks each test's timeout (pytest-timeout's, which catches a hang): a test that takes
more than TIMEOUT_SHARE of its timeout when recorded is one slower CI run away from being killed as
if it had hung (`pytest --collect-only --show-timeouts`, tests/test_tiers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
# Recorded seconds the tier may add up to. The record is taken with 2 xdist workers, so the tier takes
# about half of this on the development VM, plus collection (docs/development.md has the measured time).
FAST_BUDGET_S = 200.0
# The share of its timeout a test may take when recorded: CI's runs of the same suite have taken from
# two thirds to one and a half times the record's seconds.
TIMEOUT_SHARE = 0.5


def load_record(path: Path = DURATIONS) -> dict[str, dict]:
    """node id -> {"setup", "call", "teardown": seconds, "fixtures": the broad fixtures it uses}."""
    return json.loads(path.read_text()) if path.exists() else {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        help="merge each test's setup, call and teardown seconds into PATH (the fast tier's record: "
        "tests/durations.json)",
    )
    parser.addoption(
        "--show-timeouts",
        action="store_true",
        help="print each collected test's node id and timeout in seconds (with --collect-only)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"fast: in the fast tier, chosen from {DURATIONS.name} (tests/tiers.py)"
    )
    path = config.getoption("--record-durations")
    if path and not hasattr(config, "workerinput"):  # the xdist controller, or a run without xdist
        config.pluginmanager.register(Recorder(Path(path)), "ddpexp-durations")


class Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, dict] = {}
        self.untold: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.seconds.setdefault(report.nodeid, {})
        entry[report.when] = round(report.duration, 3)
        entry["fixtures"] = dict(report.user_properties).get("fixtures", [])
        if not report.passed:
            self.untold.add(report.nodeid)

    def pytest_sessionfinish(self) -> None:
        """Merges what passed: a test that failed, was stopped by its timeout or skipped here (a GPU test)
        took no telling time."""
        record = load_record(self.path)
        record.update((nodeid, entry) for nodeid, entry in self.seconds.items() if nodeid not in self.untold)
        lines = (f"{json.dumps(nodeid)}: {json.dumps(entry)}" for nodeid, entry in sorted(record.items()))
        self.path.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # a line per test, for readable diffs


def broad_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures of `item` that outlive it, made once per session or per module and paid by their
    first user: a session's by name, a module's by module and name (each module makes its own)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    found = []
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs or not defs[-1].baseid:  # pytest's and its plugins' own (tmp_path_factory...)
            continue
        if defs[-1].scope == "session":
            found.append(name)
        elif defs[-1].scope in ("module", "package"):
            found.append(f"{item.path.name}::{name}")
    return found


def fast_tier(record: dict[str, dict], budget: float) -> set[str]:
    """The node ids of the cheapest tests whose recorded seconds, each broad fixture counted once, add up
    to `budget` at most: a function of the record alone, so the tier is the same set whatever is run."""
    fixtures = {nodeid: entry.get("fixtures", []) for nodeid, entry in record.items()}
    paid_by_first: dict[str, float] = {}
    for nodeid, entry in record.items():
        for name in fixtures[nodeid]:
            paid_by_first[name] = max(paid_by_first.get(name, 0.0), entry.get("setup", 0.0))

    def own(nodeid: str) -> float:
        entry = record[nodeid]
        setup = 0.0 if fixtures[nodeid] else entry.get("setup", 0.0)
        return setup + entry.get("call", 0.0) + entry.get("teardown", 0.0)

    def alone(nodeid: str) -> float:
        return own(nodeid) + sum(paid_by_first[name] for name in fixtures[nodeid])

    chosen: set[str] = set()
    paid: set[str] = set()
    total = 0.0
    for nodeid in sorted(record, key=lambda nodeid: (alone(nodeid), nodeid)):
        new = [name for name in fixtures[nodeid] if name not in paid]
        cost = own(nodeid) + sum(paid_by_first[name] for name in new)
        if total + cost <= budget:
            chosen.add(nodeid)
            paid.update(new)
            total += cost
    return chosen


def recorded_s(entry: dict) -> float:
    """A test's recorded seconds: setup, call and teardown together, as its timeout counts them."""
    return sum(entry.get(phase, 0.0) for phase in ("setup", "call", "teardown"))


def file_seconds(record: dict[str, dict]) -> dict[str, float]:
    """Each test file's recorded seconds (its path, as node ids begin), all its tests together."""
    seconds: dict[str, float] = {}
    for nodeid, entry in record.items():
        path = nodeid.split("::", 1)[0]
        seconds[path] = seconds.get(path, 0.0) + recorded_s(entry)
    return seconds


def longest_files_first(items: list[pytest.Item], record: dict[str, dict]) -> None:
    """Orders `items` by their file's recorded seconds, longest first; a file's tests stay together and in
    order (a stable sort), and files the record lacks go last."""
    seconds = file_seconds(record)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))


def timeout_s(item: pytest.Item) -> float:
    """The seconds pytest-timeout gives `item`: its closest `timeout` mark's, else --timeout's, else the
    ini's (0: none)."""
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        value = mark.args[0] if mark.args else mark.kwargs.get("timeout", 0)
    else:
        value = item.config.getoption("timeout", None) or item.config.getini("timeout") or 0
    return float(value or 0)


def at_risk(record: dict[str, dict], timeouts: dict[str, float]) -> list[str]:
    """The tests whose recorded seconds exceed TIMEOUT_SHARE of their timeout: one line each, with the
    numbers."""
    found = []
    for nodeid, limit in sorted(timeouts.items()):
        entry = record.get(nodeid)
        if entry is None or limit <= 0:
            continue
        took = recorded_s(entry)
        if took > TIMEOUT_SHARE * limit:
            found.append(f"{nodeid}: {took:.0f} s recorded of a {limit:.0f} s timeout")
    return found


def show_timeouts(items: list[pytest.Item]) -> None:
    """With --show-timeouts, a line per test: `timeout SECONDS NODEID`."""
    if not items or not items[0].config.getoption("--show-timeouts"):
        return
    reporter = items[0].config.pluginmanager.get_plugin("terminalreporter")
    for item in items:
        reporter.write_line(f"timeout {timeout_s(item):g} {item.nodeid}")


def mark_fast(items: list[pytest.Item], record: dict[str, dict]) -> None:
    """Marks the tier's tests, and has each test's report carry its broad fixtures for the record."""
    chosen = fast_tier(record, FAST_BUDGET_S)
    for item in items:
        item.user_properties.append(("fixtures", broad_fixtures(item)))
        if item.nodeid in chosen:
            item.add_marker(pytest.mark.fast)

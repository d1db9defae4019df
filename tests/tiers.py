"""The fast tier (`pytest -m fast`, `make test-fast`): the tests a developer runs while editing, chosen
from each test's measured seconds (tests/durations.json) so that they fit a budget, cheapest first.

The record is written by `pytest --record-durations tests/durations.json`: a run's setup, call and
teardown seconds per test, merged into the record. A test the record does not hold is not in the tier,
so a new test joins it only once it has been measured. A module- or session-scoped fixture (a shared
training run) is paid by whichever test asks first, so a test's cost counts each such fixture it
needs, at the most any of its users paid to set up, until a test already in the tier has paid it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
# Recorded seconds the tier may add up to. The record is taken with 2 xdist workers, so the tier takes
# about half of this on the development VM, plus collection (docs/development.md has the measured time).
FAST_BUDGET_S = 200.0


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


def mark_fast(items: list[pytest.Item]) -> None:
    """Marks the tier's tests, and has each test's report carry its broad fixtures for the record."""
    chosen = fast_tier(load_record(), FAST_BUDGET_S)
    for item in items:
        item.user_properties.append(("fixtures", broad_fixtures(item)))
        if item.nodeid in chosen:
            item.add_marker(pytest.mark.fast)

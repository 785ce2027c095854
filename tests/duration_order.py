"""Test files run heaviest first, by their measured seconds in ``tests/durations.json``.

xdist's ``--dist loadfile`` hands out whole files in collection order (``--no-loadscope-reorder``;
its default orders them by test count, which put the few-test, minutes-long files last, where one
worker ran them while the other had nothing left). Longest files first is the LPT rule: the last
files handed out are the short ones, so the workers end within about one short file of each other.

``pytest --store-durations`` writes each file's seconds (setup, call and teardown of its tests, as
the reports say) into the JSON, keeping the files this run did not measure. A file missing from it
(a new one) weighs the median; stale figures only cost balance, never a test.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load(path: Path = DURATIONS) -> dict[str, float]:
    """``{file nodeid: seconds}``; empty where the file is absent."""
    if not path.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}


def order(items: list, seconds: dict[str, float]) -> list:
    """``items`` grouped by file, the files heaviest first (unknown files weigh the median), each
    file's tests in their collected order; ties keep the collected order of the files."""
    default = statistics.median(seconds.values()) if seconds else 0.0
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_file_of(item.nodeid), len(first_seen))

    def key(item) -> tuple[float, int]:
        name = _file_of(item.nodeid)
        return (-seconds.get(name, default), first_seen[name])

    return sorted(items, key=key)  # stable: a file's tests keep their order


class DurationOrder:
    """The plugin: orders the collection; with ``store`` set, sums each file's report durations
    (on xdist's controller, which sees every worker's reports) and writes them at the end."""

    def __init__(self, store: bool, path: Path = DURATIONS):
        self.store, self.path = store, path
        self.measured: dict[str, float] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list) -> None:
        items[:] = order(items, load(self.path))

    def pytest_runtest_logreport(self, report) -> None:
        if self.store:
            name = _file_of(report.nodeid)
            self.measured[name] = self.measured.get(name, 0.0) + float(report.duration)

    def pytest_sessionfinish(self, session) -> None:
        if not self.store or hasattr(session.config, "workerinput") or not self.measured:
            return
        root = session.config.rootpath
        kept = {k: v for k, v in load(self.path).items() if (root / k).exists()}  # renamed files dropped
        merged = {**kept, **{k: round(v, 1) for k, v in self.measured.items()}}
        ranked = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
        self.path.write_text(json.dumps(ranked, indent=1) + "\n")

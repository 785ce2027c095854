"""The order the test files run in: heaviest first by their measured seconds, each file whole and
in its own order (tests/duration_order.py), and ``--store-durations`` writing the seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

from duration_order import DURATIONS, load, order


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_run_heaviest_first_each_whole_and_in_its_order():
    items = _items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "b.py::t2", "c.py::t2")
    ranked = [i.nodeid for i in order(items, {"a.py": 1.0, "b.py": 30.0, "c.py": 5.0})]
    assert ranked == ["b.py::t1", "b.py::t2", "c.py::t1", "c.py::t2", "a.py::t1", "a.py::t2"]


def test_a_file_not_measured_weighs_the_median_and_ties_keep_the_collected_order():
    items = _items("new.py::t", "light.py::t", "heavy.py::t", "mid.py::t", "twin.py::t")
    seconds = {"light.py": 1.0, "mid.py": 10.0, "heavy.py": 100.0, "twin.py": 10.0}
    ranked = [i.nodeid.split("::")[0] for i in order(items, seconds)]
    assert ranked == ["heavy.py", "new.py", "mid.py", "twin.py", "light.py"]


def test_no_figures_keep_the_collected_order():
    items = _items("z.py::t", "a.py::t", "z.py::u")
    assert [i.nodeid for i in order(items, {})] == ["z.py::t", "z.py::u", "a.py::t"]


def test_the_committed_figures_name_existing_files(request):
    seconds = load(DURATIONS)
    assert seconds, "tests/durations.json is missing or empty"
    root = request.config.rootpath
    assert all((root / name).exists() for name in seconds), [n for n in seconds if not (root / n).exists()]


def test_store_durations_writes_each_files_seconds(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from duration_order import DurationOrder\n"
        "def pytest_configure(config):\n"
        "    config.pluginmanager.register(DurationOrder(True, config.rootpath / 'durations.json'), 'order')\n"
    )
    (tmp_path / "test_slow.py").write_text("import time\ndef test_a():\n    time.sleep(0.3)\n")
    (tmp_path / "test_fast.py").write_text("def test_b():\n    pass\n")
    (tmp_path / "durations.json").write_text(json.dumps({"gone.py": 9.0}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DURATIONS.parent), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=", "-q"]
    run = subprocess.run([*args, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    written = json.loads((tmp_path / "durations.json").read_text())
    assert list(written) == ["test_slow.py", "test_fast.py"]  # ranked; the vanished file dropped
    assert written["test_slow.py"] >= 0.3

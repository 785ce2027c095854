"""Every code block of README.md and docs/*.md marked ``<!-- runnable -->`` (the line before its
fence) runs as written, in a fresh directory: Python in this process (a pipeline joins the
session's Ray), shell with ``bash -euo pipefail`` and the installed ``hpsray`` on the PATH, TOML
validated as a job file. Issue 48: the README's Python example failed as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- runnable -->"
_BLOCK = re.compile(r"^<!-- runnable -->[ \t]*\n```(\w+)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of each block marked runnable in a Markdown text."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(text)]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


BLOCKS = [
    pytest.param(lang, code, id=f"{path.relative_to(ROOT)}#{i}-{lang}")
    for path in documents()
    for i, (lang, code) in enumerate(runnable_blocks(path.read_text()))
]


def test_every_marker_marks_a_block_and_the_readme_has_its_examples():
    """A marker without a fenced block right after it (a typo, a blank line) would drop the
    block from CI silently."""
    for path in documents():
        text = path.read_text()
        markers = sum(1 for line in text.splitlines() if line.strip() == MARKER)
        assert markers == len(runnable_blocks(text)), f"{path}: a {MARKER} line not right before a ``` fence"
    readme = runnable_blocks((ROOT / "README.md").read_text())
    assert [lang for lang, _ in readme] == ["python", "python"]
    assert "Pipeline(" in readme[0][1] and "make_table" in readme[1][1]


def test_the_runner_finds_blocks_and_fails_a_broken_one(tmp_path, monkeypatch):
    text = f"x\n{MARKER}\n```python\nraise SystemExit(3)\n```\nnot marked:\n```python\n1/0\n```\n"
    assert runnable_blocks(text) == [("python", "raise SystemExit(3)\n")]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        run_python(runnable_blocks(text)[0][1], "test")
    with pytest.raises(AssertionError):
        run_shell("false", tmp_path)


def run_python(code: str, name: str) -> None:
    exec(compile(code, name, "exec"), {"__name__": "__main__"})  # noqa: S102 - the documented example itself


def run_shell(code: str, cwd: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def check_toml(code: str, cwd: Path) -> None:
    from hpsray.job import JobConfig

    table = tomllib.loads(code)
    data = table.setdefault("data", {})
    if "paths" not in data and "synthetic" not in data:  # a [data.schema] alone: any file will do
        data["paths"] = ["clicks.csv"]
    JobConfig.from_dict(table, where="block.toml", base_dir=str(cwd))


@pytest.mark.parametrize(("lang", "code"), BLOCKS)
def test_a_runnable_block_runs_as_written(lang, code, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    if lang == "python":
        if "Pipeline(" in code:
            request.getfixturevalue("ray_local")  # the pipeline joins it instead of starting its own
        run_python(code, request.node.name)
    elif lang in ("bash", "sh", "shell"):
        run_shell(code, tmp_path)
    elif lang == "toml":
        check_toml(code, tmp_path)
    else:
        pytest.fail(f"a runnable block in {lang!r}: the runner knows python, bash and toml")

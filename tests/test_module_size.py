"""Small modules with one concept each: a module of hpsray over 500 lines states why in its module
docstring ("Over 500 lines: <reason>"), as ``kernels/cuda/table.py`` does."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hpsray

ROOT = Path(hpsray.__file__).parent
LIMIT = 500
REASON = re.compile(r"Over 500 lines: \S")


def unexplained(sources: dict[str, str]) -> list[str]:
    """The modules of ``sources`` longer than :data:`LIMIT` lines whose docstring gives no reason."""
    out = []
    for where, text in sorted(sources.items()):
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > LIMIT and not REASON.search(ast.get_docstring(ast.parse(text, where)) or ""):
            out.append(f"{where}: {lines} lines")
    return out


def test_no_module_over_500_lines_without_its_reason():
    sources = {str(p.relative_to(ROOT.parent)): p.read_text() for p in ROOT.rglob("*.py")}
    assert not unexplained(sources), "split these modules or state why in their docstring:\n" + "\n".join(
        unexplained(sources)
    )


def test_the_check_counts_lines_and_reads_the_reason():
    long = "\n" * 501
    assert unexplained({"a.py": '"""A."""' + long}) == ["a.py: 501 lines"]
    assert unexplained({"b.py": '"""B.\n\nOver 500 lines: one kernel."""' + long}) == []
    assert unexplained({"c.py": '"""C."""' + "\n" * 498}) == []

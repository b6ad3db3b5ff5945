"""The code's own promises about its shape: functions a reader can see whole, and a
repo that needs nothing beside it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "shared", "yuebing")
MAX_COMPLEXITY = 15
MAX_LINES = 60


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_function_is_too_complex_to_read():
    complex_ = [
        f"{path.relative_to(ROOT)}:{block.lineno} {block.fullname} ({block.complexity})"
        for path in sources()
        for block in cc_visit(path.read_text())
        if block.complexity > MAX_COMPLEXITY
    ]
    assert not complex_, complex_


def test_no_function_is_longer_than_a_screen():
    long_ = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]
    assert not long_, long_


def test_nothing_reads_beside_the_repo():
    # A user clones only the repo: the profile and trace the lab needs ship inside it.
    beside = re.compile(r"\.\./shared|parents\[[2-9]\]\s*/\s*[\"']shared")
    offenders = [str(p.relative_to(ROOT)) for p in sources() + sorted((ROOT / "tests").rglob("*.py"))
                 if p != Path(__file__).resolve() and beside.search(p.read_text())]
    assert not offenders, offenders

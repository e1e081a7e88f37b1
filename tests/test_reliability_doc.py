"""RELIABILITY.md and the tests stay in step.

Every test the table names exists, and every test marked ``@pytest.mark.reliability``
is named in the table: a scenario cannot be listed without a test that runs it, and a
reliability test cannot be added without a row saying what it found.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "RELIABILITY.md"
REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _is_reliability_mark(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "reliability" and ast.unparse(node).endswith("mark.reliability")


def marked_tests() -> set[tuple[str, str]]:
    found = set()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(ROOT).as_posix()
        module_marked = any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
            and "mark.reliability" in ast.unparse(n.value)
            for n in tree.body
        )
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if module_marked or any(_is_reliability_mark(d) for d in node.decorator_list):
                    found.add((rel, node.name))
    return found


def test_every_test_the_table_names_exists():
    refs = REF.findall(DOC.read_text())
    assert len(refs) >= 20
    for rel, name in refs:
        path = ROOT / rel
        assert path.is_file(), f"RELIABILITY.md names {rel}, which does not exist"
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"RELIABILITY.md names {rel}::{name}, which does not exist"


def test_every_reliability_test_is_in_the_table():
    listed = set(REF.findall(DOC.read_text()))
    missing = sorted(f"{rel}::{name}" for rel, name in marked_tests() - listed)
    assert not missing, f"reliability tests missing from RELIABILITY.md: {missing}"


def test_the_table_has_a_row_for_each_scenario_the_issue_names():
    text = DOC.read_text().lower()
    for scenario in (
        "fuzz", "flipped", "truncated", "wrong header", "killed mid-write", "full disk",
        "dies mid-request", "32 threads", "64 concurrent streams", "tenant", "timing side channel",
    ):
        assert scenario in text, f"RELIABILITY.md says nothing about {scenario!r}"

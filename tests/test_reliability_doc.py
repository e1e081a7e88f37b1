"""RELIABILITY.md and the tests stay in step.

Every test the table names exists, and ``pytest -m reliability`` (the command the page
gives) collects exactly the tests the table names: a scenario cannot be listed without
a test that runs it, and a reliability test cannot be added without a row saying what
it found.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "RELIABILITY.md"
REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def table_tests() -> set[str]:
    """``FILE::NAME`` of every test the table names."""
    return {f"{rel}::{name}" for rel, name in REF.findall(DOC.read_text())}


def collected_reliability_tests() -> set[str]:
    """``FILE::NAME`` of every test ``pytest -m reliability`` collects (parameters dropped):
    what the documented command really runs, markers on classes, modules and
    parametrizations included."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "reliability"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"pytest -m reliability does not collect cleanly:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    ids = {line.split("[", 1)[0] for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")}
    assert ids, f"pytest -m reliability collected nothing:\n{proc.stdout[-2000:]}"
    return ids


def test_every_test_the_table_names_exists():
    refs = REF.findall(DOC.read_text())
    assert len(refs) >= 20
    for rel, name in refs:
        path = ROOT / rel
        assert path.is_file(), f"RELIABILITY.md names {rel}, which does not exist"
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"RELIABILITY.md names {rel}::{name}, which does not exist"


def test_pytest_m_reliability_runs_exactly_the_tables_tests():
    listed, collected = table_tests(), collected_reliability_tests()
    unmarked = sorted(listed - collected)
    unlisted = sorted(collected - listed)
    assert not unmarked, f"RELIABILITY.md names tests that `pytest -m reliability` does not run (mark them): {unmarked}"
    assert not unlisted, f"`pytest -m reliability` runs tests RELIABILITY.md does not name (add a row): {unlisted}"


def test_the_table_has_a_row_for_each_scenario_the_issue_names():
    text = DOC.read_text().lower()
    for scenario in (
        "fuzz", "flipped", "truncated", "wrong header", "killed mid-write", "full disk",
        "dies mid-request", "32 threads", "64 concurrent streams", "tenant", "timing side channel",
    ):
        assert scenario in text, f"RELIABILITY.md says nothing about {scenario!r}"

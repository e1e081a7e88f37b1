"""``make bench`` (``run_all``) fails like ``bench assemble --suite`` when a bound breaks."""

from __future__ import annotations

import sys
import types

import promptsplice.benchmarks.assemble as assemble
import promptsplice.benchmarks.run_all as run_all
from promptsplice.benchmarks.bounds import BOUND_EXIT


def test_run_all_exits_non_zero_when_a_policy_beats_its_bound(tmp_path, monkeypatch, capsys):
    """It printed the tables and exited 0 whatever the bound checks said.  A policy below
    its bound cannot be produced by the real code on demand (that is the bug the check
    exists for), so the oracle is inflated here; the latency and dedup benches, which
    have no bounds, are left out."""
    monkeypatch.setattr(assemble, "floor_per_request", lambda content, *streams: 10**9)
    monkeypatch.setitem(sys.modules, "promptsplice.benchmarks.latency", types.SimpleNamespace(run_latency_bench=dict))
    monkeypatch.setitem(sys.modules, "promptsplice.benchmarks.dedup_bench", types.SimpleNamespace(run_dedup_bench=dict))
    assert run_all.main(["--out", str(tmp_path), "--requests", "8"]) == BOUND_EXIT
    assert "promptsplice: error:" in capsys.readouterr().err


def test_run_all_refuses_a_request_count_below_one(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:  # was a traceback after the first table
        run_all.main(["--requests", "0", "--out", "/nonexistent/never-written"])
    assert exc.value.code == 2 and "must be >= 1, got 0" in capsys.readouterr().err

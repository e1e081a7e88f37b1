"""A coding-agent family of agent traces (the format: :mod:`promptsplice.benchmarks.agent_traces`).

Unlike the BFCL family (short API answers, many small calls), a coding agent reads whole
files, greps and runs tests: tool outputs of hundreds of lines, and the harness's
context edits land deep in a long context (an old file read masked with later turns
behind it), which is where relocation should pay.

Shape of a session (:func:`generate_coding_trace`)
---------------------------------------------------
Offline and deterministic for a seed and a Python version: the "repository" is a few
pure-Python modules of the running interpreter's standard library (their real source
text).  A session gets a system prompt, four tools (``read_file``, ``grep``,
``run_tests``, ``edit_file``) and a task naming one target module; the agent then makes
8-12 calls, one per assistant message, each followed by its output, and every model call
is one render:

* ``read_file`` of a 60-180-line window of a module, with line numbers (2-7K characters);
* ``grep`` of a name defined in the target over 2-4 modules: ``path:line: text`` lines;
* ``run_tests``: a unittest-style log, one ``test_<name> ... ok`` line per function of
  the target, one ``FAIL`` with a traceback quoting real source lines;
* ``edit_file``: a one-line answer; sometimes a call fails (a path that does not exist,
  answered with an error) and the harness drops it once the agent retried.

Context edits, drawn from one seeded ``random.Random`` and applied together with the
next call's messages (as a harness does before the next model call); edits persist:

* ``mask``: an old long output (not among the two latest) becomes ``[output omitted]``,
  with later turns behind it (a deep edit);
* ``truncate``: an output over ten lines keeps its first and last four lines around the
  ten-line rule's marker (:class:`promptsplice.assembler.TruncateToolOutputs`' format),
  either the latest output (nothing behind it to relocate) or an older one;
* ``summarize``: the oldest calls and outputs after the task become one summary message
  (:func:`promptsplice.assembler.summarize_turns`), also forced whenever the render
  would exceed the character budget (``max_chars``, 20,000 by default: at most ~7K
  SmolLM2 tokens of code, within the model's 8,192);
* ``drop``: a failed call and its error output, once retried.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
from functools import lru_cache
from pathlib import Path

from promptsplice.benchmarks.agent_traces import MASK_PLACEHOLDER, AgentSession, Message
from promptsplice.errors import AssetError, ConfigError

__all__ = ["CODING_MODULES", "generate_coding_trace"]

CODING_MODULES = (
    "textwrap", "shlex", "fnmatch", "glob", "calendar", "difflib", "heapq", "bisect",
    "csv", "configparser", "argparse", "string", "tokenize", "pprint", "gettext",
)
"""Pure-Python standard-library modules the sessions read (their source ships with Python)."""

_SYSTEM = (
    "You are a careful coding agent working in a Python repository. Use the tools to read "
    "files, search the code and run the tests. Make the smallest change that fixes the "
    "failing test, then run the tests again and report what you changed."
)
_TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read lines of a file in the repository, numbered.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search files for a regular expression; prints path:line: text.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "paths": {"type": "array", "items": {"type": "string"}}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the unit tests of a module and print the log.",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}},
                       "required": ["module"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace one exact snippet of a file by another.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"]}}},
]
_TRUNC_MAX, _TRUNC_KEEP = 10, 4  # TruncateToolOutputs' defaults: 10 lines, 4 kept each side
_SUMMARY_PREFIX = "Summary of the earlier steps:"


@lru_cache(maxsize=None)
def _source(name: str) -> tuple[str, tuple[str, ...], tuple[tuple[str, int], ...]]:
    """``(path, lines, top-level (name, line) definitions)`` of a stdlib module."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise AssetError(f"the standard-library module {name!r} has no Python source here")
    text = Path(spec.origin).read_text(encoding="utf-8")
    defs = []
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs.append((node.name, node.lineno))
            if isinstance(node, ast.ClassDef):
                defs += [(f"{node.name}.{n.name}", n.lineno) for n in node.body if isinstance(n, ast.FunctionDef)]
    return f"Lib/{name}.py", tuple(text.splitlines()), tuple(defs)


def _read(name: str, rng: random.Random) -> tuple[dict, str]:
    path, lines, _ = _source(name)
    n = rng.randint(60, 180)
    start = rng.randint(1, max(1, len(lines) - n))
    end = min(len(lines), start + n - 1)
    body = "\n".join(f"{i:5d}  {lines[i - 1]}" for i in range(start, end + 1))
    return {"path": path, "start": start, "end": end}, f"{path} (lines {start}-{end} of {len(lines)})\n{body}"


def _grep(target: str, others: list[str], rng: random.Random) -> tuple[dict, str]:
    _, _, defs = _source(target)
    word = rng.choice([d for d, _ in defs] or ["def "]).split(".")[-1]
    out, paths = [], []
    for name in [target, *others]:
        path, lines, _ = _source(name)
        paths.append(path)
        out += [f"{path}:{i}: {ln.strip()}" for i, ln in enumerate(lines, 1) if word in ln][:80]
    return {"pattern": word, "paths": paths}, "\n".join(out) or "(no matches)"


def _tests(target: str, rng: random.Random, fail: bool) -> tuple[dict, str]:
    path, lines, defs = _source(target)
    funcs = [d for d in defs if not d[0][:1].isupper() or "." in d[0]][:120] or list(defs)
    out = [f"test_{d.replace('.', '_').lower()} (test_{target}.{target.title()}Tests) ... ok" for d, _ in funcs]
    if fail and funcs:
        k = rng.randrange(len(funcs))
        d, line = funcs[k]
        out[k] = out[k].replace("... ok", "... FAIL")
        quote = "\n".join(f'  File "{path}", line {line + j}, in {d.split(".")[-1]}\n    {lines[line + j - 1].strip()}'
                          for j in range(0, min(3, len(lines) - line)))
        out += ["", "=" * 70, f"FAIL: test_{d.replace('.', '_').lower()} (test_{target}.{target.title()}Tests)",
                "-" * 70, "Traceback (most recent call last):", quote,
                "AssertionError: unexpected result", "", "-" * 70,
                f"Ran {len(funcs)} tests in 0.{rng.randint(100, 999)}s", "", "FAILED (failures=1)"]
    else:
        out += ["", "-" * 70, f"Ran {len(funcs)} tests in 0.{rng.randint(100, 999)}s", "", "OK"]
    return {"module": target}, "\n".join(out)


def _truncate(text: str) -> str:
    lines = text.split("\n")
    if len(lines) <= _TRUNC_MAX:
        return text
    cut = len(lines) - 2 * _TRUNC_KEEP
    return "\n".join(lines[:_TRUNC_KEEP] + [f"[... {cut} lines truncated ...]"] + lines[-_TRUNC_KEEP:])


def _chars(messages: list[Message]) -> int:
    return sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or "")) for m in messages)


def _summary(stretch: list[Message]) -> str:
    calls = [c["function"] for m in stretch for c in m.get("tool_calls") or ()]
    parts = [f"{c['name']}({', '.join(f'{k}={v!r}' for k, v in json.loads(c['arguments']).items())[:80]})"
             for c in calls]
    return f"{_SUMMARY_PREFIX} called " + "; ".join(parts) + "."


def _build_session(idx: int, rng: random.Random, max_chars: int) -> AgentSession:
    target = rng.choice(CODING_MODULES)
    others = rng.sample([m for m in CODING_MODULES if m != target], 3)
    msgs: list[Message] = [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": f"The tests of {target} fail after the last change. Find the cause in "
                                    f"Lib/{target}.py and fix it."},
    ]
    renders = [[dict(m) for m in msgs]]
    n_calls = rng.randint(8, 12)
    failed: int | None = None  # index of a failed call's assistant message awaiting its drop
    calls = 0
    while calls < n_calls:
        edits = []  # the harness's edits before this call's messages
        tool_idx = [i for i, m in enumerate(msgs) if m.get("role") == "tool"]
        long_old = [i for i in tool_idx[:-2] if msgs[i]["content"].count("\n") > _TRUNC_MAX]
        if failed is not None and calls - failed_at >= 1:
            del msgs[failed:failed + 2]
            failed, edits = None, ["drop"]
        elif long_old and rng.random() < 0.35:
            i = rng.choice(long_old)
            msgs[i] = {**msgs[i], "content": MASK_PLACEHOLDER if rng.random() < 0.6 else _truncate(msgs[i]["content"])}
            edits = ["mask-or-truncate"]
        elif tool_idx and rng.random() < 0.12 and msgs[tool_idx[-1]]["content"].count("\n") > _TRUNC_MAX:
            i = tool_idx[-1]
            msgs[i] = {**msgs[i], "content": _truncate(msgs[i]["content"])}
            edits = ["truncate-latest"]
        # the next call and its output
        kind = rng.choices(["read", "grep", "tests", "edit", "fail"], [5, 2, 2, 1, 1])[0]
        cid = f"call_{idx}_{calls}"
        if kind == "read":
            name, (args, out) = "read_file", _read(rng.choice([target, target, *others]), rng)
        elif kind == "grep":
            name, (args, out) = "grep", _grep(target, rng.sample(others, rng.randint(1, 3)), rng)
        elif kind == "tests":
            name, (args, out) = "run_tests", _tests(target, rng, fail=calls < n_calls - 2)
        elif kind == "edit":
            path, lines, _ = _source(target)
            line = rng.choice([ln for ln in lines if ln.strip()] or ["pass"]).strip()
            name, args, out = "edit_file", {"path": path, "old": line, "new": line + "  # fixed"}, f"edited {path}: 1 replacement"
        else:
            bad = f"Lib/{target}_impl.py"
            name, args, out = "read_file", {"path": bad}, f"Error: FileNotFoundError: [Errno 2] No such file: {bad!r}"
            if failed is None:
                failed, failed_at = len(msgs), calls
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": out})
        calls += 1
        # over budget, or sometimes: summarize the oldest calls after the task
        over = _chars(msgs) > max_chars
        if over or (calls > 4 and rng.random() < 0.08):
            stop = 2
            while stop < len(msgs) - 4 and (_chars(msgs[:2] + msgs[stop:]) > max_chars * 0.6 or stop < 6):
                stop += 2
            if msgs[stop - 1].get("role") == "tool" and stop > 3 and (failed is None or failed >= stop):
                from promptsplice.assembler import summarize_turns

                msgs = list(summarize_turns(msgs, 2, stop, _summary).messages)
                if failed is not None:
                    failed -= stop - 3
        while _chars(msgs) > max_chars:  # still over: mask the oldest long output
            olds = [i for i, m in enumerate(msgs[:-2]) if m.get("role") == "tool" and m["content"] != MASK_PLACEHOLDER]
            if not olds:
                break
            msgs[olds[0]] = {**msgs[olds[0]], "content": MASK_PLACEHOLDER}
        renders.append([dict(m) for m in msgs])
    return AgentSession(f"coding-{idx:03d}", [dict(t) for t in _TOOLS], renders)


def generate_coding_trace(num_sessions: int = 12, *, seed: int = 0, max_chars: int = 20_000) -> list[AgentSession]:
    """``num_sessions`` coding-agent sessions (see the module doc); the same arguments
    give the same trace on the same Python version."""
    if not isinstance(num_sessions, int) or isinstance(num_sessions, bool) or num_sessions < 1:
        raise ConfigError(f"num_sessions must be a positive int, got {num_sessions!r}")
    if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 4000:
        raise ConfigError(f"max_chars must be an int >= 4000 (a render's character budget), got {max_chars!r}")
    rng = random.Random(seed)
    return [_build_session(i, random.Random(rng.getrandbits(64)), max_chars) for i in range(num_sessions)]

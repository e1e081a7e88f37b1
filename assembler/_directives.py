"""Edit directives: what changed between two successive renders of an agent session.

Agents re-render their whole context every step and edit it (truncate a tool output,
drop a failed call, summarize old turns).  Exact-prefix caching then recomputes every
token after the edit, although most of them did not change.  :func:`diff_renders`
names the change as *directives* ``(span, replacement)``: ``span = (start, end)`` in the
OLD render's token coordinates, ``replacement`` the token ids (and text) that take its
place.  The engine keeps the prefix before the first directive (prefix cache), prefills
the replacements, *relocates* the unchanged tokens between and after them by their
position ``delta``, and computes only the new tail.  (The renders' common prefix,
:attr:`Diff.first_changed_token`, may reach past the first directive's start: a deleted
or inserted message that begins like the one after it, such as two tool outputs with
one header.  Directives stay at message boundaries, where whole blocks relocate; the
prefix cache then serves the leading blocks of the first run, and the connector loads
only the blocks after its hit.)

How the diff is made:

1. Message level: the bodies (every segment but the generation prompt) are compared
   segment by segment by ``(content digest, padding)``; equal keys mean equal tokens.
   The messages both share at the start and at the end are matched as they are, and
   :class:`difflib.SequenceMatcher` (no junk heuristic) gives the edited, deleted,
   inserted and moved stretches between them.
   When the last old messages changed and new ones follow them, the edited ones are
   paired with the first new ones and the rest is the append.
2. Token level: inside each changed stretch the common leading and trailing tokens are
   trimmed, so an edit inside one message (a truncated tool output keeps its header and
   its ``<|im_end|>``) gives a span smaller than the message.

Appends.  A render ends with the generation prompt (``<|im_start|>assistant\\n``), which
the next render replaces by the assistant's message, so appends are detected on the
bodies: when the new body starts with the old body (the old render's context is
untouched), the diff has NO directive; the new messages and the new generation prompt
are :attr:`Diff.appended`, and :attr:`Diff.base` (the old body's length) says where they
go.  The old generation prompt is not context and is simply dropped.  For ChatML the
assistant's message starts with the same tokens as the old generation prompt, so the
old render's tokens are then an exact prefix of the new ones (tested).  In general::

    apply_diff(old_tokens, diff) == apply_directives(old_tokens[:diff.base], diff.directives) + diff.appended

and it equals the new render's tokens exactly (property test).  A stretch inserted at
the very end of the old body is the append, never a directive.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any, NamedTuple

from promptsplice.assembler._render_types import Render
from promptsplice.errors import DirectiveError, InputError

__all__ = [
    "DiffKind",
    "Directive",
    "Relocation",
    "Diff",
    "diff_renders",
    "apply_directives",
    "apply_diff",
]


class DiffKind(enum.Enum):
    """What a step did to the previous render's context."""

    APPEND = "append"
    """The old context is untouched: no directive, only new tokens after it."""
    EDIT = "edit"
    """At least one directive: earlier context was replaced, removed or inserted into."""


@dataclass(frozen=True, slots=True)
class Directive:
    """Replace ``old[start:end]`` by ``replacement``.

    ``delta`` is the position shift of the unchanged old tokens after this directive
    (cumulative over this and the earlier directives): the engine relocates them by it.
    ``text`` is the replacement decoded alone, for logs: with a byte-level tokenizer a
    replacement may start or end inside a character (an emoji's bytes split over
    tokens), shown there as U+FFFD; the token ids are what is exact.
    """

    start: int
    end: int
    replacement: tuple[int, ...]
    text: str = ""
    delta: int = 0

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)

    @property
    def removed(self) -> int:
        """Old tokens this directive takes out."""
        return self.end - self.start

    @property
    def new_start(self) -> int:
        """Where the replacement starts in the new render."""
        return self.start + self.delta - (len(self.replacement) - (self.end - self.start))

    @property
    def new_end(self) -> int:
        return self.new_start + len(self.replacement)


class Relocation(NamedTuple):
    """Unchanged old tokens ``[old_start, old_end)`` that move by ``delta`` positions.

    A run with ``delta == 0`` still follows an edit: its block hashes changed (the chain
    covers the edit), so the prefix cache misses it and the engine loads it without
    rotation.  With block-aligned messages (``alignment="all"``) ``delta`` is a whole
    number of blocks after message-level edits."""

    old_start: int
    old_end: int
    delta: int

    @property
    def new_start(self) -> int:
        return self.old_start + self.delta

    @property
    def length(self) -> int:
        return self.old_end - self.old_start


@dataclass(frozen=True, slots=True)
class Diff:
    """Directives that turn an old render into a new one (see the module docstring).

    ``first_changed_token`` is the length of the common token prefix of the two
    renders: where the engine's prefix-cache hit ends (rounded down to a block).
    """

    directives: tuple[Directive, ...]
    appended: tuple[int, ...]
    appended_text: str
    base: int
    old_len: int
    new_len: int
    first_changed_token: int

    @property
    def kind(self) -> DiffKind:
        return DiffKind.EDIT if self.directives else DiffKind.APPEND

    @property
    def is_append(self) -> bool:
        return not self.directives

    @property
    def delta(self) -> int:
        """Total shift of the old context's end."""
        return self.directives[-1].delta if self.directives else 0

    @property
    def relocations(self) -> list[Relocation]:
        """The unchanged old tokens after each directive, with their shift: what the
        engine relocates (runs with ``delta == 0`` stay where they are)."""
        out: list[Relocation] = []
        ds = self.directives
        for i, d in enumerate(ds):
            stop = ds[i + 1].start if i + 1 < len(ds) else self.base
            if stop > d.end:
                out.append(Relocation(d.end, stop, d.delta))
        return out

    def changed_share(self, run: Relocation) -> float:
        """How much of what ``run``'s old KV attended to the edit changed: old tokens
        removed plus new tokens inserted by the directives before it, over the old
        tokens before it (0 for a run at position 0; may exceed 1 when more is
        inserted than was there).  A relocated run keeps deep-layer KV computed against
        its old context, so this is a candidate signal for how approximate it is
        (reported on agent steps; it did not rank first-token KL where measured)."""
        if run.old_start <= 0:
            return 0.0
        changed = 0
        for d in self.directives:
            if d.end > run.old_start:
                break
            changed += d.end - d.start + len(d.replacement)
        return changed / run.old_start

    @property
    def replaced_tokens(self) -> int:
        """New tokens the directives bring in (prefilled, not relocated)."""
        return sum(len(d.replacement) for d in self.directives)

    def apply(self, old_tokens: Sequence[int]) -> list[int]:
        return apply_diff(old_tokens, self)


def _as_directive(d: Any, index: int) -> tuple[int, int, Sequence[int]]:
    if isinstance(d, Directive):
        return d.start, d.end, d.replacement
    try:
        (start, end), replacement = d
    except (TypeError, ValueError):
        raise DirectiveError(
            f"directive {index} must be a Directive or ((start, end), replacement), got {d!r:.80}",
            problem="out_of_range",
            index=index,
        ) from None
    return start, end, replacement


def _token_list(value: Any) -> bool:
    """A list or tuple of ints >= 0 (no bools): what a replacement must be (C-level checks)."""
    return isinstance(value, (list, tuple)) and (
        not value or (set(map(type, value)) == {int} and min(value) >= 0)
    )


def apply_directives(tokens: Sequence[int], directives: Sequence[Any]) -> list[int]:
    """Apply ``directives`` (sorted, non-overlapping spans in ``tokens``' coordinates).

    Accepts :class:`Directive` objects or ``((start, end), replacement)`` pairs.  Raises
    :class:`~promptsplice.errors.DirectiveError` for a span out of range, spans out of
    order (starts must strictly increase) or overlapping (a span starting before the
    previous one ends; two directives at one position count as overlapping); a
    malformed directive (not such a pair, bounds that are not ints, a replacement that
    is not a list or tuple of ints >= 0) counts as out of range.  ``tokens`` that are
    not a list or tuple of token ids: :class:`~promptsplice.errors.InputError`.
    """
    if not _token_list(tokens):
        raise InputError(f"tokens must be a list or tuple of token ids (ints >= 0), got {type(tokens).__name__}")
    if isinstance(directives, str | bytes | Mapping) or not isinstance(directives, Iterable):
        raise InputError(
            f"directives must be a list of Directive or ((start, end), replacement), got {type(directives).__name__}"
        )
    n = len(tokens)
    out: list[int] = []
    pos = 0
    prev_start = -1
    for i, d in enumerate(directives):
        start, end, replacement = _as_directive(d, i)
        if not (isinstance(start, int) and isinstance(end, int)) or isinstance(start, bool) or isinstance(end, bool):
            raise DirectiveError(f"directive {i}: span bounds must be ints, got {(start, end)!r}", problem="out_of_range", index=i)
        if start < 0 or end < start or end > n:
            raise DirectiveError(
                f"directive {i}: span ({start}, {end}) is out of range for {n} tokens",
                problem="out_of_range",
                index=i,
            )
        if start < prev_start:
            raise DirectiveError(
                f"directive {i}: span ({start}, {end}) comes before the previous directive's "
                f"start {prev_start}; directives must be sorted by position",
                problem="unsorted",
                index=i,
            )
        if start < pos or start == prev_start:
            raise DirectiveError(
                f"directive {i}: span ({start}, {end}) overlaps the previous directive, "
                f"which ends at {pos}",
                problem="overlapping",
                index=i,
            )
        if not _token_list(replacement):
            raise DirectiveError(
                f"directive {i}: replacement must be a list or tuple of token ids (ints >= 0), "
                f"got {type(replacement).__name__} {replacement!r:.60}",
                problem="out_of_range",
                index=i,
            )
        out.extend(tokens[pos:start])
        out.extend(replacement)
        pos = end
        prev_start = start
    out.extend(tokens[pos:])
    return out


def apply_diff(old_tokens: Sequence[int], diff: Diff) -> list[int]:
    """The new render's tokens from the old ones:
    ``apply_directives(old_tokens[:diff.base], diff.directives) + diff.appended``."""
    if not isinstance(diff, Diff):
        raise InputError(f"diff must be a Diff (ChatRenderer.diff of two renders), got {type(diff).__name__}")
    if not _token_list(old_tokens):
        raise InputError(f"old_tokens must be a list or tuple of token ids (ints >= 0), got {type(old_tokens).__name__}")
    if len(old_tokens) != diff.old_len:
        raise DirectiveError(
            f"the diff was made for an old render of {diff.old_len} tokens, got {len(old_tokens)}",
            problem="out_of_range",
            index=-1,
        )
    if not _token_list(diff.appended):  # extended as given: a str or -1 joined the prompt
        raise DirectiveError(
            f"the diff's appended tokens must be a list or tuple of token ids (ints >= 0), got "
            f"{type(diff.appended).__name__} {diff.appended!r:.60}",
            problem="out_of_range",
            index=-1,
        )
    out = apply_directives(old_tokens[: diff.base], diff.directives)
    out.extend(diff.appended)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # compare in slices first (fast path in C), then finish token by token
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _trim(ot: Sequence[int], nt: Sequence[int], os_: int, oe: int, ns: int, ne: int) -> tuple[int, int, int, int]:
    """``ot[os_:oe]`` -> ``nt[ns:ne]`` without the tokens both share at either end."""
    lim = min(oe - os_, ne - ns)
    p = _common_prefix(ot[os_ : os_ + lim], nt[ns : ns + lim])
    q = 0
    while q < lim - p and ot[oe - 1 - q] == nt[ne - 1 - q]:
        q += 1
    return os_ + p, oe - q, ns + p, ne - q


def diff_renders(
    old: Render,
    new: Render,
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> Diff:
    """Directives that turn ``old`` into ``new`` (message level, then tokens).

    ``decode`` (the tokenizer's) fills the directives' ``text``; without it the texts
    are empty.  The result is exact: ``apply_diff(old.token_ids, diff) == new.token_ids``.
    """
    for name, r in (("old", old), ("new", new)):
        if not isinstance(r, Render):
            raise InputError(f"{name} must be a Render (ChatRenderer.render(...)), got {type(r).__name__}")
    if decode is not None and not callable(decode):
        raise InputError(f"decode must be a callable (the tokenizer's decode) or None, got {type(decode).__name__}")
    ob, nb = old.body_segments, new.body_segments
    o_end, n_end = old.body_end, new.body_end
    ot, nt = old.token_ids, new.token_ids
    okeys = [(s.key, s.padding) for s in ob]
    nkeys = [(s.key, s.padding) for s in nb]
    # The messages both renders share at either end are matched first, the matcher runs
    # on the stretch between (it grows ~quadratically with repeated messages: an agent
    # polling one tool 4,000 times took 0.94 s a step with the whole history).
    lim = min(len(okeys), len(nkeys))
    p = 0
    while p < lim and okeys[p] == nkeys[p]:
        p += 1
    q = 0
    while q < lim - p and okeys[-1 - q] == nkeys[-1 - q]:
        q += 1
    matcher = SequenceMatcher(None, okeys[p : len(okeys) - q], nkeys[p : len(nkeys) - q], autojunk=False)
    opcodes = [(tag, i1 + p, i2 + p, j1 + p, j2 + p) for tag, i1, i2, j1, j2 in matcher.get_opcodes()]
    if q:
        opcodes.append(("equal", len(okeys) - q, len(okeys), len(nkeys) - q, len(nkeys)))
    if opcodes and opcodes[-1][0] == "replace":
        # the last old messages edited and new ones appended: pair the edited ones, the
        # rest is the append
        _, i1, i2, j1, j2 = opcodes[-1]
        if i2 == len(ob) and j2 - j1 > i2 - i1:
            mid = j1 + (i2 - i1)
            opcodes[-1:] = [("replace", i1, i2, j1, mid), ("insert", i2, i2, mid, j2)]
    raw: list[tuple[int, int, int, int]] = []
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            continue
        os_ = ob[i1].start if i1 < len(ob) else o_end
        oe = ob[i2 - 1].end if i2 > i1 else os_
        ns = nb[j1].start if j1 < len(nb) else n_end
        ne = nb[j2 - 1].end if j2 > j1 else ns
        # token level: trim what the stretches share at both ends
        os_, oe, ns, ne = _trim(ot, nt, os_, oe, ns, ne)
        if raw and raw[-1][0] == raw[-1][1] == os_ and (os_ < oe or ns < ne):
            # a pure insertion right before this stretch (only token-less segments
            # between them): one directive, since two cannot start at one position
            os_, oe, ns, ne = _trim(ot, nt, os_, oe, raw.pop()[2], ne)
        if os_ == oe and ns == ne:
            continue
        raw.append((os_, oe, ns, ne))
    if raw and raw[-1][0] == raw[-1][1] == o_end:
        # an insertion at the very end of the old context: the append
        tail_start = raw.pop()[2]
    else:
        tail_start = n_end
    directives: list[Directive] = []
    delta = 0
    for os_, oe, ns, ne in raw:
        rep = tuple(nt[ns:ne])
        delta += len(rep) - (oe - os_)
        directives.append(Directive(os_, oe, rep, decode(rep) if decode else "", delta))
    appended = tuple(nt[tail_start:])
    return Diff(
        directives=tuple(directives),
        appended=appended,
        appended_text=decode(appended) if decode else "",
        base=o_end,
        old_len=len(ot),
        new_len=len(nt),
        first_changed_token=_common_prefix(ot, nt),
    )

"""Fuzzing assembly and edit directives (issue #8), on the real default tokenizer.

* Assembly on arbitrary unicode chunks, queries, system prompts and tools under a
  ``max_tokens`` limit: the prompt fits the limit, or ContextLengthError says by how
  much; lone surrogates are refused with InvalidUTF8Error, never a UnicodeEncodeError.
* Directives: ``apply(diff(a, b), a) == b`` for arbitrary token sequences cut into
  arbitrary segments, and for real renders of arbitrary unicode messages;
  ``apply_directives`` on arbitrary (mostly bad) directives returns the documented
  output or raises DirectiveError naming the problem.

The invariant checks live in ``tests/fuzz/_checks.py`` (shared with the atheris harnesses).
"""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from promptsplice.assembler import Assembler, ChatRenderer, Directive, apply_diff, assemble_prompt
from promptsplice.errors import (
    ConfigError,
    ContextLengthError,
    DirectiveError,
    InvalidUTF8Error,
)
from tests.fuzz._checks import (
    check_apply_directives,
    check_diff,
    no_utf8,
    note,
    run_assembly,
    synthetic_render,
)

pytestmark = pytest.mark.reliability

# `measured` (the numbers RELIABILITY.md quotes) is one dict per test, shared by its examples.
FIXTURE = [HealthCheck.function_scoped_fixture]

valid_unicode = st.text(max_size=30)
# Lone surrogates: st.text() never draws them and st.characters(codec=None) rarely
# (about one string in 250), so one is put in a valid string at a random place.
with_surrogate = st.builds(
    lambda t, c, i: t[: i % (len(t) + 1)] + c + t[i % (len(t) + 1) :],
    valid_unicode,
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    st.integers(0, 30),
)
# Message contents: any code point, and one message in about eight holds a lone surrogate.
any_unicode = st.one_of(
    *[valid_unicode] * 3, *[st.text(st.characters(codec=None), max_size=30)] * 3, with_surrogate
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | valid_unicode,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(valid_unicode, inner, max_size=3),
    max_leaves=6,
)


_ASSEMBLERS: dict[int, Assembler] = {}


def assembler_for(tok, block_size: int) -> Assembler:
    """One assembler per block size for the whole module: state (popularity, mirror,
    branch memory) carries over between examples, as in a server."""
    if block_size not in _ASSEMBLERS:
        _ASSEMBLERS[block_size] = Assembler(tok, block_size=block_size, capacity_blocks=4096)
    return _ASSEMBLERS[block_size]


@st.composite
def requests(draw, pool=None, surrogate=False):
    """Chunks from a small pool (shared by the requests of one example, so they repeat
    chunks and the mirror hits), a query, a system prompt and tools; with
    ``surrogate``, one of these (or none) holds a lone surrogate."""
    bad = draw(st.sampled_from(["none", "chunk", "query", "system", "tools"])) if surrogate else "none"

    def text(field):
        return with_surrogate if bad == field else valid_unicode

    pool = list(pool) if pool is not None else draw(st.lists(valid_unicode, min_size=1, max_size=6))
    if bad == "chunk":
        pool.append(draw(with_surrogate))
    chunks = []
    for _ in range(draw(st.integers(int(bad == "chunk"), 6))):
        t = draw(st.sampled_from(pool))
        forms = [t, {"text": t, "metadata": {"source": "s"}}, t.encode("utf-8", "surrogatepass")]
        chunks.append(draw(st.sampled_from(forms)))
    tools = st.lists(
        st.dictionaries(text("tools"), json_values, min_size=int(bad == "tools"), max_size=2),
        min_size=int(bad == "tools"),
        max_size=2,
    )
    kwargs = {
        "query": draw(text("query")),
        "system": draw(text("system") if bad == "system" else st.sampled_from([None, "Be brief."]) | valid_unicode),
        "tools": draw(tools if bad == "tools" else st.none() | tools),
        "policy": draw(st.sampled_from(["retrieval", "stable", "cache_aware"])),
        "alignment": draw(st.sampled_from(["none", "all", "auto"])),
    }
    return chunks, kwargs


@st.composite
def sessions(draw):
    """Up to four requests over one pool of chunks, each with its own context size."""
    pool = draw(st.lists(valid_unicode, min_size=1, max_size=6))
    return draw(st.lists(st.tuples(requests(pool), st.integers(1, 400)), min_size=1, max_size=4))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, *FIXTURE])
@given(block_size=st.sampled_from([1, 4, 16, 32]), steps=sessions())
def test_valid_unicode_prompts_never_exceed_max_tokens(default_tok, measured, block_size, steps):
    """Arbitrary valid text, every policy and alignment, a random context size: the
    prompt fits, or ContextLengthError carries the real prompt size (exactly the one
    assembled without a limit); the stateful call that admits and learns fits too."""
    asm = assembler_for(default_tok, block_size)
    for (chunks, kwargs), limit in steps:
        note(measured, run_assembly(asm, chunks, kwargs, limit))


EXAMPLE = {"query": "q", "system": None, "tools": None, "policy": "stable", "alignment": "auto"}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, *FIXTURE])
@given(request=requests(surrogate=True), limit=st.integers(1, 400))
@example(request=(["ok"], {**EXAMPLE, "query": "a\ud800b"}), limit=100)  # was UnicodeEncodeError
@example(request=([], {**EXAMPLE, "system": "s\udfff"}), limit=100)  # was UnicodeEncodeError
@example(request=([], {**EXAMPLE, "tools": [{"k": "\ud800"}]}), limit=100)  # was UnicodeEncodeError
def test_lone_surrogates_are_refused_with_invalid_utf8_error(default_tok, measured, request, limit):
    """Lone surrogates in chunks, the query, the system prompt or tools: InvalidUTF8Error
    (a PromptspliceError), never a bare UnicodeEncodeError; valid requests still fit."""
    chunks, kwargs = request
    note(measured, run_assembly(assembler_for(default_tok, 16), chunks, kwargs, limit))


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURE)
@given(
    value=st.one_of(st.integers(-5, 60), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3), st.just([5])),
    where=st.sampled_from(["assembler", "call", "function"]),
)
@example(value="7", where="call")  # was TypeError
@example(value=0, where="call")  # was ContextLengthError("... the context holds 0")
@example(value=1.5, where="assembler")  # was accepted
def test_max_tokens_is_a_positive_int_or_config_error(default_tok, measured, value, where):
    """``max_tokens`` (the context the prompt must fit) is checked the same way on the
    assembler and per call: anything but a positive int is a ConfigError."""
    valid = isinstance(value, int) and not isinstance(value, bool) and value > 0
    try:
        if where == "assembler":
            out = Assembler(default_tok, max_tokens=value).assemble(["Paris is in France."], query="Where?")
        elif where == "call":
            asm = assembler_for(default_tok, 16)
            out = asm.preview(["Paris is in France."], query="Where?", max_tokens=value)
        else:
            out = assemble_prompt(
                ["Paris."], query="Where?", tokenizer=default_tok, block_size=48, max_tokens=value  # a private default
            )
    except ConfigError as err:
        assert not valid, err
        assert "max_tokens" in str(err)
        return note(measured, "ConfigError")
    except ContextLengthError as err:
        assert valid and err.max_tokens == value < err.prompt_tokens
        return note(measured, "ContextLengthError")
    assert valid and out.num_tokens <= value
    note(measured, "fits")


# -- directives ---------------------------------------------------------------------------

tokens = st.lists(st.integers(0, 4) | st.integers(0, 2**31), max_size=6)


@st.composite
def render_pairs(draw, empty_segments=False):
    """Two renders over arbitrary token ids: the new one made from the old one's
    segments by edits, deletions, insertions, moves and appends (so they share
    segments), or drawn independently."""
    seg = tokens if empty_segments else st.lists(st.integers(0, 4) | st.integers(0, 2**31), min_size=1, max_size=6)
    old = draw(st.lists(seg, max_size=6))
    if draw(st.booleans()):
        new = draw(st.lists(seg, max_size=6))
    else:
        new = list(old)
        for _ in range(draw(st.integers(0, 4))):
            op = draw(st.sampled_from(["edit", "delete", "insert", "append", "move", "tweak", "grow"]))
            i = draw(st.integers(0, max(0, len(new) - 1)))
            if op == "edit" and new:
                new[i] = draw(seg)
            elif op == "tweak" and new and new[i]:  # one token of a segment changes
                j = draw(st.integers(0, len(new[i]) - 1))
                new[i] = [*new[i][:j], draw(st.integers(0, 4)), *new[i][j + 1 :]]
            elif op == "grow" and new:  # a segment gets more tokens at its end
                new[i] = [*new[i], *draw(seg)]
            elif op == "delete" and new:
                del new[i]
            elif op == "insert":
                new.insert(i, draw(seg))
            elif op == "append":
                new.extend(draw(st.lists(seg, min_size=1, max_size=2)))
            elif op == "move" and len(new) > 1:
                new.insert(draw(st.integers(0, len(new) - 1)), new.pop(i))
    gen = draw(st.sampled_from([(), (1, 2, 3)]))
    new_gen = gen if draw(st.booleans()) else draw(st.sampled_from([(), (1, 2, 3), (9,)]))
    return synthetic_render(old, gen), synthetic_render(new, new_gen)


@settings(max_examples=400, deadline=None, suppress_health_check=FIXTURE)
@given(render_pairs())
@example((synthetic_render([]), synthetic_render([[1]])))
@example((synthetic_render([[1, 2]], (7,)), synthetic_render([], (7,))))
@example((synthetic_render([[1]], (7,)), synthetic_render([[1, 2], [3]], (7,))))  # was a directive at the body's end
def test_apply_of_diff_rebuilds_arbitrary_token_sequences(measured, pair):
    """apply(diff(a, b), a) == b for arbitrary token ids and segmentations, with
    sorted, disjoint, trimmed directives."""
    old, new = pair
    diff = check_diff(old, new)
    n = len(diff.directives)
    note(measured, f"directives: {n if n < 3 else '3+'}")


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURE)
@given(render_pairs(empty_segments=True))
@example((synthetic_render([[], [0]]), synthetic_render([[0], []])))  # was two directives at 0: DirectiveError
def test_apply_of_diff_with_empty_segments(measured, pair):
    """Segments without tokens (nothing in the Render contract forbids them) do not
    break the round trip."""
    n = len(check_diff(*pair).directives)
    note(measured, f"directives: {n if n < 3 else '3+'}")


DEEP = "[" * 3000 + "]" * 3000
tool_args = st.one_of(
    st.sampled_from(["{}", '{"a": "ü"}', "not json", '"\\ud800"', DEEP, "[" * 990 + "]" * 990, ""]),
    any_unicode,
)


CALL = {"id": "c", "type": "function"}


def call_message(arguments: str, name: str = "f") -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [CALL | {"function": {"name": name, "arguments": arguments}}]}


@st.composite
def messages(draw):
    role = draw(st.sampled_from(["user", "assistant", "tool", "system"]))
    msg = {"role": role, "content": draw(any_unicode)}
    if role == "assistant" and draw(st.booleans()):
        msg["tool_calls"] = call_message(draw(tool_args), draw(st.sampled_from(["f", "ü"])))["tool_calls"]
    return msg


def _bad_message(msg) -> bool:
    """A message the renderer must refuse: a lone surrogate in its content or raw in its
    tool call arguments.  Arguments whose JSON escapes parse to one (``"\\ud800"``:
    valid ASCII and valid JSON, a model may emit it) are kept as written, never refused:
    a refusal there failed every later step of the session."""
    if no_utf8(msg["content"]):
        return True
    return any(no_utf8(call["function"]["arguments"]) for call in msg.get("tool_calls", ()))


@pytest.fixture(scope="module")
def renderer(default_tok):
    return ChatRenderer(default_tok, block_size=16)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, *FIXTURE])
@given(old=st.lists(messages(), min_size=1, max_size=4), ops=st.lists(st.tuples(st.integers(0, 3), messages()), max_size=3))
@example(old=[{"role": "user", "content": "x\ud800"}], ops=[])  # was UnicodeEncodeError
@example(old=[call_message(DEEP)], ops=[])  # was RecursionError
@example(old=[call_message('"\\ud800"')], ops=[])  # a JSON escape that parses to a lone surrogate: kept as text
def test_apply_of_diff_on_renders_of_arbitrary_unicode(renderer, measured, old, ops):
    """Real renders (chat template, tokenizer, padding) of arbitrary unicode messages and
    tool calls: the diff rebuilds the new render; a lone surrogate raises
    InvalidUTF8Error naming the message, deeply nested arguments are kept as text."""
    new = list(old)
    for i, msg in ops:
        if i < len(new) and i % 2:
            new[i] = msg
        else:
            new.append(msg)
    renders = []
    for msgs in (old, new):
        bad = next((i for i, m in enumerate(msgs) if _bad_message(m)), None)
        try:
            renders.append(renderer.render(msgs))
        except InvalidUTF8Error as err:
            assert err.index == bad and f"message {bad} " in str(err), (err, bad)
            return note(measured, "refused: InvalidUTF8Error")
        assert bad is None, f"message {bad} was rendered"
    check_diff(*renders, renderer.diff(*renders))
    note(measured, "rendered, diff applied")


# -- apply_directives on arbitrary directives ---------------------------------------------

bounds = st.integers(-2, 8) | st.booleans() | st.sampled_from([None, 1.0, "1"])
replacements = st.lists(st.integers(0, 9), max_size=3) | st.tuples(st.integers(0, 9)) | st.sampled_from([None, 5])
directives = st.one_of(
    st.tuples(st.tuples(bounds, bounds), replacements),
    st.tuples(st.tuples(st.integers(0, 8), st.integers(0, 8)), st.lists(st.integers(0, 9), max_size=3)),
    st.builds(Directive, st.integers(-1, 8), st.integers(-1, 8), st.tuples(st.integers(0, 9))),
    st.sampled_from(["nonsense", None, 3, (), (1, 2, 3), ((1,), []), ((1, 2, 3), [])]),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=FIXTURE)
@given(toks=st.lists(st.integers(0, 9), max_size=8), ds=st.lists(directives, max_size=4))
@example(toks=[1, 2], ds=[((0, 1), 5)])  # was TypeError
@example(toks=[1, 2], ds=[((0, 1), None)])  # was TypeError
@example(toks=[1, 2], ds=[Directive(0, 1, None)])  # type: ignore[arg-type]  # was TypeError
def test_apply_directives_on_arbitrary_directives(measured, toks, ds):
    """Either the documented output or DirectiveError with the documented problem and
    index (a replacement that is not a token list included); nothing else escapes."""
    note(measured, check_apply_directives(toks, ds))


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURE)
@given(render_pairs(), st.sampled_from([-3, -2, -1, 1, 2, 3]))
def test_apply_diff_to_the_wrong_render_is_a_directive_error(measured, pair, shift):
    """A diff applied to tokens of another length: DirectiveError, not a wrong result."""
    old, new = pair
    diff = check_diff(old, new)
    wrong = old.token_ids + [0] * shift if shift > 0 else old.token_ids[:shift]
    if len(wrong) == len(old.token_ids):
        return
    with pytest.raises(DirectiveError):
        apply_diff(wrong, diff)
    note(measured, "DirectiveError")

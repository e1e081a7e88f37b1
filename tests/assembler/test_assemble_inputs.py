"""Careless and hostile input at the assembler's doors (``assemble_prompt``,
``Assembler``, ``ContextHook``): types are checked before any work, tool schemas must
be JSON, ``assemble_prompt(assembler=...)`` keeps the assembler's settings, and sizes
are refused before tokenization, in bounded time and memory."""

from __future__ import annotations

import re
import time
import tracemalloc

import pytest

from promptsplice.assembler import (
    AlignPolicy,
    Assembler,
    DEFAULT_CAPACITY_BLOCKS,
    ChatRenderer,
    ContextHook,
    OrderPolicy,
    PrefixCacheMirror,
    assemble_prompt,
)
from promptsplice.errors import (
    ConfigError,
    ContextLengthError,
    InputError,
    InvalidMessageError,
    InvalidTextError,
    InvalidToolsError,
)

TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
BIG = 20_000_000  # bytes: took 19 s and 2.9 GB to tokenize before failing


def big_text() -> str:
    return ("The tower was painted in shade number seven. " * (BIG // 45 + 1))[:BIG]


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("system", b"sys", InvalidTextError),  # rendered as "b'sys'" before
        ("system", 5, InvalidTextError),  # rendered as "5" before
        ("query", b"q", InvalidTextError),
        ("query", None, InvalidTextError),
        ("tools", "tool", InvalidToolsError),  # one tool per character before
        ("tools", TOOL, InvalidToolsError),  # a dict, not a list of dicts
        ("tools", [TOOL, "ls"], InvalidToolsError),
        ("tools", [{"name": object()}], InvalidToolsError),  # bare TypeError before
        ("tools", [{"name": {1, 2}}], InvalidToolsError),
        ("tools", [{"limit": float("nan")}], InvalidToolsError),
        ("tools", [{1: "a", "b": 2}], InvalidToolsError),  # keys json.dumps cannot sort
    ],
)
def test_types_are_checked_before_any_work(make_assembler, default_tok, field, value, error):
    kwargs = {"query": "q", field: value}
    asm = make_assembler()
    with pytest.raises(error, match=field):
        asm.assemble(["doc"], **kwargs)
    with pytest.raises(error, match=field):
        assemble_prompt(["doc"], tokenizer=default_tok, **kwargs)
    assert len(asm.mirror) == 0 and asm.mirror.queries_tokens == 0  # refused before any work


def test_valid_json_tools_still_render_canonically(make_assembler):
    asm = make_assembler(alignment="none")
    a = asm.preview(["doc"], query="q", tools=[{"b": 1, "a": [1.5, None, True]}])
    b = asm.preview(["doc"], query="q", tools=({"a": [1.5, None, True], "b": 1},))
    assert a.token_ids == b.token_ids
    assert '{"a":[1.5,null,true],"b":1}' in a.text


def test_bad_text_and_tool_keys_are_named_where_the_caller_put_them(make_assembler):
    """A lone surrogate was reported at its offset in the rendered segment (the query's
    "Question: " wrapper, the system template), a tool's in "text 0" by naive(); a tool
    with int and str keys got a message about sorting, and int keys alone rendered as
    strings silently."""
    from promptsplice.errors import InvalidUTF8Error
    from promptsplice.assembler import PromptFormat

    asm = make_assembler(alignment="none")
    chat = make_assembler(alignment="none", prompt_format=PromptFormat.chatml())
    for a in (asm, chat):
        for call in (a.assemble, a.naive):
            with pytest.raises(InvalidUTF8Error, match=r"the query segment .* at character 3 ") as err:
                call(["doc"], query="abc\ud800")
            assert err.value.offset == 3
            with pytest.raises(InvalidUTF8Error, match=r"the system segment .* at character 2 "):
                call(["doc"], query="q", system="ab\ud800")
            with pytest.raises(InvalidUTF8Error, match=r"tools\[1\] \(as JSON\) contains a lone surrogate"):
                call(["doc"], query="q", tools=[{"name": "f"}, {"d": "\ud800"}])
            with pytest.raises(InvalidToolsError, match=r"tools\[0\]\['parameters'\]: key 1 is int, not str; "
                                                         r"JSON object keys must be strings"):
                call(["doc"], query="q", tools=[{"name": "f", "parameters": {1: "a", "b": 2}}])
            with pytest.raises(InvalidToolsError, match=r"tools\[0\]\['a'\]\[0\]: key 2 is int"):
                call(["doc"], query="q", tools=[{"a": [{2: 3}]}])


@pytest.mark.reliability
def test_the_hook_checks_types_and_json_tools(default_tok):
    hook = ContextHook(Assembler(default_tok, block_size=16))
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidToolsError, match=r"tools\[0\] is not JSON"):
        hook("s", msgs, tools=[{"name": object()}])  # rendered as "<object object at 0x...>" before
    with pytest.raises(InvalidToolsError):
        hook("s", msgs, tools="tool")
    with pytest.raises(InvalidMessageError, match=r"messages\[0\]\['content'\]"):
        hook("s", [{"role": "user", "content": b"hi"}])
    with pytest.raises(InvalidMessageError, match="role"):
        hook("s", [{"content": "hi"}])
    with pytest.raises(InvalidMessageError):
        hook("s", "hello")
    with pytest.raises(InvalidTextError, match="session_id"):
        hook(b"s", msgs)
    with pytest.raises(ConfigError, match="block_size"):
        ContextHook(default_tok, block_size=10**9)
    assert "s" not in hook  # no session was started by a refused call
    assert hook("s", msgs).token_ids  # and a good call works


@pytest.mark.reliability
def test_assemble_prompt_takes_the_assemblers_settings(make_assembler, default_tok):
    asm = make_assembler(policy="retrieval", alignment="none")
    out = assemble_prompt(["b doc", "a doc"], query="q", assembler=asm)
    assert out.policy is OrderPolicy.RETRIEVAL and out.alignment is AlignPolicy.NONE  # were replaced by defaults
    assert out.padding_tokens == 0
    same = assemble_prompt(["b doc"], query="q", assembler=asm, policy="retrieval", block_size=16,
                           tokenizer=default_tok)
    assert same.policy is OrderPolicy.RETRIEVAL
    for conflict in ({"policy": "stable"}, {"alignment": "all"}, {"block_size": 32},
                     {"tokenizer": "tiktoken:cl100k_base"}):
        with pytest.raises(ConfigError, match=f"{next(iter(conflict))}.*differs from the assembler"):
            assemble_prompt(["doc"], query="q", assembler=asm, **conflict)
    with pytest.raises(ConfigError, match="assembler must be an Assembler"):
        assemble_prompt(["doc"], query="q", assembler="mine")


@pytest.mark.reliability
@pytest.mark.parametrize("block_size", [True, 0, -16, 1.5, "16", 10**9, 10**6])
def test_block_size_is_bounded_at_every_door(default_tok, block_size):
    """``block_size=True`` was taken by ``Assembler`` (refused by ``assemble_prompt``);
    ``10**9`` built a 10^9-element padding list; ``10**6`` with ``alignment="all"``
    turned 18 tokens into 3,000,009."""
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="block_size must be an int from 1 to 16384"):
        Assembler(default_tok, block_size=block_size)
    with pytest.raises(ConfigError, match="block_size must be an int from 1 to 16384"):
        assemble_prompt(["doc"], query="q", tokenizer=default_tok, block_size=block_size, alignment="all")
    with pytest.raises(ConfigError, match="block_size"):
        ContextHook(default_tok, block_size=block_size)
    with pytest.raises(ConfigError, match="block_size must be an int from 1 to 16384"):
        ChatRenderer(default_tok, block_size=block_size)  # rendered "hi" as 2,000,004 tokens
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("value", ["false", "no", 0, 1, None])
def test_trust_markup_takes_a_bool_only(default_tok, value):
    """``trust_markup="false"`` was truthy: control-token markup in chunks and tools was
    read as controls (2 injected tokens), the opposite of what the caller asked for."""
    for build in (
        lambda: Assembler(default_tok, trust_markup=value),
        lambda: ChatRenderer(default_tok, trust_markup=value),
        lambda: assemble_prompt(["doc"], query="q", tokenizer=default_tok, trust_markup=value),
    ):
        with pytest.raises(ConfigError, match="trust_markup must be True or False"):
            build()


def test_assembler_parts_are_checked_when_built(default_tok):
    """A wrong part was accepted and raised AttributeError at the first assemble."""
    for name in ("token_cache", "prompt_format", "dedup_config"):
        with pytest.raises(ConfigError, match=f"{name} must be a"):
            Assembler(default_tok, **{name: "x"})
    for args, kwargs, what in (
        (("16",), {}, "block_size"),
        ((16, 1.5), {}, "capacity_blocks"),
        ((16,), {"min_hit_tokens": None}, "min_hit_tokens"),
        ((16,), {"min_hit_tokens": 8}, "min_hit_tokens"),
    ):
        with pytest.raises(ConfigError, match=what):
            PrefixCacheMirror(*args, **kwargs)


def test_padding_is_bounded_by_the_largest_block(default_tok):
    asm = Assembler(default_tok, block_size=16_384, alignment="all", capacity_blocks=None)
    t0 = time.perf_counter()
    out = asm.preview(["a", "b"], query="q")
    assert time.perf_counter() - t0 < 5.0  # ~0.1 s idle; 1.5 s seen on a loaded 2-core machine
    for seg in out.segments[:-1]:  # every segment but the query padded to a boundary
        assert seg.end % 16_384 == 0 and 0 <= seg.padding < 16_384
    assert out.padding_tokens < 16_384 * (len(out.segments) - 1)


@pytest.mark.reliability
def test_a_huge_chunk_is_refused_before_it_is_tokenized(default_tok, make_assembler):
    """20 MB against an 8K context or a small mirror: refused from its byte size within
    a second and without token lists (it took 19 s and 2.9 GB, then advised raising
    ``capacity_blocks``, which ``assemble_prompt`` does not take).  The error names the
    argument to change."""
    big = big_text()
    with pytest.raises(ContextLengthError):  # the one-time vocabulary scan (~30 ms), outside tracemalloc
        make_assembler(max_tokens=1).assemble(["x" * (2 << 20)], query="q")
    small_mirror, small_context = make_assembler(capacity_blocks=512), make_assembler(max_tokens=4096)
    doors = {
        "max_tokens": lambda: assemble_prompt([big], query="q", tokenizer=default_tok, max_tokens=8192),
        "capacity_blocks": lambda: small_mirror.assemble([big], query="q"),
        "max_tokens ": lambda: small_context.preview(["small", big], query="q"),
    }
    assemble_prompt(["w"], query="q", tokenizer=default_tok)  # the default assembler
    for name, door in doors.items():
        t0 = time.perf_counter()
        with pytest.raises(ContextLengthError, match=name.strip()):
            door()
        elapsed = time.perf_counter() - t0
        assert elapsed < 1.0, (name, elapsed)
        tracemalloc.start()  # again, for memory (tracemalloc slows allocation down)
        with pytest.raises(ContextLengthError, match=name.strip()) as info:
            door()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 8 * BIG, (name, peak)  # copies of the text (dedup), no token lists (2.9 GB)
        assert info.value.prompt_tokens > info.value.max_tokens
        assert "raise max_tokens" in str(info.value) or "capacity_blocks=N" in str(info.value)


@pytest.mark.reliability
def test_a_prompt_over_the_mirror_names_an_argument_assemble_prompt_takes(default_tok):
    asm = Assembler(default_tok, block_size=16, capacity_blocks=4)
    with pytest.raises(ContextLengthError, match=r"assembler=Assembler\(.*capacity_blocks=N\)") as info:
        asm.assemble(["word " * 200], query="q")
    assert info.value.max_tokens == 64
    assert len(asm.mirror) == 0  # refused before the mirror was touched


def test_sizes_that_fit_are_not_refused(make_assembler):
    """The byte bound never refuses a prompt that fits (80 KB of text in a 32K context),
    and a prompt under 1 MiB that does not fit is tokenized, so its error has the exact size."""
    text = "Paris is the capital of France. " * 2500
    out = make_assembler(max_tokens=32_768).preview([text], query="q")
    assert out.num_tokens <= 32_768
    with pytest.raises(ContextLengthError, match="the assembled prompt has") as info:
        make_assembler(max_tokens=100).preview([text], query="q")
    assert info.value.prompt_tokens == make_assembler().preview([text], query="q").num_tokens


def test_input_errors_are_value_errors():
    for cls in (InvalidTextError, InvalidToolsError, InvalidMessageError):
        assert issubclass(cls, InputError) and issubclass(cls, ValueError)


@pytest.mark.parametrize("kwargs, says", [
    ({"query_template": "Answer:"}, "must hold {query}: without it the query is dropped"),
    ({"system_template": "Be brief."}, "must hold {system}"),
    ({"query_template": "Q: {question}"}, "only {query} as its field (KeyError"),
    ({"query_template": "Q: {query[0]}"}, "only {query} as its field (KeyError"),  # failed at assembly (diff review)
    ({"query_template": "Q: {query.x}"}, "only {query} as its field (KeyError"),
    ({"query_template": "Q: {query:.0}"}, "cuts the query to 0 characters"),  # formats to "Q: " (second review)
    # a precision the marker survived cut every longer query silently (RAG user review, 2026-12-04)
    ({"query_template": "Question: {query:.40}\nAnswer:"}, "the precision in {query:.40} cuts the query to 40"),
    ({"system_template": "{system!s:10.5}"}, "cuts the system to 5 characters"),
    ({"system_template": "{"}, "only {system} as its field (ValueError"),
    ({"separator": 5}, "PromptFormat.separator must be a str, got int"),
    ({"tools_header": None}, "PromptFormat.tools_header must be a str, got NoneType"),
    ({"default_system": 3}, "PromptFormat.default_system must be a str or None, got int"),
])
@pytest.mark.reliability
def test_a_prompt_format_is_checked_when_built(kwargs, says):
    """A query template without {query} dropped the query from every prompt; other
    fields, a bad brace or a non-str failed at the first assembly as KeyError, ValueError
    or TypeError (user review)."""
    from promptsplice.assembler import PromptFormat
    from promptsplice.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(says)):
        PromptFormat(**kwargs)


def test_a_prompt_format_takes_conversions_and_specs_of_its_field(default_tok):
    """``{query!r}`` was refused by the first version of the check (its repr of a marker
    held no marker); the assembly renders it as before."""
    from promptsplice.assembler import PromptFormat

    fmt = PromptFormat(query_template="Q: {query!r}\nA:", system_template="{system:>3}")
    prompt = Assembler(default_tok, prompt_format=fmt, alignment="none").assemble(["a"], query="what?", system="S")
    assert prompt.text.startswith("  S") and prompt.text.endswith("Q: 'what?'\nA:")


@pytest.mark.parametrize("policy", ["stable", "cache_aware"])
@pytest.mark.parametrize("alignment", ["auto", "all", "none"])
def test_a_prompt_refused_for_its_size_teaches_later_prompts_nothing(default_tok, policy, alignment):
    """A call that raised ContextLengthError had already kept its chunk set's stable
    order (and touched the set's last-sent record, counted branch points): the prompts
    sent later followed the order of one never sent (RAG user review, 2026-12-04)."""
    docs = [{"id": i, "text": f"{w} " * 20} for i, w in (("a", "alpha"), ("b", "beta"), ("c", "gamma"))]

    def run(refused_first: bool) -> tuple[list, list]:
        asm = Assembler(default_tok, block_size=16, policy=policy, alignment=alignment)
        if refused_first:
            with pytest.raises(ContextLengthError):
                asm.assemble(docs, query="q", max_tokens=10)
        for _ in range(2):
            asm.assemble([docs[2]], query="q")
        out = asm.assemble(docs, query="q")
        return out.chunk_order, out.token_ids

    assert run(True) == run(False)


def test_a_prompt_too_long_with_padding_says_how_much_is_padding(default_tok):
    """alignment="all" refused 649 tokens "pass fewer or shorter chunks" where 100 were
    padding and "auto" fitted (RAG user review, 2026-12-04)."""
    docs = [f"chunk {i} " + "word " * 7 for i in range(6)]
    unpadded = Assembler(default_tok, block_size=32, alignment="none").preview(docs, query="q").num_tokens
    with pytest.raises(ContextLengthError, match=r"tokens \(\d+ of them block padding of alignment='all'"):
        Assembler(default_tok, block_size=32, alignment="all").preview(docs, query="q", max_tokens=unpadded)
    assert Assembler(default_tok, block_size=32, alignment="auto").preview(docs, query="q", max_tokens=unpadded)


def test_two_tokenizers_under_one_name_do_not_share_the_default_assembler(default_tok):
    """The default assemblers were keyed by name: the second tokenizer's prompt came out
    in the first one's ids (max id 28,120 for a vocabulary of 280)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from promptsplice.assembler import HFTokenizer

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["hello world the quick brown fox"] * 50,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    name = "my-model-test-collision"
    a = HFTokenizer(default_tok._tok, name=name)
    b = HFTokenizer(raw, name=name)
    assert assemble_prompt(["hello world"], query="fox", tokenizer=a).tokenizer is a
    with pytest.raises(ConfigError, match=f"both named '{name}'.*own name"):
        assemble_prompt(["hello world"], query="fox", tokenizer=b)
    # the same vocabulary under the same name (another object) shares it
    again = HFTokenizer(default_tok._tok, name=name)
    assert assemble_prompt(["hello world"], query="fox", tokenizer=again).token_ids
    # ... but not under another filler token: the first one's padding came out (216, not 198)
    padded = HFTokenizer(default_tok._tok, name=name, filler_token_id=198)
    with pytest.raises(ConfigError, match=f"their filler token.*both named '{name}'"):
        assemble_prompt(["hello world"], query="fox", tokenizer=padded, alignment="all")


def test_an_empty_chatml_system_still_opens_the_user_turn(default_tok):
    """``PromptFormat.chatml(default_system="")`` skipped the system segment, which
    holds the user turn's opener: the prompt had no ``<|im_start|>user`` and closed a
    turn it never opened.  ``None`` cannot leave the segment out either."""
    from promptsplice.assembler import PromptFormat

    asm = Assembler(default_tok, prompt_format=PromptFormat.chatml(default_system=""))
    head = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nDocuments:"
    assert asm.assemble(["Paris is in France."], query="Where is Paris?").text.startswith(head)
    assert asm.naive(["Paris is in France."], query="Where is Paris?").text.startswith(head)
    # a system given per call still wins
    assert asm.assemble(["a"], query="q", system="Be brief.").text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(ConfigError, match='default_system=""'):
        PromptFormat.chatml(default_system=None)


@pytest.mark.parametrize("field", ["separator", "tools_header", "query_template", "system_template", "default_system"])
def test_a_lone_surrogate_in_a_prompt_format_is_refused_when_built(field):
    """It built, then the first assembly blamed the (valid) query or a chunk."""
    from promptsplice.assembler import PromptFormat

    value = {"query_template": "Q\ud800 {query}", "system_template": "{system}\ud800"}.get(field, "\ud800")
    with pytest.raises(ConfigError, match=f"PromptFormat.{field} holds a lone surrogate"):
        PromptFormat(**{field: value})


def test_capacity_blocks_beside_a_mirror_must_agree_with_it(default_tok):
    """The mirror's capacity decided and ``capacity_blocks=2`` was dropped silently: a
    211-token prompt came back although the caller asked for 64 tokens of room."""
    with pytest.raises(ConfigError, match="capacity_blocks=2 differs from the mirror's capacity_blocks None"):
        Assembler(default_tok, mirror=PrefixCacheMirror(16, None), capacity_blocks=2)
    with pytest.raises(ConfigError, match="capacity_blocks=8 differs"):
        Assembler.for_openai(mirror=PrefixCacheMirror(128, None), capacity_blocks=8)
    same = Assembler(default_tok, mirror=PrefixCacheMirror(16, 2), capacity_blocks=2)
    assert same.mirror.capacity_blocks == 2
    assert Assembler(default_tok, mirror=PrefixCacheMirror(16, 5)).mirror.capacity_blocks == 5  # left out: the mirror's
    assert Assembler(default_tok).mirror.capacity_blocks == DEFAULT_CAPACITY_BLOCKS


def test_for_openai_names_its_own_block_size_rule():
    """``block_size=100`` failed on ``min_hit_tokens``, a field the caller never passed."""
    with pytest.raises(ConfigError, match="for_openai needs a block_size that divides 1,024"):
        Assembler.for_openai(block_size=100)
    assert Assembler.for_openai(block_size=64).mirror.min_hit_tokens == 1024


def test_assemble_prompt_compares_tokenizers_by_what_they_make_of_text(tmp_path, default_tok):
    """By name: the default tokenizer.json copied elsewhere was refused, and another
    tokenizer with the assembler's name would have been taken."""
    import shutil

    from promptsplice.assets import default_model_dir

    shutil.copy(default_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    asm = Assembler(default_tok)
    out = assemble_prompt(["doc"], query="q", assembler=asm, tokenizer=str(tmp_path / "tokenizer.json"))
    assert out.token_ids == assemble_prompt(["doc"], query="q", assembler=Assembler(default_tok)).token_ids


def test_a_tokenizer_that_splits_alike_but_pads_otherwise_differs_from_the_assemblers(make_assembler, default_tok):
    """``assemble_prompt(tokenizer=X, assembler=asm)`` compared how X splits a probe only:
    an X with another filler token was accepted, and asm's filler silently used."""
    from promptsplice.assembler import HFTokenizer

    asm = make_assembler(alignment="all")
    nl = HFTokenizer(default_tok._tok, name="smol-newline-filler", filler_token_id=198)
    assert nl.filler_token_id != default_tok.filler_token_id
    with pytest.raises(ConfigError, match="tokenizer 'smol-newline-filler' differs from the assembler"):
        assemble_prompt(["alpha beta"], query="q", tokenizer=nl, assembler=asm)
    assert assemble_prompt(["alpha beta"], query="q", tokenizer=default_tok, assembler=asm).token_ids


def test_a_prompt_with_no_tokens_is_an_input_error_that_names_the_query(default_tok):
    """A format without text and an empty query: the mirror's own check answered
    ("num_tokens must be the request's prompt length ... got 0")."""
    from promptsplice.assembler import PromptFormat

    asm = Assembler(default_tok, block_size=16, prompt_format=PromptFormat(separator="", query_template="{query}"))
    for chunks in ([], [""]):
        for call in (asm.preview, asm.assemble):
            with pytest.raises(InputError, match="the assembled prompt is empty.*give a query"):
                call(chunks, query="")
    assert asm.assemble([], query="q").token_ids

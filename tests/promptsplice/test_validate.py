"""The shared argument checks (``promptsplice._validate``): one rule per kind of
argument, one error class per kind of mistake, messages that say how to fix it."""

from __future__ import annotations

import enum
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptsplice import _validate as v
from promptsplice.errors import (
    ConfigError,
    ContextLengthError,
    InputError,
    InvalidMessageError,
    InvalidSaltError,
    InvalidTextError,
    InvalidToolsError,
    UnknownPolicyError,
)


def test_block_size_bounds():
    assert v.check_block_size(1) == 1 and v.check_block_size(v.MAX_BLOCK_SIZE) == v.MAX_BLOCK_SIZE
    for bad in (0, -1, True, False, 1.0, "16", None, v.MAX_BLOCK_SIZE + 1, 10**9):
        with pytest.raises(ConfigError, match="block_size must be an int from 1 to 16384"):
            v.check_block_size(bad)
    with pytest.raises(ConfigError, match="^page must"):
        v.check_block_size(0, "page")


def test_ints_numbers_and_bools():
    assert v.check_int(0, "n", minimum=0) == 0
    assert v.check_optional_int(None, "n") is None and v.check_optional_int(3, "n") == 3
    for bad in (True, 0, 1.5, "1", None):
        with pytest.raises(ConfigError, match="n must be an int >= 1"):
            v.check_int(bad, "n")
    with pytest.raises(ConfigError, match="<= 4"):
        v.check_int(5, "n", maximum=4)
    for bad in (True, "1", math.nan, math.inf, -0.5):
        with pytest.raises(ConfigError, match="x must be a number >= 0"):
            v.check_number(bad, "x")
    with pytest.raises(ConfigError, match="> 1"):
        v.check_number(1, "x", minimum=1, strict=True)
    assert v.check_number(1.25, "x", minimum=1, strict=True) == 1.25
    assert v.check_bool(False, "b") is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(ConfigError, match="b must be True or False"):
            v.check_bool(bad, "b")


class Color(enum.Enum):
    RED = "red"
    DARK_BLUE = "dark_blue"


def test_enums_by_name_or_value():
    assert v.check_enum("red", Color, "color") is Color.RED
    assert v.check_enum(" DARK_BLUE ", Color, "color") is Color.DARK_BLUE
    assert v.check_enum(Color.RED, Color, "color") is Color.RED
    with pytest.raises(ConfigError, match="color must be one of red, dark_blue; got 'green'"):
        v.check_enum("green", Color, "color")
    with pytest.raises(UnknownPolicyError):
        v.check_enum(3, Color, "color", error=UnknownPolicyError)


@pytest.mark.reliability
def test_the_one_salt_rule():
    assert v.check_salt(None) is None and v.check_salt("t") == "t"
    with pytest.raises(InvalidSaltError, match="empty str, which vLLM treats as no salt"):
        v.check_salt("")
    for bad in (b"x", 5, 0, False, ["t"]):
        with pytest.raises(InvalidSaltError, match=f"cache_salt must be a non-empty str .* got {type(bad).__name__}"):
            v.check_salt(bad)
    # One class: a ConfigError (the embedded engine's old class) and an InputError (the
    # remote engine's), so callers of either keep working.
    assert issubclass(InvalidSaltError, ConfigError) and issubclass(InvalidSaltError, InputError)


@given(st.text(min_size=1, max_size=140, alphabet=st.sampled_from("ab@/\\\x00\x1f:-_é")))
@settings(max_examples=200, deadline=None)
def test_a_salt_is_accepted_exactly_when_vllm_serve_accepts_it(salt):
    """``"user@acme.com"``, ``"acme/prod"`` and 129-character salts passed, ran in
    process, and every request of that tenant failed with HTTP 400 once served."""
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    try:
        validate_cache_salt(salt)
        served = True
    except Exception:  # noqa: BLE001 - vLLM's validation error
        served = False
    try:
        v.check_salt(salt)
        ours = True
    except InvalidSaltError as exc:
        assert "vLLM refuses a cache_salt" in str(exc)
        ours = False
    assert ours == served


def test_a_number_too_large_for_a_float_is_a_config_error():
    """``float(10**400)`` overflows: ``check_number`` raised a raw OverflowError."""
    for huge in (10**400, -(10**400)):
        with pytest.raises(ConfigError, match="must be a number >= 0"):
            v.check_number(huge, "load_factor")
    assert v.check_number(10**300, "x") == 10**300


def test_text():
    assert v.check_text("", "query") == "" and v.check_text(None, "system", optional=True) is None
    with pytest.raises(InvalidTextError, match=r"system must be a str or None, got bytes b'sys' \(decode"):
        v.check_text(b"sys", "system", optional=True)
    with pytest.raises(InvalidTextError, match="query must be a str, got NoneType"):
        v.check_text(None, "query")
    with pytest.raises(InvalidTextError, match="query must be a str, got int 5$"):
        v.check_text(5, "query")
    long = v._short("x" * 500)
    assert len(long) == 60 and long.endswith("...")


def test_tools_must_be_a_list_of_json_objects():
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert v.check_tools(None) is None
    assert v.check_tools((tool,)) == [tool]
    cases = [
        ("tool", "must be a list of tool schemas"),
        (tool, "wrap a single tool in a list"),
        (b"t", "must be a list"),
        (5, "must be a list"),
        ([tool, 3], r"tools\[1\] must be a dict"),
        ([{"x": object()}], r"tools\[0\] is not JSON"),
        ([{"x": {1}}], r"tools\[0\] is not JSON"),
        ([{"x": math.inf}], r"tools\[0\] is not JSON"),
        ([{1: "a", "b": 2}], r"tools\[0\]: key 1 is int, not str; JSON object keys must be strings"),
    ]
    for value, match in cases:
        with pytest.raises(InvalidToolsError, match=match):
            v.check_tools(value)
    deep: dict = {}
    node = deep
    for _ in range(100_000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(InvalidToolsError, match="nested too deeply"):
        v.check_tools([deep])


def test_messages():
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert v.check_messages(ok) is ok
    assert v.check_messages([]) == []
    fine = [{"role": "tool", "content": "x", "name": "ls", "tool_call_id": None},
            {"role": "assistant", "content": None, "tool_calls": [{"id": None}, {"id": "c1"}, "not a dict"]}]
    assert v.check_messages(fine) is fine  # a malformed call is the renderer's to name
    cases = [
        ("hi", {}, "must be a list of chat messages"),
        ({"role": "user"}, {}, "must be a list of chat messages"),
        ([], {"allow_empty": False}, "is empty"),
        (["hi"], {}, r"messages\[0\] must be a dict"),
        ([{"content": "x"}], {}, r"messages\[0\]\['role'\] must be a non-empty str"),
        ([{"role": "", "content": "x"}], {}, "role"),
        ([{"role": "user", "content": 5}], {}, r"\['content'\] must be a str, a list of parts or None"),
        ([{"role": "user"}], {"require_content": True}, "has no 'content'"),
        # templates that render whole messages sort their keys: a raw TypeError from the hook
        ([{"role": "user", "content": "x", 1: "y"}], {}, r"messages\[0\] has a key that is not a str: 1"),
        ([{"role": "user", "content": "x", None: "y"}], {}, "has a key that is not a str: None"),
        # a template rendered them as their repr; DropFailedCalls hashed them (raw TypeError)
        ([{"role": "user", "content": "x", "name": b"bob"}], {}, r"\['name'\] must be a str or None, got b'bob'"),
        ([{"role": "tool", "content": "x", "tool_call_id": 7}], {}, r"\['tool_call_id'\] must be a str or None"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "a"}, {"id": ["1"]}]}], {},
         r"messages\[0\]\['tool_calls'\]\[1\]\['id'\] must be a str or None, got \['1'\]"),
    ]
    for value, kwargs, match in cases:
        with pytest.raises(InvalidMessageError, match=match):
            v.check_messages(value, **kwargs)


def test_fits_is_a_lower_bound_from_bytes():
    v.check_fits(850, max_token_bytes=85, limit=10, what="max_tokens", fix="raise max_tokens")  # 10 tokens fit
    v.check_fits(10**9, max_token_bytes=85, limit=None, what="max_tokens", fix="")  # no limit
    v.check_fits(10**9, max_token_bytes=0, limit=10, what="max_tokens", fix="")  # unknown vocabulary
    with pytest.raises(ContextLengthError, match="851 UTF-8 bytes, at least 11 tokens .* max_tokens is 10 tokens; raise") as info:
        v.check_fits(851, max_token_bytes=85, limit=10, what="max_tokens", fix="raise max_tokens")
    assert (info.value.prompt_tokens, info.value.max_tokens) == (11, 10)


def test_validate_imports_only_the_errors():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(v.__file__).read_text())
    project = {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("promptsplice")
    }
    assert project == {"promptsplice.errors"}


def test_token_ids():
    import numpy as np

    assert v.check_token_ids((1, 0, 7)) == [1, 0, 7]
    # any iterable of integers, numpy's included: the embedded engine took these and
    # RemoteEngine refused them; 2**33 was taken by one and refused by the other
    assert v.check_token_ids(i for i in (3, 4)) == [3, 4]
    got = v.check_token_ids(np.array([5, 2**32 - 1], dtype=np.int64))
    assert got == [5, 2**32 - 1] and all(type(t) is int for t in got)
    for bad in ([2**32], [2**33], [np.bool_(True)], [np.float32(1.0)]):
        with pytest.raises(InputError, match=r"prompt\[0\] is not a token id"):
            v.check_token_ids(bad)
    for bad, match in (([], "empty"), ([1, -1], r"prompt\[1\] is not a token id"), ([True], r"prompt\[0\]"),
                       ([1.0], r"prompt\[0\]"), ("abc", "list of token ids"), (b"ab", "list of token ids"),
                       ({1: 2}, "list of token ids"), ({5, 3, 1}, "got set"),  # no order: sent as [1, 3, 5]
                       (frozenset({2}), "got frozenset"), ({1: 2}.keys(), "list of token ids")):
        with pytest.raises(InputError, match=match):
            v.check_token_ids(bad)


def test_text_as_an_option():
    with pytest.raises(ConfigError, match="model must be a str or None"):
        v.check_text(5, "model", optional=True, error=ConfigError)

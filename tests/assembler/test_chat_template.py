"""ChatTemplate: what a template or its options can get wrong is the library's error."""

from __future__ import annotations

import pytest

from promptsplice.assembler import ChatRenderer, ChatTemplate
from promptsplice.errors import ConfigError, InputError

LOOP = "{% for m in messages %}{{ m.content }}"
USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("expr", "raised"),
    [
        ("{{ 1/0 }}", "ZeroDivisionError"),
        ("{{ '{:d}'.format(m.content) }}", "ValueError"),
        ("{{ 10.0 ** 400 }}", "OverflowError"),
        ("{{ range(10**6)|length }}", "OverflowError"),  # the sandbox's range limit
        ("{{ m.content.index('zz') }}", "ValueError"),
    ],
)
def test_any_error_a_template_raises_is_an_input_error_naming_it(expr, raised):
    """Only TemplateError, TypeError, KeyError and AttributeError were translated: the
    rest escaped raw from render, the renderer and the hook."""
    tmpl = ChatTemplate(LOOP + expr + "{% endfor %}", name="faulty")
    with pytest.raises(InputError, match=f"chat template faulty cannot render these messages: {raised}") as info:
        tmpl.render(USER)
    assert type(info.value.__cause__).__name__ == raised


def test_a_template_that_recurses_without_end_is_an_input_error(default_tok):
    src = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}" + LOOP + "{{ f(0) }}{% endfor %}"
    with pytest.raises(InputError, match="cannot render these messages: RecursionError"):
        ChatRenderer(default_tok, template=ChatTemplate(src, name="deep")).render(USER)


def test_a_raise_exception_in_the_template_keeps_its_own_message():
    tmpl = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InputError, match="the chat template refused the messages: roles must alternate"):
        tmpl.render(USER)


@pytest.mark.parametrize(
    ("special", "match"),
    [
        ("bos", "must be a dict of names to tokens"),  # was dict("bos"): a raw ValueError
        ([("bos_token", "<s>")], "must be a dict of names to tokens"),
        ({1: "a"}, "must map str names to str tokens"),  # failed every render, as an InputError
        ({"bos_token": 1}, "must map str names to str tokens"),
        ({"messages": "x"}, "may not name 'messages'"),  # a TypeError at render
    ],
)
def test_special_tokens_are_checked_when_built(special, match):
    with pytest.raises(ConfigError, match=match):
        ChatTemplate(LOOP + "{% endfor %}", special_tokens=special)


def test_good_special_tokens_reach_the_template():
    tmpl = ChatTemplate("{{ bos_token }}" + LOOP + "{% endfor %}", special_tokens={"bos_token": "<s>"})
    assert tmpl.render(USER) == "<s>x"
    assert ChatTemplate(LOOP + "{% endfor %}", special_tokens=None).special_tokens == {}


def test_a_template_holding_a_lone_surrogate_is_refused_when_built(default_tok):
    """Every render of it failed with a raw UnicodeEncodeError."""
    with pytest.raises(ConfigError, match=r"lone surrogate '\\ud800' at character 50"):
        ChatTemplate(LOOP + "{% endfor %}\ud800")


@pytest.mark.parametrize("value", [{3, 1, 2}, object(), float("nan"), float("inf"), b"ab", __import__("datetime").date(2020, 1, 1)])
def test_an_extra_field_that_is_not_json_is_an_invalid_message(value):
    """``str()`` keyed these and a template printed their repr (an object's with its
    address: two renders of equal messages gave different tokens, so the prefix cache
    never hit); the README promises ``InvalidMessageError``."""
    from promptsplice.errors import InvalidMessageError

    with pytest.raises(InvalidMessageError, match="message 0 is not a JSON value"):
        ChatRenderer().render([{"role": "user", "content": "x", "meta": value}])
    # JSON values pass: lists, dicts, finite floats, None
    assert ChatRenderer().render([{"role": "user", "content": "x", "meta": [1, {"a": None}, 1.5]}]).text


def test_messages_as_other_mappings_render_like_dicts_and_images_stay_non_text():
    """After the JSON check became strict, a ``UserDict`` message with a tool call was
    refused, and an image part's bytes read as "not JSON" instead of non-text content
    (which the integrations pass through unrendered): a review of the change."""
    from collections import UserDict

    from promptsplice.errors import NonTextContentError

    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    plain = ChatRenderer().render([{"role": "user", "content": "x"}, call])
    assert ChatRenderer().render([UserDict({"role": "user", "content": "x"}), UserDict(call)]).token_ids == plain.token_ids
    with pytest.raises(NonTextContentError, match="only text content parts"):
        ChatRenderer().render([{"role": "user", "content": [{"type": "image", "image": b"\x89PNG"}]}])

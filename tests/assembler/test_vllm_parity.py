"""The renderer's text is what vLLM's chat endpoint renders for the same messages (so the
prefix cache hits): text parts joined with a newline, and a call's JSON-text arguments
parsed into the object before a template that renders tool calls itself prints them.

Compared with vLLM's own chat utilities (``parse_chat_messages`` and
``safe_apply_chat_template``, the path of its HF renderer, called without an engine) where
vLLM is installed; the pinned strings below hold without it."""

from __future__ import annotations

import copy

import pytest

from promptsplice.assembler import ChatRenderer, ChatTemplate, ContextHook, TruncateToolOutputs

# Qwen2.5-Instruct's chat template (tokenizer_config.json), which renders tools and
# tool calls itself: ``tool_call.arguments | tojson``.
QWEN25_SRC = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The tool-call branch of Llama-3.1-Instruct's template: it tests ``'tool_calls' in
# message`` (an empty list takes the branch and is refused) and prints the arguments
# with tojson.
LLAMA31_SRC = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls|length == 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def call(args, cid="c0", name="search"):
    fn = {"name": name} if args is _MISSING else {"name": name, "arguments": args}
    return {"id": cid, "type": "function", "function": fn}


_MISSING = object()


def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


@pytest.fixture(scope="module")
def qwen(default_tok):
    return ChatRenderer(default_tok, block_size=16, template=ChatTemplate(QWEN25_SRC, name="qwen2.5"), alignment="none")


@pytest.fixture(scope="module")
def llama(default_tok):
    tmpl = ChatTemplate(LLAMA31_SRC, name="llama3.1", special_tokens={"bos_token": "<|begin_of_text|>"})
    return ChatRenderer(default_tok, block_size=16, template=tmpl, alignment="none")


@pytest.fixture(scope="module")
def chatml(default_tok):
    return ChatRenderer(default_tok, block_size=16, alignment="none")


def text_of(renderer, messages, tools=None):
    res = renderer.render(messages, tools)
    assert "".join(s.text for s in res.segments) == res.text
    return res.text


# -- pinned strings (no vLLM needed) ---------------------------------------------------


def test_text_parts_join_with_a_newline_on_every_template(chatml, qwen):
    """``[{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]``
    rendered "Helloworld"; vLLM's chat endpoint (content format "string") and LangChain's
    ``convert_to_openai_messages`` give "Hello\\nworld"."""
    msgs = [{"role": "user", "content": parts("Hello", "world")}]
    for r in (chatml, qwen):
        text = text_of(r, msgs)
        assert "<|im_start|>user\nHello\nworld<|im_end|>\n" in text
        assert r.render(msgs).token_ids == r.render([{"role": "user", "content": "Hello\nworld"}]).token_ids
    # bare strings and a tool output's parts too; one part is its text
    tool = [{"role": "user", "content": ["a", {"type": "text", "text": "b"}]},
            {"role": "tool", "tool_call_id": "c0", "content": parts("line 1", "line 2")}]
    assert "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>tool\nline 1\nline 2<|im_end|>\n" in text_of(chatml, tool)
    assert text_of(chatml, [{"role": "user", "content": parts("one")}]) == text_of(chatml, [{"role": "user", "content": "one"}])


def test_json_text_arguments_reach_a_template_that_renders_calls_as_the_object(qwen):
    """Qwen2.5 printed ``"arguments": "{\\"q\\": \\"a\\"}"`` (the text encoded again as a
    JSON string) where vLLM, which parses the text first, prints ``"arguments": {"q": "a"}``."""
    as_text = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call('{"q": "a"}')]}]
    as_object = [as_text[0], {**as_text[1], "tool_calls": [call({"q": "a"})]}]
    text = text_of(qwen, as_text)
    assert '<tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>' in text
    assert "\\\"" not in text
    assert qwen.render(as_text).token_ids == qwen.render(as_object).token_ids
    # the caller's messages are not touched
    assert as_text[1]["tool_calls"][0]["function"]["arguments"] == '{"q": "a"}'


@pytest.mark.parametrize("args", ["", "   ", None, _MISSING, "not json", '{"q": "a"', "[1, 2]", "42", "true", '"s"', [], 0,
                                  "[" * 100_000 + "]" * 100_000])
def test_arguments_that_are_no_json_object_render_as_an_empty_object(qwen, args):
    """vLLM's ``_postprocess_messages``: no arguments, text that is not JSON and JSON
    that is not an object reach the template as ``{}``; text too deep for Python's
    parser (which vLLM fails on) as well."""
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call(args)]}]
    assert '{"name": "search", "arguments": {}}' in text_of(qwen, msgs)
    from promptsplice.assembler._chat_template import template_arguments

    assert template_arguments(args if args is not _MISSING else None) == {}


def test_a_step_that_only_writes_a_calls_arguments_as_their_object_is_an_append(default_tok):
    """README: "a call's arguments from JSON text to the same object is the append the
    hook sees too" held on ChatML only; under a template that renders calls it was an
    edit of the assistant turn (its text rendered as a JSON string)."""
    hook = ContextHook(default_tok, block_size=16, template=ChatTemplate(QWEN25_SRC, name="qwen2.5"))
    first = [{"role": "user", "content": "weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]},
             {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    hook("s", first, TOOLS)
    second = [first[0], {**first[1], "tool_calls": [call({"city": "Paris"})]}, first[2],
              {"role": "assistant", "content": "Sunny."}]
    step = hook("s", second, TOOLS)
    assert step.fallback is None and step.diff.directives == () and step.diff.base > 0


def test_empty_or_none_tool_calls_and_calls_of_other_roles_are_left_out(llama):
    """vLLM leaves out an assistant's ``tool_calls`` that is ``None`` or empty, and never
    passes on the calls of another role: Llama-3.1 tests ``'tool_calls' in message``
    and refused an empty list ("only supports single tool-calls")."""
    want = text_of(llama, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    for calls in ([], None):
        assert text_of(llama, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "tool_calls": calls}]) == want
    assert text_of(llama, [{"role": "user", "content": "hi", "tool_calls": [call("{}")]},
                           {"role": "assistant", "content": "hello"}]) == want


def test_chatml_folds_calls_in_with_their_arguments_parsed_as_before(chatml):
    """The default template ignores ``tool_calls``: promptsplice writes them as
    ``<tool_call>`` lines with canonical JSON, JSON text and its object alike (text that
    is not JSON stays as the model wrote it)."""
    user = {"role": "user", "content": "go"}
    as_text = text_of(chatml, [user, {"role": "assistant", "content": None, "tool_calls": [call('{"q": "a", "k": 2}')]}])
    as_object = text_of(chatml, [user, {"role": "assistant", "content": None, "tool_calls": [call({"k": 2, "q": "a"})]}])
    assert as_text == as_object and '{"arguments":{"k":2,"q":"a"},"name":"search"}' in as_text
    assert '{"arguments":"not json","name":"search"}' in text_of(
        chatml, [user, {"role": "assistant", "content": None, "tool_calls": [call("not json")]}])


def test_the_ten_line_rule_counts_the_lines_of_text_parts(default_tok):
    """Policies read a tool output's parts as the model reads them: joined with a newline.
    Joined with nothing, twelve one-line parts were one line (never truncated), and a cut
    output written back as one str ran two parts' lines together."""
    lines = [f"row {i}" for i in range(12)]
    msgs = [{"role": "user", "content": "list"}, {"role": "tool", "tool_call_id": "c0", "content": parts(*lines)},
            {"role": "user", "content": "and?"}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    res = TruncateToolOutputs(10).apply(msgs)
    assert res.messages[1]["content"] == "\n".join(lines[:4] + ["[... 4 lines truncated ...]"] + lines[8:])
    hook = ContextHook(default_tok, block_size=16, policies=[TruncateToolOutputs(10)])
    assert "row 3\n[... 4 lines truncated ...]\nrow 8" in hook("t", msgs).render.text


# -- against vLLM's own rendering -------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_render():
    """``messages -> text`` through vLLM's chat path: ``parse_chat_messages`` (content
    parsing, ``_postprocess_messages``) in the content format vLLM detects for the
    template, then ``safe_apply_chat_template``, with the default model's tokenizer."""
    import vllm.renderers.chat_utils as chat_utils  # installed with the project: never a skip
    import vllm.renderers.hf as hf_renderer
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig

    from promptsplice.assets import default_model_dir

    folder = str(default_model_dir())
    config = ModelConfig(model=folder, tokenizer=folder)
    hf = AutoTokenizer.from_pretrained(folder)

    def render(messages, tools=None, template=None):
        src = (template or ChatTemplate.default()).source
        fmt = hf_renderer._detect_content_format(src, default="string")
        assert fmt == "string"  # the format these tests are about
        conversation, _, _ = chat_utils.parse_chat_messages(copy.deepcopy(messages), config, content_format=fmt)
        kwargs = dict(tools=tools, chat_template=src, tokenize=False, add_generation_prompt=True)
        if template is not None:
            kwargs.update(template.special_tokens)
        return hf_renderer.safe_apply_chat_template(config, hf, conversation, **kwargs)

    return render


TEXT_PARTS = [
    {"role": "system", "content": parts("You are terse.", "Answer in French.")},
    {"role": "user", "content": ["Bonjour", {"type": "text", "text": "ça va ?"}]},
    {"role": "assistant", "content": parts("Oui.", "Et vous ?")},
    {"role": "user", "content": parts("", "vide avant")},
]

CALLS = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": parts("Find", "Lyon and Nice")},
    {"role": "assistant", "content": None, "tool_calls": [
        call('{"q": "Lyon", "k": 2}', "c1"), call({"q": "Nice"}, "c2"), call("", "c3"), call("not json", "c4"),
        call("[1, 2]", "c5"), call(None, "c6"), call(_MISSING, "c7"), call('{"q": "caf\\u00e9 \\"x\\""}', "c8")]},
    {"role": "tool", "tool_call_id": "c1", "content": parts("Lyon: 522,250", "(2021)")},
    {"role": "tool", "tool_call_id": "c2", "content": "Nice: 348,085"},
    {"role": "assistant", "content": "Calling again.", "tool_calls": [call('{"q":"Paris"}', "c9")]},
    {"role": "tool", "tool_call_id": "c9", "content": "Paris: 2.1 million"},
    {"role": "assistant", "content": "Done.", "tool_calls": []},
    {"role": "user", "content": "Thanks."},
]


def test_the_default_template_renders_text_parts_as_vllm_does(chatml, vllm_render):
    assert text_of(chatml, TEXT_PARTS) == vllm_render(TEXT_PARTS)
    tail = TEXT_PARTS[1:] + [{"role": "tool", "tool_call_id": "c1", "content": parts("a", "b")}]
    assert text_of(chatml, tail) == vllm_render(tail)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_template_that_renders_calls_renders_them_as_vllm_does(qwen, vllm_render, tools):
    tmpl = qwen.template
    for msgs in (TEXT_PARTS, CALLS):
        assert text_of(qwen, msgs, tools) == vllm_render(msgs, tools, tmpl)


def test_llama_style_calls_render_as_vllm_renders_them(llama, vllm_render):
    tmpl = llama.template
    for args in ('{"q": "a"}', {"q": "a"}, "", "oops", "[1]"):
        msgs = [{"role": "user", "content": parts("Search", "for a")},
                {"role": "assistant", "content": None, "tool_calls": [call(args)]},
                {"role": "tool", "tool_call_id": "c0", "content": parts("r1", "r2")},
                {"role": "assistant", "content": "found", "tool_calls": []},
                {"role": "user", "content": "ok", "tool_calls": [call("{}")]}]
        assert text_of(llama, msgs) == vllm_render(msgs, None, tmpl)

"""The renderer's text is what vLLM's chat endpoint renders for the same messages (so the
prefix cache hits): text parts joined with a newline, and a call's JSON-text arguments
parsed into the object before a template that renders tool calls itself prints them.

Compared with vLLM's own chat utilities (``parse_chat_messages`` and
``safe_apply_chat_template``, the path of its HF renderer, called without an engine) where
vLLM is installed; the pinned strings below hold without it."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptsplice.assembler import ChatRenderer, ChatTemplate, ContextHook, TruncateToolOutputs

# Gemma-3-it's chat template: it loops over a message's content parts (vLLM's "openai"
# format), trims each and joins them with nothing, and enforces user/model alternation.
GEMMA3_SRC = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

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
def gemma(default_tok):
    tmpl = ChatTemplate(GEMMA3_SRC, name="gemma3", special_tokens={"bos_token": "<bos>"})
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


# a macro that gets a message's content and loops over it; a loop over a top-level
# ``content``; one that loops over the messages only; a tuple target vLLM's walk refuses
MACRO_SRC = ("{% macro body(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
             "{% for m in messages %}{{ m.role }}: {{ body(m.content) }}\n{% endfor %}")
TOP_CONTENT_SRC = ("{% for m in messages %}{% set content = m.content %}{{ m.role }}:"
                   "{% if content is string %}{{ content }}{% else %}{% for p in content %}[{{ p.text }}]{% endfor %}"
                   "{% endif %}\n{% endfor %}")
PLAIN_SRC = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
TUPLE_SRC = "{% for i, m in messages %}{{ m }}{% endfor %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"
FORMATS = [(GEMMA3_SRC, "openai"), (MACRO_SRC, "openai"), (TOP_CONTENT_SRC, "openai"), (PLAIN_SRC, "string"),
           (QWEN25_SRC, "string"), (LLAMA31_SRC, "string"), (TUPLE_SRC, "string")]


@pytest.mark.parametrize(("src", "fmt"), FORMATS)
def test_the_content_format_is_read_off_the_template(src, fmt):
    assert ChatTemplate(src).content_format == fmt


def test_a_template_that_loops_over_content_parts_gets_them_as_a_list(gemma):
    """Gemma 3 trims each part and joins them with nothing: vLLM hands it the parts, so
    ``["Hello", "world"]`` is "Helloworld" there; promptsplice joined them with a
    newline first ("Hello\nworld") and missed the cache from that message on."""
    msgs = [{"role": "system", "content": parts("Be terse.", "Always.")},
            {"role": "user", "content": parts("Hello ", " world")},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "bye"}]
    text = text_of(gemma, msgs)
    assert text.startswith("<bos><start_of_turn>user\nBe terse.\n\nHelloworld<end_of_turn>\n<start_of_turn>model\nHi.")
    # a tool output's parts reach the template as one text, as vLLM joins them (in this
    # format, an empty part too)
    text = text_of(gemma, [{"role": "user", "content": "go"}, {"role": "tool", "content": parts("a", "", "b")}])
    assert "<start_of_turn>tool\na\n\nb<end_of_turn>\n" in text


def test_tools_go_into_the_first_part_of_a_system_message_in_the_openai_format(gemma, default_tok):
    """Templates without tools support get the tools block in the system text; in the
    part-list form it goes after the first part's text, which Gemma 3 prints alone (after
    the last part it vanished from the prompt)."""
    from promptsplice.assembler._render import TOOLS_HEADER
    from promptsplice.errors import ConfigError

    msgs = [{"role": "system", "content": parts("Be terse.", "Always.")}, {"role": "user", "content": "hi"}]
    res = gemma.render(msgs, TOOLS)
    assert res.text.startswith("<bos><start_of_turn>user\nBe terse." + TOOLS_HEADER)
    # Gemma folds the system text into the first user turn: the tools stay in its segment
    assert [(s.kind.name, s.message_index) for s in res.segments] == [("MESSAGE", 0), ("MESSAGE", 1), ("GENERATION", None)]
    assert TOOLS_HEADER in res.segments[1].text and "Always.\n\nhi" not in res.text
    # a template that leaves the system message out: the tools cannot be dropped silently
    drops = ChatRenderer(default_tok, block_size=16, alignment="none", template=ChatTemplate(
        "{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"))
    with pytest.raises(ConfigError, match="leaves out the system text promptsplice puts the tools in"):
        drops.render(msgs, TOOLS)
    assert drops.render(msgs).text == "user: hi\n"


def test_developer_messages_render_as_one_system_message_in_front(chatml, default_tok):
    """vLLM's rule for a template that never quotes "developer" (ChatML): developer
    messages become system messages and every system message merges into one in front
    ("\n\n" between the texts).  promptsplice rendered an untrained ``developer`` turn
    after the template's default system prompt."""
    system = text_of(chatml, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}])
    assert text_of(chatml, [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]) == system
    msgs = [{"role": "system", "content": "S."}, {"role": "user", "content": "hi"},
            {"role": "developer", "content": parts("Be", "terse.")}, {"role": "user", "content": "ok"}]
    res = chatml.render(msgs)
    assert res.text.startswith("<|im_start|>system\nS.\n\nBe\nterse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    assert "developer" not in res.text
    # the merged message keeps a segment, empty, where the caller put it
    assert [(s.message_index, s.end - s.start) for s in res.segments if s.message_index == 2] == [(2, 0)]
    assert res.message_span(2)[0] == res.message_span(2)[1] == res.message_span(3)[0]
    assert [s.message_index for s in res.segments] == [0, 1, 2, 3, None]
    # a developer message after the first user turn moves in front, the system slot empty
    late = chatml.render([{"role": "user", "content": "hi"}, {"role": "developer", "content": "D"}])
    assert late.text.startswith("<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    assert [s.message_index for s in late.segments] == [1, 0, None]
    # without a developer message, a later system message stays where it is (vLLM too)
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>system\nD<|im_end|>" in text_of(
        chatml, [{"role": "user", "content": "hi"}, {"role": "system", "content": "D"}])


def test_a_template_that_knows_the_developer_role_gets_it(default_tok):
    src = ("{% for m in messages %}{% if m.role == 'developer' %}[dev]{% else %}[{{ m.role }}]{% endif %}"
           "{{ m.content }}\n{% endfor %}")
    r = ChatRenderer(default_tok, block_size=16, template=ChatTemplate(src, name="dev"), alignment="none")
    assert text_of(r, [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}]) == "[system]s\n[dev]d\n"


def test_claude_codes_billing_header_line_is_left_out_of_the_system_prompt(chatml):
    """Its ``cch`` changes every request; vLLM's chat endpoint drops the line (and a
    part that holds nothing else), so the rest of the prompt can hit the cache."""
    head = "x-anthropic-billing-header: cc_version=2.1.3; cch=8f2a;"
    want = text_of(chatml, [{"role": "system", "content": "You are Claude Code."}, {"role": "user", "content": "hi"}])
    for content in (f"{head}\nYou are Claude Code.", [head, "You are Claude Code."],
                    parts(head, "You are Claude Code."), parts(f"{head}\nYou are Claude Code.")):
        assert text_of(chatml, [{"role": "system", "content": content}, {"role": "user", "content": "hi"}]) == want
    # only a system message's, only at the start of a part
    assert head in text_of(chatml, [{"role": "user", "content": f"{head}\nhi"}])
    assert head in text_of(chatml, [{"role": "system", "content": f"see {head}"}])


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

    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    def render(messages, tools=None, template=None):
        src = (template or ChatTemplate.default()).source
        fmt = hf_renderer._detect_content_format(src, default="string")
        assert fmt == (template or ChatTemplate.default()).content_format  # vLLM's and ours agree
        try:  # through the chat endpoint's request model where it takes them (it renames, reorders)
            messages = [
                m if isinstance(m.get("content"), (str, list, type(None))) else {**m, "content": list(m["content"])}
                for m in ChatCompletionRequest(model="m", messages=copy.deepcopy(messages)).messages
            ]  # its parts are validated as they are read
        except ValidationError:  # refused there (arguments as an object...): LLM.chat's path
            messages = copy.deepcopy(messages)
        conversation, _, _ = chat_utils.parse_chat_messages(messages, config, content_format=fmt)
        kwargs = dict(tools=tools, chat_template=src, tokenize=False, add_generation_prompt=True)
        if template is not None:
            kwargs.update(template.special_tokens)
            kwargs.update(template.variables)  # as chat_template_kwargs
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


DEVELOPER = [
    [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S."}, {"role": "developer", "content": parts("Be", "terse.")},
     {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "developer", "content": "D"}, {"role": "assistant", "content": "ok"},
     {"role": "system", "content": ""}, {"role": "developer", "content": "E"}, {"role": "user", "content": "go"}],
    [{"role": "system", "content": "x-anthropic-billing-header: cch=1;\nYou are Claude Code."},
     {"role": "developer", "content": "D"}, {"role": "user", "content": "hi"}],
    [{"role": "system", "content": parts("x-anthropic-billing-header: cch=1;", "Rules.")}, {"role": "user", "content": "hi"}],
]


@pytest.mark.parametrize("msgs", DEVELOPER)
def test_developer_and_system_messages_render_as_vllm_renders_them(chatml, qwen, vllm_render, msgs):
    assert text_of(chatml, msgs) == vllm_render(msgs)
    assert text_of(qwen, msgs) == vllm_render(msgs, None, qwen.template)
    assert text_of(qwen, msgs, TOOLS) == vllm_render(msgs, TOOLS, qwen.template)


@pytest.mark.parametrize(("src", "fmt"), FORMATS)
def test_the_content_format_is_the_one_vllm_detects(src, fmt):
    import vllm.renderers.hf as hf_renderer

    assert hf_renderer._detect_content_format(src, default="string") == fmt == ChatTemplate(src).content_format


OPENAI_FORMAT = [
    [{"role": "user", "content": parts("Hello ", " world", "")}, {"role": "assistant", "content": parts("Hi", "there")},
     {"role": "user", "content": ["a", {"type": "text", "text": "b"}]}],
    [{"role": "system", "content": parts("Be terse.", "Always.")}, {"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S."}, {"role": "user", "content": parts("x", "y")},
     {"role": "developer", "content": parts("D1", "", "D2")}, {"role": "assistant", "content": None},
     {"role": "user", "content": "z"}],
    [{"role": "system", "content": parts("x-anthropic-billing-header: cch=2;", "Rules.")}, {"role": "user", "content": "hi"}],
]


@pytest.mark.parametrize("msgs", OPENAI_FORMAT)
@pytest.mark.parametrize("src", [GEMMA3_SRC, TOP_CONTENT_SRC, MACRO_SRC])
def test_a_template_in_the_openai_format_renders_as_vllm_renders_it(default_tok, vllm_render, src, msgs):
    tmpl = ChatTemplate(src, name="openai-format", special_tokens={"bos_token": "<bos>"})
    r = ChatRenderer(default_tok, block_size=16, template=tmpl, alignment="none")
    assert text_of(r, msgs) == vllm_render(msgs, None, tmpl)


# reads every field a message may carry: vLLM passes on only the ones it knows
FIELDS_SRC = ("{% for m in messages %}{{ m.role }}|{{ m.name }}|{{ m.tool_call_id }}|{{ m.task }}|{{ m.status }}|"
              "{{ m.id }}|{{ m.reasoning_content }}|{{ m.reasoning }}: {{ m.content }}\n{% endfor %}")


def test_only_the_fields_vllm_passes_on_reach_the_template(default_tok, vllm_render):
    """A caller's ``reasoning`` reached a Qwen3-style template as ``reasoning`` only
    (vLLM also sets ``reasoning_content``, which those templates print; its request model
    renames a deprecated ``reasoning_content`` to ``reasoning`` first), and an ``id`` or a
    ``status`` reached it where vLLM drops them."""
    msgs = [{"role": "user", "content": "hi", "name": "ann", "id": "m1", "tool_call_id": "x", "task": "t"},
            {"role": "assistant", "content": "ok", "reasoning": "think", "id": "m2"},
            {"role": "assistant", "content": "ok", "reasoning_content": "mine", "status": "done"},
            {"role": "tool", "content": "out", "tool_call_id": "c1", "status": "error", "name": "f"}]
    tmpl = ChatTemplate(FIELDS_SRC, name="fields")
    r = ChatRenderer(default_tok, block_size=16, template=tmpl, alignment="none")
    text = text_of(r, msgs)
    assert text == vllm_render(msgs, None, tmpl)
    assert text == ("user|ann||t||||: hi\nassistant||||||think|think: ok\nassistant||||||mine|mine: ok\n"
                    "tool|f|c1|||||: out\n")


_TEXTS = st.sampled_from(["", "a", "b c", " x ", "l1\nl2", "\n", "x-anthropic-billing-header: cch=1;",
                          "x-anthropic-billing-header: c;\nrest"])
_CONTENT = st.one_of(st.none(), _TEXTS, st.lists(st.one_of(_TEXTS, _TEXTS.map(lambda t: {"type": "text", "text": t})),
                                                 max_size=3))
# calls in the key order of vLLM's request model: a request it refuses (arguments as an
# object, content None) takes LLM.chat's path, which keeps the caller's order
_CALLS = st.lists(st.builds(lambda a, i: {"id": f"c{i}", "function": {"arguments": a, "name": "f"}, "type": "function"},
                            st.sampled_from(['{"q": 1}', {"q": "x"}, "", "bad", None]), st.integers(0, 3)), max_size=2)
_EXTRA = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["n", ""]), "reasoning": st.sampled_from(["r", None]), "reasoning_content": st.just("rc"),
    "tool_call_id": st.just("t1"), "id": st.just("i"), "task": st.just("tk"), "tool_calls": _CALLS})
_MESSAGE = st.builds(lambda r, c, e: {"role": r, "content": c, **e},
                     st.sampled_from(["system", "developer", "user", "assistant", "tool"]), _CONTENT, _EXTRA)
_TEMPLATES = {"qwen": QWEN25_SRC, "llama": LLAMA31_SRC, "gemma": GEMMA3_SRC, "top": TOP_CONTENT_SRC, "macro": MACRO_SRC,
              "plain": PLAIN_SRC, "fields": FIELDS_SRC,
              "raw": "{% for m in messages %}{{ m }}{% if m.tool_calls %}!{% endif %}\n{% endfor %}"}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(msgs=st.lists(_MESSAGE, min_size=1, max_size=5), name=st.sampled_from(["chatml", *_TEMPLATES]))
def test_any_conversation_renders_as_vllm_renders_it_or_both_refuse_it(default_tok, vllm_render, msgs, name):
    """Roles, content forms, extra fields and calls at random, on templates of both
    content formats, one printing each message as the dict it gets (1,500 examples ran
    clean before this was pinned at 150).  The one
    difference on purpose: a template that ignores ``tool_calls`` gets an assistant's
    calls as ``<tool_call>`` lines, where vLLM drops them.  promptsplice follows the chat
    endpoint where vLLM's two paths differ (its request model renames
    ``reasoning_content`` and orders a call's keys; LLM.chat does neither), so the
    strategy's calls come in that order and the rename is made before both."""
    from promptsplice.errors import InputError

    tmpl = ChatTemplate.default() if name == "chatml" else ChatTemplate(
        _TEMPLATES[name], name=name, special_tokens={"bos_token": "<bos>"})
    if not tmpl.native_tool_calls and any(m["role"] == "assistant" and m.get("tool_calls") for m in msgs):
        msgs = [{k: v for k, v in m.items() if k != "tool_calls"} for m in msgs]
    # the request model's rename (LLM.chat's path drops a reasoning_content instead)
    msgs = [m if m.get("reasoning") is not None or "reasoning_content" not in m else
            {**{k: v for k, v in m.items() if k != "reasoning_content"}, "reasoning": m["reasoning_content"]} for m in msgs]
    r = _renderers.setdefault(name, ChatRenderer(default_tok, block_size=16, template=tmpl, alignment="none"))
    try:
        want = vllm_render(msgs, None, None if name == "chatml" else tmpl)
    except Exception:  # vLLM refuses it (the template raised, or its checks)
        with pytest.raises(InputError):
            r.render(msgs)
        return
    assert text_of(r, msgs) == want


_renderers: dict[str, ChatRenderer] = {}


def test_the_content_format_can_be_set_as_vllm_serve_sets_it(default_tok):
    from promptsplice.errors import ConfigError

    msgs = [{"role": "user", "content": parts("Hello", "world")}]
    forced = ChatTemplate(GEMMA3_SRC, name="gemma3", special_tokens={"bos_token": "<bos>"}, content_format="string")
    assert forced.content_format == "string"
    r = ChatRenderer(default_tok, block_size=16, template=forced, alignment="none")
    assert "<start_of_turn>user\nHello\nworld<end_of_turn>" in text_of(r, msgs)
    assert ChatTemplate(PLAIN_SRC, content_format="openai").content_format == "openai"
    for bad in ("auto ", "OpenAI", None, 1):
        with pytest.raises(ConfigError, match="content_format must be 'auto', 'string' or 'openai'"):
            ChatTemplate(PLAIN_SRC, content_format=bad)


def test_a_message_reaches_the_template_with_vllms_key_order(default_tok, vllm_render):
    """``template_calls`` moved ``tool_calls`` to the end: a template that prints the
    message (``tojson``, ``items()``) printed other text than vLLM's."""
    tmpl = ChatTemplate("{% for m in messages %}{{ m | tojson }}{% if m.tool_calls %}!{% endif %}\n{% endfor %}",
                        name="tojson")
    r = ChatRenderer(default_tok, block_size=16, template=tmpl, alignment="none")
    msgs = [{"role": "user", "content": "u", "name": "ann"},
            {"tool_calls": [call('{"q": 1}')], "reasoning": "r", "content": None, "role": "assistant", "id": "x"},
            {"role": "tool", "content": "out", "tool_call_id": "c0", "name": "search"}]
    assert text_of(r, msgs) == vllm_render(msgs, None, tmpl)


def test_a_lone_surrogate_in_a_merged_developer_message_is_named_by_its_own_index(chatml):
    from promptsplice.errors import InvalidUTF8Error

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "developer", "content": "x\ud800"}]
    with pytest.raises(InvalidUTF8Error) as err:
        chatml.render(msgs)
    assert err.value.index == 2
    # in a legacy call (rendered, though not a field vLLM passes on), and behind a field
    # that never reaches the template
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"q": "\ud800"}'}}
    unrendered = {"role": "user", "content": "a", "id": "\ud801"}
    for msgs, index in (([{"role": "user", "content": "u"}, legacy], 1), ([unrendered, {"role": "user", "content": "\ud800"}], 1)):
        with pytest.raises(InvalidUTF8Error) as err:
            chatml.render(msgs)
        assert err.value.index == index


TEXT_TYPES = [{"role": "user", "content": [{"type": "input_text", "text": "in"}, {"type": "text", "text": None},
                                           {"type": "refusal", "refusal": None}, "bare"]},
              {"role": "assistant", "content": [{"type": "output_text", "text": "out"}, {"type": "refusal", "refusal": "no"},
                                                {"type": "thinking", "thinking": "hm"}]},
              {"role": "tool", "content": [{"type": "input_text", "text": "t1"}, {"type": "output_text", "text": "t2"}]},
              {"role": "user", "content": "ok"}]


@pytest.mark.parametrize("src", [None, GEMMA3_SRC, TOP_CONTENT_SRC])
def test_every_part_type_vllm_reads_as_text_renders_as_vllm_renders_it(default_tok, vllm_render, src):
    """``input_text``/``output_text`` (Responses API), ``refusal`` and ``thinking`` parts
    were a NonTextContentError (the integrations then passed the turn through
    unrendered); vLLM reads them as text, and leaves out a text part without text."""
    tmpl = ChatTemplate.default() if src is None else ChatTemplate(src, special_tokens={"bos_token": "<bos>"})
    r = ChatRenderer(default_tok, block_size=16, template=tmpl, alignment="none")
    msgs = TEXT_TYPES if src != GEMMA3_SRC else [m for m in TEXT_TYPES if m["role"] != "tool"]
    text = text_of(r, msgs)
    assert text == vllm_render(msgs, None, None if src is None else tmpl)
    if src is None:
        assert "user\nin\nbare<|im_end|>\n<|im_start|>assistant\nout\nno\nhm<|im_end|>\n<|im_start|>tool\nt1\nt2" in text


# a Qwen3-style switch: the generation prompt closes an empty think block when thinking is off
THINK_SRC = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n"
             "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_template_variables_render_as_vllms_chat_template_kwargs(default_tok, vllm_render):
    """``enable_thinking=False`` (vLLM's ``chat_template_kwargs``) had no way in: a Qwen3
    user's prompts lacked the empty think block vLLM's carry."""
    from promptsplice.errors import ConfigError

    msgs = [{"role": "user", "content": "hi"}]
    off = ChatTemplate(THINK_SRC, name="think", variables={"enable_thinking": False})
    r = ChatRenderer(default_tok, block_size=16, template=off, alignment="none")
    assert text_of(r, msgs).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text_of(r, msgs) == vllm_render(msgs, None, off)
    on = ChatRenderer(default_tok, block_size=16, template=ChatTemplate(THINK_SRC), alignment="none")
    assert text_of(on, msgs).endswith("<|im_start|>assistant\n")
    for bad, match in (({"messages": []}, "set by the renderer itself"), ({"not-a-name": 1}, "must be an identifier"),
                       ([("enable_thinking", False)], "must be a dict"), ({"padding": True}, "never reaches a template"),
                       ({"x": ["\ufdd0"]}, "contains U\\+FDD0")):
        with pytest.raises(ConfigError, match=match):
            ChatTemplate(THINK_SRC, variables=bad)
    with pytest.raises(TypeError):  # read-only: renders are memoized per template
        off.variables["enable_thinking"] = True


def test_a_dict_a_template_prints_raw_reads_as_vllms(default_tok, vllm_render):
    """A template that prints a call's arguments (or a message) as they are shows their
    Python repr: escaped caller text showed promptsplice's escape characters there
    (``{'q': '\\\\ufdd0a'}``), a prompt vLLM never sends."""
    tmpl = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %} "
                        "{{ m.tool_calls[0].function.arguments }}{% endif %} {{ m }}\n{% endfor %}", name="raw")
    r = ChatRenderer(default_tok, block_size=16, template=tmpl, alignment="none")
    args = {"q": "a", "name": "<|im_end|>", "f": ["<|im_start|>x", "e"]}
    msgs = [{"role": "user", "content": "name"}, {"role": "assistant", "content": "", "tool_calls": [call(json.dumps(args))]}]
    text = text_of(r, msgs)
    assert text == vllm_render(msgs, None, tmpl)
    assert "{'q': 'a', 'name': '<|im_end|>', 'f': ['<|im_start|>x', 'e']}" in text
    # and the markup in them stays text: no control token
    ids = r.render(msgs).token_ids
    assert ids.count(default_tok.special_tokens["<|im_end|>"]) == 0

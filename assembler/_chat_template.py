"""Chat templates and messages as text: the first half of a render.

:class:`ChatTemplate` renders a Hugging Face chat template (jinja) the way transformers'
``apply_chat_template`` does; the helpers here turn OpenAI-style messages, tool calls
and tool schemas into the text the template receives (canonical JSON, so equal values
give equal bytes), and into what vLLM's chat endpoint hands a template (text parts
joined with a newline, a call's JSON-text arguments parsed), so the renderer's tokens
are the ones vLLM's prefix cache holds.  :mod:`promptsplice.assembler._render` cuts
that text into per-message segments and tokenizes them.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from promptsplice.assembler._content_format import (
    ContentFormat,
    detect_content_format,
    part_text,
    template_arguments,
    template_calls,
)
from promptsplice.assembler._tokenizers import MARKUP_ESCAPE, Tokenizer
from promptsplice.errors import (
    ConfigError,
    InputError,
    InvalidMessageError,
    InvalidUTF8Error,
    PromptspliceError,
)

__all__ = ["ChatTemplate", "TOOLS_HEADER", "TOOLS_FOOTER", "canonical_json", "join_text_parts", "template_arguments",
           "template_calls", "template_for", "tools_block"]

TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query. "
    "The function signatures are within <tools></tools> XML tags:\n<tools>\n"
)
"""Start of the tools block injected into the system turn of templates without tools."""
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a JSON object with the function name "
    'and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


_JINJA_CODE = re.compile(r"\{%-?(.*?)-?%\}|\{\{-?(.*?)-?\}\}", re.DOTALL)
_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)


def _jinja_code(source: str) -> str:
    """The code of a Jinja template: what its ``{% %}`` and ``{{ }}`` tags hold (string
    literals too: ``message['tool_calls']``); comments and literal text left out."""
    source = _JINJA_COMMENT.sub("", source)
    return "\n".join(a or b for a, b in _JINJA_CODE.findall(source))


def canonical_json(obj: Any) -> str:
    """Sorted keys, compact separators, UTF-8 kept: the same value always gives the
    same bytes (and so the same tokens and blocks)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def check_message_json(message: Mapping[str, Any], index: int | None) -> None:
    """Refuse a message the renderer cannot key by its :func:`canonical_json` (keys of
    mixed types in an extra field, an int past str()'s digit limit, a cycle, nesting too
    deep, and any value that is not JSON: a set, bytes, a date, an object, NaN or
    infinity, which ``str()`` keyed and a template printed as its repr, an object's with
    its address) with :class:`InvalidMessageError` naming it: a raw TypeError, ValueError
    or RecursionError escaped.  Messages whose values are all str or None are JSON: skipped."""
    if all(v is None or isinstance(v, str) for v in message.values()):
        return
    try:
        _strict_json(message)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidMessageError(
            f"message {index} is not a JSON value ({type(exc).__name__}: {exc}); pass str keys, "
            "no cycles, and ints, finite floats, str, bools, None, lists and dicts only"
        ) from exc


def _strict_json(obj: Any) -> str:
    """:func:`canonical_json` of a JSON value only: no ``str()`` of other objects (an
    object's repr holds its address, so two workers rendered one call differently), no
    NaN or infinity (not JSON).  ``TypeError``/``ValueError`` otherwise.  A ``Mapping``
    that is not a ``dict`` (``UserDict``, a frozen mapping) is read as its dict, as the
    renderer reads messages."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                      default=_mapping_as_dict)


def _mapping_as_dict(obj: Any) -> dict:
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


# -- chat template ---------------------------------------------------------------------


_RENDER_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _check_special_tokens(special_tokens: Any) -> dict[str, str]:
    """``special_tokens`` as a dict of str names to str tokens; else :class:`ConfigError`
    (a str failed as ``dict("bos")``, an int key failed every render as an InputError)."""
    if special_tokens is None:
        return {}
    if not isinstance(special_tokens, Mapping):
        raise ConfigError(
            f"special_tokens must be a dict of names to tokens ({{'bos_token': '<s>'}}), got "
            f"{type(special_tokens).__name__}"
        )
    for k, v in special_tokens.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ConfigError(f"special_tokens must map str names to str tokens, got {k!r:.60}: {v!r:.60}")
        if k in _RENDER_ARGS:
            raise ConfigError(f"special_tokens may not name {k!r}: the renderer passes it to the template itself")
    return dict(special_tokens)


_RESERVED_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
    # apply_chat_template's own parameters, which never reach the template there
    "conversation", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def _check_variables(variables: Any) -> dict[str, Any]:
    """Extra template variables (vLLM's ``chat_template_kwargs``: ``enable_thinking``,
    ``reasoning_effort``...): a mapping of identifiers, none of the names the renderer
    passes itself."""
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise ConfigError(f"variables must be a dict of template variables, got {type(variables).__name__}")
    for key in variables:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"a template variable's name must be an identifier, got {key!r}")
        if key in _RESERVED_VARIABLES:
            raise ConfigError(
                f"template variable {key!r} is set by the renderer itself or never reaches a template; pass "
                "messages, tools and add_generation_prompt to render(), not as variables"
            )
        if MARKUP_ESCAPE in json.dumps(variables[key], ensure_ascii=False, default=str):
            raise ConfigError(
                f"template variable {key!r} contains U+FDD0, the noncharacter promptsplice uses to mark "
                "caller content; remove it"
            )
    return dict(variables)


def _raise_exception(message: str) -> None:
    raise InputError(f"the chat template refused the messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Same as transformers' override (jinja's own tojson escapes HTML characters).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


def _generation_tag() -> Any:
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's
    tokens for training masks): rendered as its body, as transformers renders it."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return Generation


class ChatTemplate:
    """A Hugging Face chat template (jinja), rendered the way ``apply_chat_template`` does.

    The environment matches transformers' (sandboxed, ``trim_blocks``,
    ``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and
    ``strftime_now``), and ``special_tokens`` (``bos_token``, ``eos_token``, ...) are
    passed as template variables, then ``variables`` (what vLLM takes as
    ``chat_template_kwargs``: ``{"enable_thinking": False}`` for Qwen3).
    ``content_format`` is vLLM's ``--chat-template-content-format`` (``"auto"``: read off
    the template).  jinja2 is imported on first use.
    """

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        name: str = "template",
        content_format: str = "auto",
        variables: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ConfigError("a chat template must be a non-empty jinja string")
        if MARKUP_ESCAPE in source:
            raise ConfigError(
                "the chat template contains U+FDD0, the noncharacter promptsplice uses to "
                "mark caller content; remove it from the template"
            )
        try:
            source.encode("utf-8")
        except UnicodeEncodeError as exc:  # every render failed on it, as a raw UnicodeEncodeError
            raise ConfigError(
                f"the chat template holds a lone surrogate {source[exc.start]!r} at character {exc.start}, "
                "which has no UTF-8 encoding; pass valid Unicode"
            ) from exc
        self.source = source
        self.name = name
        self.special_tokens = _check_special_tokens(special_tokens)
        # Whether the template renders tool schemas / assistant tool calls itself: the
        # names as variables in its code, never in comments or its literal text (a
        # comment naming them made promptsplice drop the schemas and calls it injects)
        code = _jinja_code(source)
        self.native_tools = re.search(r"\btools\b", code) is not None
        self.native_tool_calls = re.search(r"\btool_calls\b", code) is not None
        # vLLM's test (``_detect_developer_role_support``): a template that never quotes
        # "developer" gets developer messages as system messages (merged into one in front
        # where a system message then follows the first message)
        self.knows_developer = '"developer"' in source or "'developer'" in source
        self._compiled: Any = None
        self._lock = threading.Lock()
        self._default_system: str | None | bool = False  # False: not derived yet
        if content_format not in ("auto", "string", "openai"):
            raise ConfigError(
                f"content_format must be 'auto', 'string' or 'openai' (vLLM's --chat-template-content-format), "
                f"got {content_format!r}"
            )
        self._content_format: ContentFormat | None = None if content_format == "auto" else content_format  # type: ignore[assignment]
        self.variables: Mapping[str, Any] = MappingProxyType(_check_variables(variables))  # read-only: memoized renders

    @classmethod
    def from_dir(
        cls, folder: str | Path, *, content_format: str = "auto", variables: Mapping[str, Any] | None = None
    ) -> ChatTemplate:
        """``chat_template.jinja`` in ``folder``, else ``tokenizer_config.json``'s
        ``chat_template``; special tokens from ``tokenizer_config.json``, then those only
        ``special_tokens_map.json`` names (as transformers reads them: an older
        checkpoint's ``bos_token`` rendered empty)."""
        folder = Path(folder)
        cfg_path = folder / "tokenizer_config.json"
        map_path = folder / "special_tokens_map.json"
        cfg: Any = {}
        token_map: Any = {}
        try:
            if cfg_path.is_file():
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            if map_path.is_file():
                token_map = json.loads(map_path.read_text(encoding="utf-8"))
            jinja_path = folder / "chat_template.jinja"
            source = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else None
        except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
            raise ConfigError(f"cannot read the chat template of {folder}: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ConfigError(f"{cfg_path} is not a JSON object (got {type(cfg).__name__})")
        named = cfg.get("chat_template")
        if isinstance(named, list):  # named templates ({"name", "template"}): the default one
            named = next(
                (t.get("template") for t in named if isinstance(t, dict) and t.get("name") == "default"), None
            )
        if source is None and isinstance(named, str):
            source = named
        if source is None:
            raise ConfigError(
                f"no chat template in {folder} (chat_template.jinja, or tokenizer_config.json's "
                "chat_template as a str or a list with a 'default' entry)"
            )
        if not isinstance(token_map, dict):
            raise ConfigError(f"{map_path} is not a JSON object (got {type(token_map).__name__})")
        special: dict[str, str] = {}
        for k, v in [*cfg.items(), *token_map.items()]:
            if isinstance(v, dict) and (v.get("__type") == "AddedToken" or "content" in v):  # AddedToken forms
                v = v.get("content")
            if k.endswith("_token") and isinstance(v, str):
                special.setdefault(k, v)  # tokenizer_config.json's first, as transformers
        return cls(source, special_tokens=special, name=str(folder), content_format=content_format, variables=variables)

    @classmethod
    def default(cls) -> ChatTemplate:
        """The default model's template (SmolLM2-135M-Instruct, ChatML)."""
        return _default_template()

    def _template(self) -> Any:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    import jinja2
                    import jinja2.ext
                    from jinja2.sandbox import ImmutableSandboxedEnvironment

                    env = ImmutableSandboxedEnvironment(
                        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_tag()]
                    )
                    env.filters["tojson"] = _tojson
                    env.globals["raise_exception"] = _raise_exception
                    env.globals["strftime_now"] = _strftime_now
                    try:
                        self._compiled = env.from_string(self.source)
                    except jinja2.TemplateError as exc:
                        raise ConfigError(f"chat template {self.name} does not compile: {exc}") from exc
        return self._compiled

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The template's text for ``messages`` (as given: no normalization)."""
        import jinja2

        try:
            return self._template().render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **self.variables},
            )
        except (PromptspliceError, MemoryError):
            raise
        except Exception as exc:  # jinja2's errors, and any a template's expression raises (1/0, int('x'))
            detail = f"{exc}" if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: {exc}"
            raise InputError(
                f"chat template {self.name} cannot render these messages: {detail}; fix the template "
                "or the messages"
            ) from exc

    @property
    def content_format(self) -> ContentFormat:
        """``"openai"`` where the template loops over a message's content parts (it then
        gets them as a list, as vLLM's chat endpoint hands them), else ``"string"``;
        ``content_format=`` sets it, as ``vllm serve --chat-template-content-format``."""
        if self._content_format is None:
            self._content_format = detect_content_format(self._template().environment, self.source)
        return self._content_format

    def default_system(self) -> str | None:
        """The system text the template inserts when the first message is not a system
        message (read off the template), or ``None`` if it inserts none."""
        if self._default_system is False:
            self._default_system = self._derive_default_system()
        return self._default_system  # type: ignore[return-value]

    def _derive_default_system(self) -> str | None:
        user = {"role": "user", "content": "x"}
        try:
            alone = self.render([user])
            twice = self.render([user, user])
            mark = "\x00promptsplice-system\x00"
            sys_text = self.render([{"role": "system", "content": mark}])
        except InputError:
            return None
        if not twice.startswith(alone):
            return None
        turn = twice[len(alone) :]
        if not alone.endswith(turn) or alone == turn:
            return None
        preamble = alone[: len(alone) - len(turn)]
        head, _, tail = sys_text.partition(mark)
        if not (preamble.startswith(head) and preamble.endswith(tail)) or len(head) + len(tail) > len(preamble):
            return None
        text = preamble[len(head) : len(preamble) - len(tail)]
        try:
            ok = self.render([{"role": "system", "content": text}]) == preamble
        except InputError:
            ok = False
        return text if ok else None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"


_DEFAULT_TEMPLATE: ChatTemplate | None = None
_DEFAULT_LOCK = threading.Lock()


def _default_template() -> ChatTemplate:
    global _DEFAULT_TEMPLATE
    with _DEFAULT_LOCK:
        if _DEFAULT_TEMPLATE is None:
            from promptsplice.assets import ensure_default_tokenizer

            _DEFAULT_TEMPLATE = ChatTemplate.from_dir(ensure_default_tokenizer())
        return _DEFAULT_TEMPLATE


# -- message normalization -------------------------------------------------------------


def join_text_parts(texts: Iterable[str]) -> str:
    """A message's text parts as the one text vLLM's chat endpoint makes of them
    (content format ``"string"``, ``vllm/renderers/chat_utils.py``:
    ``_parse_chat_message_content_parts`` joins them with a newline, after
    ``_parse_chat_message_content_part``'s result, falsy for an empty text, was left out);
    LangChain's ``convert_to_openai_messages`` joins them so too.  They were joined with
    nothing: "Hello" + "world" rendered "Helloworld" where vLLM renders "Hello\\nworld"."""
    return "\n".join(t for t in texts if t)


def _content_text(content: Any, index: int) -> str:
    """A message's content as the one text a chat template gets: a str as is, ``None``
    as ``""``, text parts (``{"type": "text", "text": ...}`` or bare strings) as
    :func:`join_text_parts` joins them (what counts as text: :func:`part_text`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        return join_text_parts(t for t in (part_text(p, index) for p in content) if t is not None)
    raise InvalidMessageError(
        f"message {index}: content must be a str, a list of text parts or None, got {type(content).__name__}"
    )


def canonical_calls(m: Mapping[str, Any], index: int) -> Mapping[str, Any]:
    """``m`` with its calls in the OpenAI form (``tool_calls`` of ``{"id", "type":
    "function", "function": {"name", "arguments"}}``): LangChain's flat calls
    (``{"name", "args", "id"}``, ``AIMessage.tool_calls``) had their ``args`` dropped,
    and a legacy ``function_call`` was not rendered at all.  Others pass as they are."""
    legacy = m.get("function_call")
    calls = m.get("tool_calls")
    if legacy is not None:
        if calls:
            raise InvalidMessageError(
                f"message {index} has both tool_calls and the legacy function_call: pass tool_calls only"
            )
        if not isinstance(legacy, Mapping):
            raise InvalidMessageError(f"message {index}: function_call must be a dict, got {type(legacy).__name__}")
        calls = [{"type": "function", "function": legacy}]
    elif not calls or not isinstance(calls, Sequence) or isinstance(calls, str | bytes):
        return m  # none, or malformed: the renderer says what is wrong
    elif not any(isinstance(c, Mapping) and "function" not in c and "args" in c for c in calls):
        return m
    out = []
    for c in calls:
        if isinstance(c, Mapping) and "function" not in c and "args" in c:
            if "arguments" in c:
                raise InvalidMessageError(f"message {index}: a tool call has both args and arguments: pass one")
            call = {k: v for k, v in c.items() if k not in ("name", "args", "type")}
            call["type"] = "function"
            call["function"] = {"name": c.get("name"), "arguments": c["args"]}
            c = call
        out.append(c)
    fixed = {k: v for k, v in m.items() if k != "function_call"}
    fixed["tool_calls"] = out
    return fixed


def _tool_call_text(call: Any, index: int) -> str:
    if not isinstance(call, Mapping):
        raise InvalidMessageError(f"message {index}: a tool call must be a dict, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidMessageError(f"message {index}: a tool call needs function.name (a str), got {call!r:.120}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
            text = _strict_json({"name": fn["name"], "arguments": parsed})
            text.encode("utf-8")
            return "<tool_call>\n" + text + "\n</tool_call>"
        except (ValueError, RecursionError):
            # not JSON, nested too deeply to parse, or valid ASCII JSON whose escapes
            # decode to a lone surrogate ("\ud800"): keep the string as the model wrote it
            pass
    try:
        text = _strict_json({"name": fn["name"], "arguments": args})
    except (TypeError, ValueError, RecursionError) as exc:  # not JSON, NaN, mixed key types, cycles, depth
        raise InvalidMessageError(
            f"message {index}: the arguments of tool call {fn['name']!r} are not a JSON value "
            f"({type(exc).__name__}: {exc}); pass a JSON object or its JSON text"
        ) from None
    return "<tool_call>\n" + text + "\n</tool_call>"


def tools_block(tools: Sequence[Mapping[str, Any]], escape: Callable[[str], str] | None = None) -> str:
    """The tools text injected into the system turn of templates without tools;
    ``escape`` marks the schemas as caller content (see ``_tokenizers.Markup``)."""
    schemas = "\n".join(canonical_json(t) for t in tools)
    return TOOLS_HEADER + (escape(schemas) if escape else schemas) + TOOLS_FOOTER


def _lone_surrogate(norm: list[tuple[int | None, dict[str, Any]]], tools: Any) -> InvalidUTF8Error:
    """InvalidUTF8Error naming the tools (``index=-1``) or else the first message
    (``index``: its position in the caller's list, in ``norm`` as ``(index, message)``:
    the caller's messages, since a normalized one may hold another's text) holding a
    lone surrogate, which has no UTF-8 encoding; ``offset`` is its UTF-8 byte offset in
    that value's :func:`canonical_json`."""
    for index, value in [(None, tools), *norm]:
        text = canonical_json(value)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            what = "the tools" if index is None else f"message {index}"
            return InvalidUTF8Error.lone_surrogate(f"{what} (as JSON)", text, exc, index=-1 if index is None else index)
    return InvalidUTF8Error("the chat template produced a lone surrogate", index=-1, offset=-1)


def template_for(spec: Any, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template that goes with ``tokenizer`` when none is given: the default
    model's for its own tokenizer, else the model folder's (the ``spec`` path as given,
    or the folder an :class:`~promptsplice.assembler.HFTokenizer` was read from, its
    ``model_dir``).  A tokenizer from no folder, or a folder without a template, is a
    :class:`ConfigError` naming ``template=``: until 2026-12-05 any tokenizer got the
    default model's ChatML template, silently, whatever its model."""
    from promptsplice.assets import DEFAULT_MODEL_NAME

    if tokenizer.name == f"hf:{DEFAULT_MODEL_NAME}":
        return ChatTemplate.default()
    fix = ("pass template= (the model's folder, or a ChatTemplate; for PromptspliceChatModel, "
           "hook=ContextHook(tokenizer, template=...)): the default model's template goes with its own tokenizer only")
    folder: Path | None = None
    if isinstance(spec, str | os.PathLike) and not (isinstance(spec, str) and spec.startswith("tiktoken:")):
        folder = Path(spec) if Path(spec).is_dir() else Path(spec).parent
    elif getattr(tokenizer, "model_dir", None) is not None:
        folder = Path(tokenizer.model_dir)
    if folder is None:
        raise ConfigError(f"no chat template goes with the tokenizer {tokenizer.name!r}: {fix}")
    try:
        return ChatTemplate.from_dir(folder)
    except ConfigError as exc:
        raise ConfigError(f"{exc}: {fix}") from exc

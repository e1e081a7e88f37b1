"""``PromptspliceChatModel``: a LangChain chat model over the embedded vLLM engine.

Kept as one module (~800 lines): LangChain's sync, async, streamed and batched entry
points of one chat model share its engine calls and the cancellation of a stream, which
only holds when they live next to each other (conversions are in ``_langchain_convert``).

Messages become OpenAI-style dicts, are rendered through the model's chat template in
token space with block-aligned per-message segments (:class:`promptsplice.assembler.ChatRenderer`, or
the model's :class:`promptsplice.assembler.ContextHook` when it has one: then the session's context
policies run and the step is diffed against the session's previous render), and the
token ids go to :class:`~promptsplice.engine_adapters.EmbeddedEngine` as they are, so what vLLM's
prefix cache sees is exactly the aligned layout.  ``usage_metadata`` reports vLLM's own
count of prompt tokens served from its cache (``input_token_details["cache_read"]``).

Tools (``bind_tools``; the conversions and the tool-call format live in
:mod:`~promptsplice.engine_adapters.integrations._langchain_convert`, the hand-off from
the harness hooks in :mod:`~promptsplice.engine_adapters.integrations._handoff`):
SmolLM2's ChatML template has no tool format, so the renderer
puts the schemas into the system turn the Hermes/Qwen way and asks for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; those blocks are
parsed out of the output into ``tool_calls``, forced or not.  A block that is no valid
call (JSON that does not parse, no name, arguments not an object, cut off at
``max_tokens``; a name no bound tool has is a call, as with ``ChatOpenAI``: the tool node
answers it) goes to ``invalid_tool_calls``, LangChain's place for a call the model
got wrong (``ChatOpenAI`` puts arguments that do not parse there), never an exception:
``name`` when it can be read, ``args`` the block as written, ``error`` why.  ``content``
keeps only the text around the blocks, as with valid calls: the broken block is no
answer (``create_agent`` ends the turn on it and answers it with an error
``ToolMessage`` on the next).  Streamed, it is a ``tool_call_chunk`` of the last chunk,
which LangChain's sum of the chunks parses back into the same invalid call, without its
``error`` (chunks carry none).  ``tool_choice`` ``"any"``/``"required"``/a tool name *forces* a
call by decoding after a fixed prefix (``<tool_call>\\n{"name": "`` or, for a named tool,
``... "f", "arguments": {"<first parameter>": ``, or the whole call for a tool without
parameters): small models rarely call tools on their own, and given only the
``"arguments":`` key SmolLM2-135M copies the schema instead of filling it in.  ``"none"``
keeps the schemas in the prompt (same tokens, same cache) but parses no calls.
``parallel_tool_calls=False`` (or Anthropic's ``tool_choice={..., "disable_parallel_tool_use":
True}``) ends the generation at the first call's ``</tool_call>`` (a stop string): at
most one call, as OpenAI's flag promises.

Session: ``session_id`` (call kwarg) > ``config["configurable"]["thread_id"]`` >
``config["metadata"]["thread_id"]`` (``thread_id``: the model's ``session_key``) > the
model's ``session_id`` field, the same for ``invoke``, ``ainvoke``, ``stream`` and
``astream`` (LangChain streams without the run's metadata: a stream ran in no session).  A context prepared by a harness hook
(:mod:`promptsplice.engine_adapters.integrations._hooks`) for the same session and the same tokens is
used as is, directives included; with a ``runner`` (anything with
``step(prepared, *, max_tokens, temperature, stop) -> obj.completion``) the model sends
that prepared context to the runner (which may splice) instead of ``engine.generate``.

The engine: ``engine=`` or the process default (:func:`set_default_engine`), looked up at
call time, so constructing a model never starts vLLM.  The model is LangChain-serializable
(``dumpd``): settings only, no engine/hook/runner; ``load`` it with
``allowed_objects=[PromptspliceChatModel], valid_namespaces=["promptsplice"]``.  Engine errors are
:mod:`promptsplice.errors` already and propagate unchanged; LangChain conversion
errors are translated to :class:`~promptsplice.errors.InputError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from langchain_core.caches import BaseCache
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.globals import get_llm_cache
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils import from_env, secret_from_env
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, ValidationError

from promptsplice._validate import check_stop, check_tenant_salt
from promptsplice.blocks import content_digest
from promptsplice.assembler import ChatRenderer, PreparedContext, StepKind
from promptsplice.engine_adapters.integrations._handoff import handoff
from promptsplice.engine_adapters.integrations._langchain_convert import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    call_chunks,
    check_tool_choice,
    disables_parallel,
    forced_prefix,
    format_tools,
    lc_messages_to_openai,
    parse_tool_calls,
    streamable,
)
from promptsplice.engine_adapters.integrations._langchain_options import (
    check_env_salt, check_options, check_runner_salt, convert_input, request_salt,
)
from promptsplice.errors import ConfigError, InvalidSaltError, PromptspliceError

__all__ = [
    "PromptspliceChatModel",
    "default_engine",
    "set_default_engine",
    "lc_messages_to_openai",
    "format_tools",
    "parse_tool_calls",
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The project's default model (what ``ls_model_name`` reports before an engine is known)."""

# -- the process default engine ---------------------------------------------------------

_default_lock = threading.Lock()
_default_engine: Any = None


def set_default_engine(engine: Any) -> Any:
    """Make ``engine`` (an :class:`~promptsplice.engine_adapters.EmbeddedEngine`, or ``None`` to
    clear) what models built without ``engine=`` use; returns the previous one."""
    global _default_engine
    if engine is not None and not callable(getattr(engine, "generate", None)):
        raise ConfigError(f"the default engine must have generate(), got {type(engine).__name__}")
    with _default_lock:
        prev, _default_engine = _default_engine, engine
    return prev


def default_engine() -> Any:
    """The engine set by :func:`set_default_engine`.  Raises ``ConfigError`` when none is
    set: a model never starts a vLLM engine behind the caller's back."""
    with _default_lock:
        eng = _default_engine
    if eng is None:
        raise ConfigError(
            "PromptspliceChatModel has no engine: pass engine=EmbeddedEngine(...) or call "
            "promptsplice.engine_adapters.integrations._langchain_chat.set_default_engine(engine) first"
        )
    return eng


_KNOWN_CALL_KWARGS = frozenset(
    {"tools", "tool_choice", "session_id", "max_tokens", "temperature", "model", "parallel_tool_calls", "cache_salt",
     "stream"}  # langchain_core's per-call opt-in/out of streaming: it routed the call already
)


def _foreign_salt_error(session: str | None, salt: str) -> InvalidSaltError:
    """A tenant's hook prepared ``session`` under ``salt``, but not the tokens an
    unsalted model received: sent unsalted, that tenant's prompt left its salt; sent under
    it, another caller of the same session id would reach that tenant's cache.  Which it
    is cannot be told: say so."""
    return InvalidSaltError(
        f"a hook prepared session {session!r} under cache_salt {salt!r}, but the messages this "
        "model received render to other tokens (tools or a prompt the hook was not given?): which "
        "tenant this call is cannot be told; give the model (or the call) cache_salt=<the tenant's salt>, "
        "or give the hook the same tools and prompt"
    )


class PromptspliceChatModel(BaseChatModel):
    """A chat model that renders messages in token space and runs them on an
    :class:`~promptsplice.engine_adapters.EmbeddedEngine` (see the module docstring).

    ``timeout``, ``max_retries`` and ``api_key`` are accepted (and serialized) for
    drop-in compatibility with remote chat models and have no effect on any engine: the
    embedded engine has no network, retries nothing and needs no key; a served engine's
    are its own (``RemoteEngine(timeout=..., max_retries=..., api_key=...)``).
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    engine: Any = Field(default=None, exclude=True)
    """An :class:`~promptsplice.engine_adapters.EmbeddedEngine`; ``None``: :func:`default_engine`."""
    hook: Any = Field(default=None, exclude=True)
    """An :class:`promptsplice.assembler.ContextHook` (policies, session diffs); ``None``: render with
    a :class:`ChatRenderer` sized like the engine."""
    runner: Any = Field(default=None, exclude=True)
    """Anything with ``step(prepared, *, max_tokens, temperature, stop)`` returning an
    object with ``.completion``; ``None``: ``engine.generate``."""
    model_name: str | None = Field(default=None, alias="model")
    """Reported name; ``None``: the engine's model folder name."""
    max_tokens: int = 256
    temperature: float = 0.0
    stop: list[str] | None = None
    session_id: str | None = None
    """Default session (call kwarg ``session_id`` and config ``session_key`` win)."""
    session_key: str = "thread_id"
    """The ``config["configurable"]`` key naming the session: the same as the
    ``session_key`` of a ``PromptsplicePreModelHook`` in front of this model, so its
    prepared contexts are found (the middleware passes its session id along)."""
    cache_salt: str | None = Field(default_factory=from_env("PROMPTSPLICE_CACHE_SALT", default=None))
    """The prompt's ``cache_salt`` (tenant isolation); default from ``PROMPTSPLICE_CACHE_SALT``."""
    streaming: bool = False
    """``invoke`` streams internally (callbacks get tokens) when true."""
    timeout: float | None = None
    max_retries: int | None = None
    api_key: SecretStr | None = Field(default_factory=secret_from_env("PROMPTSPLICE_API_KEY", default=None))

    def __init__(self, **data: Any) -> None:
        """Options are checked as the engine checks them, and pydantic's errors become
        :class:`ConfigError` (lax pydantic took ``max_tokens=True`` as 1, ``"3"`` as 3,
        and a NaN temperature, and left an invalid salt to the first call)."""
        check_options(type(self).model_fields.items(), data)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"PromptspliceChatModel: invalid options: {exc}") from exc
        check_env_salt(self.cache_salt, "cache_salt" not in data)

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> PromptspliceChatModel:
        """Shares the live engine, hook, runner and the renderer's lock (deepcopy raised on it)."""
        return self.model_copy(update={"stop": None if self.stop is None else list(self.stop)})

    def _engine_block_size(self) -> int | None:
        """The engine's block size when known without a request or an error."""
        eng = next((e for e in (self.engine, _default_engine, getattr(self.runner, "engine", None)) if e is not None), None)
        try:
            size = eng.block_size if eng is not None else None
        except (AttributeError, PromptspliceError):  # a server not asked for it yet
            return None
        return size if isinstance(size, int) else None

    _renderer: ChatRenderer | None = PrivateAttr(default=None)
    _renderer_key: Any = PrivateAttr(default=None)
    _renderer_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    # -- LangChain plumbing ---------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "promptsplice"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """``dumpd``/``dumps`` write the settings (never ``engine``, ``hook`` or
        ``runner``: those are live objects, resolved again at call time; ``api_key`` as
        a secret reference).  langchain-core's ``load`` revives only allowlisted
        classes: pass this one, ``load(data, allowed_objects=[PromptspliceChatModel],
        valid_namespaces=["promptsplice"])``."""
        return True

    @property
    def lc_attributes(self) -> dict[str, Any]:
        # always written, None too: a revived model keeps the salt it was dumped with
        # instead of taking PROMPTSPLICE_CACHE_SALT from the loading process (tenant
        # isolation must not change on a round trip)
        return {"cache_salt": self.cache_salt}

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "PROMPTSPLICE_API_KEY"}

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["promptsplice", "engine_adapters", "integrations", "_langchain_chat"]  # the importable module: load() imports it

    def _get_llm_string(self, stop: list[str] | None = None, **kwargs: Any) -> str:
        # serializable models key LangChain's LLM cache by their dumpd, which leaves the
        # engine out: add the model the engine runs, so two engines never share entries
        # (and a served engine's URL, the default engine's too: two servers never share entries)
        eng = self.engine
        if eng is None:
            with _default_lock:
                eng = _default_engine
        url = getattr(eng, "base_url", None)
        where = f"---server={url}" if isinstance(url, str) else ""
        # LangChain caches the model's dumpd once per object: a setting changed after a
        # call (m.temperature = 0.5, a model_copy) kept the old key and its answers
        self.__dict__.pop("_serialized", None)
        return (super()._get_llm_string(stop=stop, **kwargs) + self._prompt_key(kwargs)
                + "---model=" + self._model_id(resolve=True) + where)

    def _call_salt(self, kwargs: Mapping[str, Any]) -> str | None:
        """The call's ``cache_salt``, else the model's: a call's None is "the model's
        setting", as for max_tokens (``invoke(x, cache_salt=headers.get("tenant"))`` sent
        a salted model's prompt unsalted)."""
        salt = kwargs.get("cache_salt")
        return self.cache_salt if salt is None else salt

    def _prompt_key(self, kwargs: Mapping[str, Any]) -> str:
        """What else decides the prompt and its tenant, for the LLM cache's key: the salt
        the request goes out under (the call's or model's, else its hook's or runner's:
        an unsalted model over a tenant's hook served another tenant's cached answer)
        and the hook's template, layout and policies (they change what is sent)."""
        salt = self._call_salt(kwargs)
        if salt is None and self.hook is not None:
            salt = self.hook.salt
        if salt is None and self.runner is not None:
            salt = getattr(self.runner, "salt", None)
        if salt is None:  # a tenant's hook in front (a LangGraph pre-model hook): its salt
            # (until 2026-12-07 left out: two tenants' hooks in front of one unsalted model
            # were served each other's cached answers)
            session = self._session(kwargs, None)
            salt = handoff.salt_of(session) if session is not None else None
        key = f"---salt={salt!r}"
        if self.hook is not None:
            r = self.hook.renderer
            policies = ",".join(_stable_repr(p) for p in self.hook.policies)
            tmpl = content_digest(r.template.source.encode("utf-8", "surrogatepass")).hex()[:16]
            key += f"---hook={tmpl}|{r.alignment.value}|{r.block_size}|{policies}"
        return key

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self._model_name(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stop": self.stop,
            "cache_salt": self.cache_salt,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="promptsplice",
            ls_model_name=kwargs["model"] if isinstance(kwargs.get("model"), str) else self._model_name(),
            ls_model_type="chat",
            ls_temperature=self.temperature if kwargs.get("temperature") is None else kwargs["temperature"],
            ls_max_tokens=self.max_tokens if kwargs.get("max_tokens") is None else kwargs["max_tokens"],
        )
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (rendered into the system turn; calls parsed from the output).
        ``tool_choice``: ``None``/``"auto"`` (the model decides), ``"none"``,
        ``"any"``/``"required"``/a name/an OpenAI dict (forced, see the module)."""
        formatted = format_tools(tools)
        choice = check_tool_choice(tool_choice)
        forced_prefix(choice, formatted)  # validates a named choice now
        if disables_parallel(tool_choice):  # the flag does not survive the choice's one form
            kwargs["parallel_tool_calls"] = _single_call(kwargs.get("parallel_tool_calls"))
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    # session ids from the config of direct calls (``_generate`` cannot see the config)
    def invoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any) -> AIMessage:  # type: ignore[override]
        return super().invoke(convert_input(self, input), config, stop=stop, **_with_thread(config, kwargs, self.session_key))

    async def ainvoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any) -> AIMessage:  # type: ignore[override]
        return await super().ainvoke(convert_input(self, input), config, stop=stop, **_with_thread(config, kwargs, self.session_key))

    async def _agenerate_with_cache(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        # LangChain keys its LLM cache by _get_llm_string, called on the event loop: a
        # served engine given no model would ask its server there (a blocking GET, with
        # backoff sleeps): ask it in a thread first.  Here, not in agenerate: inside the
        # run's callbacks, so a server that is down reaches on_llm_error (it raised before
        # on_chat_model_start, and tracing saw nothing)
        if self.cache is not False and (isinstance(self.cache, BaseCache) or get_llm_cache() is not None):
            await asyncio.to_thread(self._model_name, resolve=True)
        return await super()._agenerate_with_cache(messages, stop=stop, run_manager=run_manager, **kwargs)

    def stream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:  # type: ignore[override]
        return super().stream(convert_input(self, input), config, stop=stop, **_with_thread(config, kwargs, self.session_key))

    def astream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any) -> AsyncIterator[AIMessageChunk]:  # type: ignore[override]
        return super().astream(convert_input(self, input), config, stop=stop, **_with_thread(config, kwargs, self.session_key))

    # -- resolution ---------------------------------------------------------------------
    def resolved_engine(self) -> Any:
        """The engine this model runs on: ``engine``, else its runner's, else
        :func:`default_engine` (a model of a hook and a runner sent invoke and stream to
        the runner's engine, but ainvoke and a forced tool call asked for the default)."""
        if self.engine is not None:
            return self.engine
        runner_engine = getattr(self.runner, "engine", None)
        return runner_engine if runner_engine is not None else default_engine()

    def _model_name(self, *, resolve: bool = False) -> str:
        """The model's name (the last part of its path or id); ``resolve``: ask a served
        engine that was given no model (otherwise named by its URL until its first
        request asked the server)."""
        model = self._model_id(resolve=resolve)
        return model if self.model_name else Path(model).name

    def _model_id(self, *, resolve: bool = False) -> str:
        """The model's whole path or served id (``org/name``): what the LLM cache keys
        by (two folders named alike hold two models) and ``model=`` may name."""
        if self.model_name:
            return self.model_name
        eng = self.engine
        if eng is None:
            with _default_lock:
                eng = _default_engine
        model = getattr(getattr(eng, "config", None), "model", None) or getattr(eng, "model", None)
        if not model and hasattr(eng, "served_model"):
            model = eng.served_model() if resolve else getattr(eng, "base_url", None)
        return model if isinstance(model, str) and model else DEFAULT_MODEL_NAME

    def renderer(self) -> ChatRenderer:
        """The renderer: the hook's, else one over the engine's tokenizer and block size."""
        if self.hook is not None:
            return self.hook.renderer
        eng = self.resolved_engine()
        with self._renderer_lock:
            # by reference, not id(): a new engine at a freed one's address got the old
            # engine's renderer (its block size and tokenizer)
            held = self._renderer_key() if isinstance(self._renderer_key, weakref.ref) else self._renderer_key
            if self._renderer is None or held is not eng:
                self._renderer = ChatRenderer(eng.tokenizer, block_size=eng.block_size)
                try:
                    self._renderer_key = weakref.ref(eng)
                except TypeError:  # no weak references (slots): held strongly
                    self._renderer_key = eng
            return self._renderer

    # -- token counts (LangChain's defaults download GPT-2's tokenizer) ---------------
    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s token ids in the model's own tokenizer (the hook's, else the
        engine's); ``custom_get_token_ids`` wins, as in LangChain."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        tok = self.hook.renderer.tokenizer if self.hook is not None else self.resolved_engine().tokenizer
        return list(tok.encode(text))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """The prompt's length as this model renders ``messages`` (and ``tools``) for a
        request: chat template, tool schemas, block padding and generation prompt; before
        a hook's policies, which edit a session's steps (``trim_messages(token_counter=model)``
        trims to what the engine is sent)."""
        dicts = lc_messages_to_openai(convert_input(self, list(messages)).to_messages())
        return len(self.renderer().render(dicts, format_tools(list(tools)) if tools else None).token_ids)

    def _session(self, kwargs: Mapping[str, Any], run_manager: Any) -> str | None:
        sid = kwargs.get("session_id")
        if sid is None:
            cfg = ensure_config()  # set inside LangGraph nodes and runnable sequences
            sid = (cfg.get("configurable") or {}).get(self.session_key)
        if sid is None and run_manager is not None:
            sid = (getattr(run_manager, "metadata", None) or {}).get(self.session_key)
        if sid is None:
            sid = self.session_id
        return None if sid is None else str(sid)

    def prepare(self, messages: Sequence[BaseMessage], **kwargs: Any) -> tuple[PreparedContext, list[dict[str, Any]]]:
        """The prepared context for ``messages`` (what would be sent) and the tools."""
        return self._prepare(messages, kwargs, None)

    def _prepare(
        self, messages: Sequence[BaseMessage], kwargs: Mapping[str, Any], run_manager: Any
    ) -> tuple[PreparedContext, list[dict[str, Any]]]:
        unknown = set(kwargs) - _KNOWN_CALL_KWARGS
        if unknown:
            raise ConfigError(f"PromptspliceChatModel does not take {sorted(unknown)}")
        # call-time options get the constructor's checks (a tenant salt may not claim
        # the derived salts' mark; a tool choice is one of the documented forms)
        if kwargs.get("cache_salt") is not None:
            check_tenant_salt(kwargs["cache_salt"], "cache_salt")
        if "tool_choice" in kwargs:
            check_tool_choice(kwargs["tool_choice"])
        parallel = kwargs.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise ConfigError(f"parallel_tool_calls must be True, False or None, got {parallel!r}")
        model = kwargs.get("model")
        if model is not None and model not in (self._model_name(resolve=True), self._model_id()):
            raise ConfigError(
                f"model={model!r}: this model runs {self._model_name()!r} on its engine; "
                "build another PromptspliceChatModel for another engine"
            )
        tools = format_tools(list(kwargs.get("tools") or []))  # @tool objects too, as bind_tools takes
        dicts = lc_messages_to_openai(messages)
        session = self._session(kwargs, run_manager)
        salt = self._call_salt(kwargs)
        renderer = self.renderer()
        if self.hook is not None:
            engine_block = self._engine_block_size()
            if engine_block is not None and self.hook.block_size != engine_block:
                raise ConfigError(f"hook renders blocks of {self.hook.block_size} tokens, the engine caches blocks of "
                                  f"{engine_block}: build it with ContextHook(..., block_size={engine_block})")
            sid = session if session is not None else f"ephemeral-{uuid.uuid4().hex}"
            hook_salt = salt if salt is not None else self.hook.salt  # what the hook renders under
            # unsalted all round: a tenant's hook in front (a LangGraph pre-model hook) may
            # have prepared the session under its salt, as for a model without a hook
            foreign = handoff.salt_of(session) if session is not None and hook_salt is None else None
            pending = (
                handoff.take(sid, renderer.render(dicts, tools or None, salt=hook_salt if foreign is None else foreign))
                if session else None
            )
            if pending is not None:
                return pending, tools
            if foreign is not None:
                raise _foreign_salt_error(session, foreign)
            prepared = self.hook(sid, dicts, tools or None, salt=salt)
            if session is None:
                self.hook.forget(sid, salt=prepared.render.salt)  # (one key: no scan of every session)
            return prepared, tools
        hook_salt = handoff.salt_of(session) if session is not None and salt is None else None
        render = renderer.render(dicts, tools or None, salt=salt if hook_salt is None else hook_salt)
        if session is not None:
            pending = handoff.take(session, render)
            if pending is not None:
                return pending, tools
        if hook_salt is not None:
            raise _foreign_salt_error(session, hook_salt)
        return PreparedContext(session or "", 1, StepKind.NEW_SESSION, render, dicts), tools

    def _request(self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], run_manager: Any) -> dict[str, Any]:
        prepared, tools = self._prepare(messages, kwargs, run_manager)
        choice = check_tool_choice(kwargs.get("tool_choice"))
        prefix = forced_prefix(choice, tools)
        ids = list(prepared.token_ids)
        if prefix:
            eng = self.resolved_engine()
            ids += list(eng.tokenizer.encode(prefix))
        stops = list(check_stop(stop) if stop is not None else self.stop or ())  # "END" is one stop, not three
        parse = bool(tools) and choice not in ("none", False)
        named = bool(prefix) and '"arguments": ' in prefix  # one call of one named tool was forced
        single = kwargs.get("parallel_tool_calls") is False
        if disables_parallel(kwargs.get("tool_choice")):  # a call-time Anthropic dict
            single = _single_call(kwargs.get("parallel_tool_calls")) is False
        if parse and (named or single) and TOOL_CALL_CLOSE not in stops:
            stops.append(TOOL_CALL_CLOSE)  # one call at most: the parser takes an open block
        # a call's None is "the model's setting", as ChatOpenAI reads it (it was a ConfigError)
        max_tokens = self.max_tokens if kwargs.get("max_tokens") is None else kwargs["max_tokens"]
        temperature = self.temperature if kwargs.get("temperature") is None else kwargs["temperature"]
        salt = request_salt(self._call_salt(kwargs), prepared.render.salt)
        return {
            "prepared": prepared,
            "ids": ids,
            "prefix": prefix or "",
            "parse": parse,
            "stop": stops or None,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "salt": salt,
            # a call without a session runs under a one-off id the runner must forget
            "ephemeral": self._session(kwargs, run_manager) is None,
        }

    def _run(self, req: dict[str, Any]) -> Any:
        prepared: PreparedContext = req["prepared"]
        if self.runner is not None:
            check_runner_salt(req["salt"], self.runner)
            if req["prefix"]:  # the forcing prefix goes after the generation prompt
                render = dataclasses.replace(prepared.render, token_ids=req["ids"])
                prepared = dataclasses.replace(prepared, render=render)
            try:
                step = self.runner.step(prepared, max_tokens=req["max_tokens"], temperature=req["temperature"], stop=req["stop"])
            finally:
                if req.get("ephemeral") and hasattr(self.runner, "forget"):
                    self.runner.forget(prepared.session_id)
            req["step"] = step  # the usage is the step's: a splice step runs several requests
            return step.completion
        return self.resolved_engine().generate(
            req["ids"], max_tokens=req["max_tokens"], temperature=req["temperature"], stop=req["stop"], cache_salt=req["salt"]
        )

    # -- results --------------------------------------------------------------------------
    def _metadata(self, req: dict[str, Any], completion: Any) -> tuple[dict[str, Any], UsageMetadata]:
        prepared: PreparedContext = req["prepared"]
        out = len(completion.token_ids)
        # a runner's step (several requests) counts its own cache reads; its last request's
        step = req.get("step")  # count includes what the step's earlier requests computed
        cached = getattr(step, "cached_tokens", None)
        cached = int(completion.num_cached_tokens) if cached is None else int(cached)
        usage = UsageMetadata(
            input_tokens=completion.prompt_tokens,
            output_tokens=out,
            total_tokens=completion.prompt_tokens + out,
            input_token_details={"cache_read": cached},
        )
        meta = {
            "model_name": self._model_name(),
            "model_provider": "promptsplice",
            "finish_reason": completion.finish_reason,
            "num_cached_tokens": int(completion.num_cached_tokens),
            "predicted_cached_tokens": completion.predicted_cached_tokens,
            "ttft_s": completion.ttft_s,
            "session_id": prepared.session_id or None,
            "step": prepared.step,
            "step_kind": prepared.kind.value,
            "request_id": completion.request_id,
        }
        for name in ("prefill_tokens", "relocated_tokens", "requests"):  # a runner's step says these
            if isinstance(getattr(step, name, None), int):
                meta[name] = getattr(step, name)
        return meta, usage

    def _message(self, req: dict[str, Any], completion: Any) -> AIMessage:
        handoff.settle(req["prepared"])  # answered: its hand-off waits for no retry
        text = req["prefix"] + completion.text
        calls: list[dict[str, Any]] = []
        invalid: list[dict[str, Any]] = []
        if req["parse"]:
            text, calls, invalid = parse_tool_calls(text, truncated=completion.finish_reason == "length")
        meta, usage = self._metadata(req, completion)
        return AIMessage(content=text, tool_calls=calls, invalid_tool_calls=invalid, response_metadata=meta,
                         usage_metadata=usage)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            chunks = list(self._stream(messages, stop, run_manager, **kwargs))
            full = chunks[0]
            for c in chunks[1:]:
                full = full + c
            msg = full.message
            return ChatResult(generations=[ChatGeneration(message=AIMessage(
                content=msg.content, tool_calls=msg.tool_calls, invalid_tool_calls=msg.invalid_tool_calls,
                response_metadata=msg.response_metadata, usage_metadata=msg.usage_metadata, id=msg.id,
            ))])
        req = self._request(messages, stop, kwargs, run_manager)
        completion = self._run(req)
        return ChatResult(generations=[ChatGeneration(message=self._message(req, completion))])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """On a served engine (no runner, not streaming): the request on the event loop,
        so a cancelled ``ainvoke`` (a timeout, a user's stop) closes its connection and
        the server stops it; LangChain's default ran :meth:`_generate` in a thread that
        kept waiting for the whole answer.  Otherwise that default."""
        if self.runner is not None or self.streaming:
            return await super()._agenerate(messages, stop, run_manager, **kwargs)
        eng = self.resolved_engine()
        if not hasattr(eng, "agenerate"):
            return await super()._agenerate(messages, stop, run_manager, **kwargs)
        # rendering (the hook's state, the tokenizer) in a thread, as the default did;
        # to_thread carries the context (the run's config) over
        req = await asyncio.to_thread(self._request, messages, stop, kwargs, run_manager)
        completion = await eng.agenerate(
            req["ids"], max_tokens=req["max_tokens"], temperature=req["temperature"], stop=req["stop"], cache_salt=req["salt"]
        )
        return ChatResult(generations=[ChatGeneration(message=self._message(req, completion))])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """Real streaming through :meth:`EmbeddedEngine.stream` (one chunk per engine
        step).  With tools, text that may open a ``<tool_call>`` block is held back and
        the calls arrive in the last chunk; with a ``runner`` the whole answer is one
        chunk (runners do not stream)."""
        return self._stream_chunks(messages, stop, run_manager, kwargs)

    def _stream_chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, kwargs: dict[str, Any],
        opened: Callable[[Any], None] | None = None,
    ) -> Iterator[ChatGenerationChunk]:
        """:meth:`_stream`; ``opened`` is handed the engine's stream once it is open (so
        :meth:`_astream` can abort it from the event loop's thread)."""
        req = self._request(messages, stop, kwargs, run_manager)
        if self.runner is not None:
            msg = self._message(req, self._run(req))
            yield ChatGenerationChunk(message=AIMessageChunk(
                content=msg.content, tool_call_chunks=call_chunks(msg.tool_calls, msg.invalid_tool_calls),
                response_metadata=msg.response_metadata, usage_metadata=msg.usage_metadata, chunk_position="last",
            ))
            return
        eng = self.resolved_engine()
        stream = eng.stream(req["ids"], max_tokens=req["max_tokens"], temperature=req["temperature"], stop=req["stop"], cache_salt=req["salt"])
        if opened is not None:
            opened(stream)
        seen = req["prefix"]
        sent = 0  # characters of content already streamed
        try:
            for delta in stream:
                seen += delta.text
                if delta.completion is not None:
                    completion = delta.completion
                    break
                safe = streamable(seen, req["parse"])
                if safe > sent:
                    piece = seen[sent:safe]
                    sent = safe
                    chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                    if run_manager is not None:
                        run_manager.on_llm_new_token(piece, chunk=chunk)
                    yield chunk
            else:  # the engine always ends with a completion delta
                raise PromptspliceError("the engine's stream ended without a completion")
        finally:
            stream.close()
        msg = self._message(req, completion)
        content = msg.content if isinstance(msg.content, str) else ""
        if msg.tool_calls or msg.invalid_tool_calls:
            rest = content[sent:] if content.startswith(seen[:sent]) else ""
        else:
            rest = (req["prefix"] + completion.text)[sent:]
        chunk = ChatGenerationChunk(message=AIMessageChunk(
            content=rest, tool_call_chunks=call_chunks(msg.tool_calls, msg.invalid_tool_calls),
            response_metadata=msg.response_metadata, usage_metadata=msg.usage_metadata, chunk_position="last",
        ))
        if run_manager is not None and rest:
            run_manager.on_llm_new_token(rest, chunk=chunk)
        yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """:meth:`_stream` in one worker thread (the engine's stream holds its lock in
        the thread that started it), chunks handed over through a queue.  A consumer that
        stops early (cancelled, ``break``) does not wait for the worker: it is told to
        stop, and a stream that can be aborted (a served engine's) has its connection
        shut, so a server that never answers does not hold the cancel for the engine's
        timeout; the worker ends on its own (its late items are dropped)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop_flag = threading.Event()
        done = object()
        ctx_cfg = ensure_config()
        opened: list[Any] = []

        def abort(stream: Any) -> None:
            if hasattr(stream, "abort"):
                stream.abort()

        def on_open(stream: Any) -> None:
            opened.append(stream)
            if stop_flag.is_set():  # the consumer left while the stream was being opened
                abort(stream)

        def hand(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: the consumer left long ago
                pass

        def produce() -> None:
            from langchain_core.runnables.config import var_child_runnable_config

            var_child_runnable_config.set(ctx_cfg)
            try:
                gen = self._stream_chunks(messages, stop, None, kwargs, on_open)
                try:
                    for chunk in gen:
                        if stop_flag.is_set():
                            break
                        hand(chunk)
                finally:
                    gen.close()
                hand(done)
            except BaseException as exc:  # handed to the consumer, raised there
                hand(exc)

        worker = threading.Thread(target=produce, name="promptsplice-astream", daemon=True)
        worker.start()
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is done:
                    finished = True
                    break
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if run_manager is not None and item.message.content:
                    await run_manager.on_llm_new_token(str(item.message.content), chunk=item)
                yield item
        finally:
            stop_flag.set()
            if finished:  # the worker closed its stream before handing the last item over
                await asyncio.to_thread(worker.join)
            else:
                for stream in list(opened):
                    abort(stream)


def _stable_repr(policy: Any) -> str:
    """A policy's repr, or its qualified name where the repr is the default one (it
    names a memory address: the same policy would key differently in each process)."""
    kind = policy if callable(policy) and hasattr(policy, "__qualname__") else type(policy)
    if kind is type(policy) and type(policy).__repr__ is not object.__repr__:
        return repr(policy)
    code = getattr(kind, "__code__", None)  # two lambdas of one module: told apart by line
    where = f"@{code.co_firstlineno}" if code is not None else ""
    return f"{getattr(kind, '__module__', '?')}.{kind.__qualname__}{where}"


def _single_call(parallel: Any) -> bool:
    """``parallel_tool_calls`` beside a ``tool_choice`` that disables parallel calls:
    ``False`` (``None`` and ``False`` agree; ``True`` contradicts it)."""
    if parallel is True:
        raise ConfigError("tool_choice has disable_parallel_tool_use=True but parallel_tool_calls=True: pass one")
    return False


def _with_thread(config: RunnableConfig | None, kwargs: dict[str, Any], key: str = "thread_id") -> dict[str, Any]:
    """The call config's session (``configurable``, else ``metadata``) as the
    ``session_id`` kwarg: LangChain's ``stream``/``astream`` call ``_stream`` without a
    run manager, so its metadata (read for ``invoke``) never reached the stream."""
    if config and "session_id" not in kwargs:
        tid = (config.get("configurable") or {}).get(key)
        if tid is None:
            tid = (config.get("metadata") or {}).get(key)
        if tid is not None:
            return {**kwargs, "session_id": str(tid)}
    return kwargs

"""The one exception hierarchy of promptsplice.

Every error the library raises on purpose is a :class:`PromptspliceError`.  Input
problems are also ``ValueError`` (so generic callers that catch ``ValueError`` keep
working); environment problems (a missing model asset, an engine that cannot start) are
``RuntimeError``.  Errors from third-party libraries (vLLM, httpx, tokenizers,
LangChain) are translated at the boundary with ``raise ... from exc``.

Expected outcomes (a cache hit, a miss, a stale entry) are never exceptions: they are
enum values in the modules that produce them.

This module imports nothing from the project, so every package may import it.
"""

from __future__ import annotations

__all__ = [
    "PromptspliceError",
    "InputError",
    "InvalidChunkError",
    "InvalidUTF8Error",
    "ConflictingChunkIdError",
    "ConfigError",
    "InvalidSaltError",
    "InvalidTextError",
    "InvalidToolsError",
    "InvalidMessageError",
    "NonTextContentError",
    "UnknownPolicyError",
    "ContextLengthError",
    "MissingSaltError",
    "TraceFormatError",
    "DirectiveError",
    "TokenizerError",
    "AssetError",
    "EngineError",
    "EngineStartError",
    "EngineRequestError",
    "EngineUnavailableError",
    "EngineTimeoutError",
    "EngineConnectTimeoutError",
    "EngineResponseError",
    "EngineDeadError",
    "PromptspliceWarning",
    "UnsaltedTenantWarning",
]


class PromptspliceError(Exception):
    """Base class of every error raised by promptsplice."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Exception's pickling calls cls(*args): errors with keyword-only fields
        # (ContextLengthError, DirectiveError, ...) could not cross a process pool
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type, args: tuple, state: dict) -> PromptspliceError:
    """An unpickled :class:`PromptspliceError`: its message and fields, no ``__init__``."""
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class InputError(PromptspliceError, ValueError):
    """The caller passed data the library cannot use as given."""


class InvalidChunkError(InputError):
    """A chunk is not text: not ``str``/``bytes``, a dict without ``text``, or a
    document without ``page_content``.  The message names the chunk's position."""


class InvalidUTF8Error(InputError):
    """A ``bytes`` chunk is not valid UTF-8, or a text (chunk, query, system prompt,
    tools, chat message) holds a lone surrogate, which has no UTF-8 form.  ``index``:
    the chunk's (or message's) position, -1 for the query, system prompt or tools;
    ``offset``: the UTF-8 byte offset of the fault.

    The default policy (``on_invalid_utf8="error"``) refuses it, because dedup is
    byte-exact and a prompt must be text.  Pass ``on_invalid_utf8="replace"`` to decode
    with U+FFFD instead (``dedup(..., on_invalid_utf8="replace")``; for assembly
    ``Assembler(dedup_config=DedupConfig(on_invalid_utf8="replace"))``); the replacement
    is then reported in the dedup stats.
    """

    def __init__(self, message: str, *, index: int, offset: int) -> None:
        super().__init__(message)
        self.index = index
        self.offset = offset

    @classmethod
    def lone_surrogate(
        cls, what: str, text: str, exc: UnicodeEncodeError, *, index: int, fix: str = "pass valid Unicode"
    ) -> InvalidUTF8Error:
        """The error for ``text`` (named ``what`` in the message) whose UTF-8 encoding
        failed with ``exc``: the lone surrogate by character and UTF-8 byte offset."""
        offset = len(text[: exc.start].encode("utf-8"))
        return cls(
            f"{what} contains a lone surrogate {text[exc.start]!r} at character {exc.start} "
            f"(UTF-8 byte offset {offset}), which has no UTF-8 encoding; {fix}",
            index=index,
            offset=offset,
        )


class ConflictingChunkIdError(InputError):
    """Two chunks share one id but carry different texts."""


class ConfigError(InputError):
    """An option is out of range (for example ``block_size <= 0``)."""


class InvalidSaltError(ConfigError):
    """A ``cache_salt`` (or ``salt``) that is not a non-empty ``str`` or ``None``.  The one
    salt rule (:func:`promptsplice._validate.check_salt`), the same at every door: ``""``
    is refused because vLLM treats it as no salt (shared with every unsalted caller)."""


class InvalidTextError(InputError):
    """A text argument (``query``, ``system``, a session id...) that is not a ``str``:
    bytes or numbers are refused, never rendered as their ``repr``."""


class InvalidToolsError(InputError):
    """``tools`` is not a list of tool schemas, each a JSON object (a dict that
    ``json.dumps`` takes as is); the message names the tool."""


class InvalidMessageError(InputError):
    """Chat messages that are not a list of dicts with a ``role`` (a non-empty ``str``)
    and a ``content`` (a ``str``, a list of parts or ``None``)."""


class NonTextContentError(InvalidMessageError):
    """A message part the token-space renderer cannot render: an image, audio, a file, a
    refusal.  The framework hooks pass such a session's messages through unedited (a
    warning names it) instead of failing the agent's model call."""


class UnknownPolicyError(ConfigError):
    """An ordering or alignment policy name that does not exist."""


class ContextLengthError(InputError):
    """An assembled prompt does not fit the context it was given.

    ``prompt_tokens`` and ``max_tokens`` carry both sizes; the message names them.  A
    text over 1 MiB that is refused from its byte size before tokenization carries a
    lower bound in ``prompt_tokens`` (the message says "at least").
    """

    def __init__(self, message: str, *, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class MissingSaltError(InputError):
    """A request without a ``cache_salt`` reached an engine or router built with
    ``require_salt=True``: pass the tenant's salt (``cache_salt=...``)."""


class TraceFormatError(InputError):
    """A workload trace line is not valid (the message names file, line and field)."""


class DirectiveError(InputError):
    """Edit directives that cannot be applied to the tokens given: a span out of range
    (``start < 0``, ``end < start`` or past the tokens), spans that overlap, or spans
    that are not sorted by position.  ``problem`` is ``"out_of_range"``,
    ``"overlapping"`` or ``"unsorted"``; ``index`` is the offending directive's
    position in the list."""

    def __init__(self, message: str, *, problem: str, index: int) -> None:
        super().__init__(message)
        self.problem = problem
        self.index = index


class TokenizerError(PromptspliceError, RuntimeError):
    """A tokenizer could not be loaded or used."""


class AssetError(PromptspliceError, RuntimeError):
    """The default model asset is missing or could not be prepared."""


class EngineError(PromptspliceError, RuntimeError):
    """The inference engine failed; the message says what to change."""


class EngineStartError(EngineError):
    """The engine could not start (for example a KV cache too small for one request:
    the message names the knob, ``kv_cache_bytes``)."""


class EngineRequestError(EngineError):
    """One request failed inside the engine; the engine keeps serving others.
    ``status_code``: the HTTP status a remote server answered (``None`` in process)."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class EngineUnavailableError(EngineError):
    """The remote engine cannot be reached (connection refused, DNS): start it or fix
    the URL.  Retried with backoff before it is raised."""


class EngineTimeoutError(EngineError):
    """A remote call ran past its timeout (the message names which: connect, read,
    write or pool); raise ``RemoteEngine(timeout=...)`` if the server is just slow."""


class EngineConnectTimeoutError(EngineTimeoutError, EngineUnavailableError):
    """No connection within the connect timeout, retries spent: the host is down,
    unreachable (a dropped packet never refuses) or too loaded to accept.  Both a timeout
    and an unavailable engine: behind a router, route around it."""


class EngineResponseError(EngineRequestError):
    """The server answered something that is not a valid OpenAI-compatible response
    (not JSON, no choices, a malformed stream chunk, a stream cut before its end)."""


class EngineDeadError(EngineError):
    """The engine stopped working: a step failed and a one-token health probe right
    after it failed too.  The request that met it failed.  ``restarted`` says whether
    the adapter started a fresh engine in its place (``EngineConfig(max_restarts=N)``;
    the prefix cache then starts empty); without a restart every later call raises this
    error until a new engine is started."""

    def __init__(self, message: str, *, restarted: bool) -> None:
        super().__init__(message)
        self.restarted = restarted


class PromptspliceWarning(UserWarning):
    """Base class of the warnings promptsplice issues."""


class UnsaltedTenantWarning(PromptspliceWarning):
    """One shared prefix cache served requests with and without a ``cache_salt``.

    Salted requests are isolated from every other salt, but unsalted ones share one
    chain root, so every unsalted caller can hit (and time) every other unsalted
    caller's prefixes.  Give each tenant its own salt, or pass ``require_salt=True``
    to refuse unsalted requests.  Issued once per engine, remote engine or router.
    """

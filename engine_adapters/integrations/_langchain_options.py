"""The checks of ``PromptspliceChatModel``'s options and inputs, at the LangChain boundary.

Pydantic (lax, ``extra="ignore"``) took ``max_tokens=True`` as 1 and ``"3"`` as 3, ignored
a misspelt option (``max_token=5``), and LangChain's message conversion raised its own
``ValueError`` or pydantic's ``ValidationError``: here each becomes the documented
:class:`~promptsplice.errors.ConfigError` or :class:`~promptsplice.errors.InvalidMessageError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from pydantic import ValidationError

from promptsplice._validate import (
    check_bool,
    check_int,
    check_number,
    check_optional_int,
    check_stop,
    check_tenant_salt,
    check_text,
)
from promptsplice.errors import ConfigError, InvalidMessageError, InvalidSaltError

__all__ = ["check_options", "check_env_salt", "check_runner_salt", "convert_input", "request_salt"]

_CHECKS: dict[str, Callable[[Any], Any]] = {
    "max_tokens": lambda v: check_int(v, "max_tokens"),
    "temperature": lambda v: check_number(v, "temperature"),
    "stop": check_stop,
    "streaming": lambda v: check_bool(v, "streaming"),
    "cache_salt": lambda v: check_tenant_salt(v, "cache_salt"),
    "session_id": lambda v: check_text(v, "session_id", optional=True, error=ConfigError),
    "session_key": lambda v: check_text(v, "session_key", error=ConfigError),
    "timeout": lambda v: v if v is None else check_number(v, "timeout", strict=True),
    "max_retries": lambda v: check_optional_int(v, "max_retries", minimum=0),
}

# duck types of the live objects (any engine with generate(): embedded, served, a test's)
_LIVE = {"engine": "generate", "runner": "step"}


def check_options(fields: Iterable[tuple[str, Any]], data: MutableMapping[str, Any]) -> None:
    """Check the constructor's options in place: every name is a field (or its alias),
    each value passes the engine's own check, live objects have the methods used."""
    known = set()
    for name, info in fields:
        known.add(name)
        if getattr(info, "alias", None):
            known.add(info.alias)
    for name in data:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"PromptspliceChatModel has no option {name!r}{hint}")
    for name, check in _CHECKS.items():
        if name in data:
            data[name] = check(data[name])
    for name, method in _LIVE.items():
        value = data.get(name)
        if value is not None and not callable(getattr(value, method, None)):
            raise ConfigError(f"{name} must have {method}() (or be None), got {type(value).__name__} {value!r:.60}")
    hook = data.get("hook")
    if hook is not None and not (callable(hook) and callable(getattr(hook, "forget", None))):
        raise ConfigError(
            f"hook must be a promptsplice.assembler.ContextHook (callable, with forget()), got {type(hook).__name__}"
        )


def check_env_salt(salt: Any, from_env: bool) -> None:
    """A salt read from ``PROMPTSPLICE_CACHE_SALT`` gets the constructor's check (an empty
    or reserved-character salt used to pass until the first call, or for good)."""
    if not from_env:
        return
    try:
        check_tenant_salt(salt, "cache_salt")
    except InvalidSaltError as exc:
        raise InvalidSaltError(f"PROMPTSPLICE_CACHE_SALT: {exc}") from exc


def convert_input(model: Any, value: Any) -> Any:
    """LangChain's own conversion of an input to a prompt, its errors translated: a role it
    does not know or content of the wrong type is :class:`InvalidMessageError`."""
    try:
        return model._convert_input(value)
    except (ValueError, TypeError, KeyError, ValidationError, NotImplementedError) as exc:
        # (LangChain raises NotImplementedError for bytes, [5], [None] or [("user",)], and
        # KeyError for a tool message without tool_call_id)
        if isinstance(exc, InvalidMessageError):
            raise
        what = f"a message has no {exc}" if isinstance(exc, KeyError) else exc
        raise InvalidMessageError(
            f"PromptspliceChatModel cannot read its input as messages: {what}; pass a str, a list of "
            "LangChain messages, (role, content) tuples with role one of human, user, ai, assistant, "
            "system, tool, or OpenAI-style dicts whose content is a str or a list of parts"
        ) from exc


def request_salt(salt: str | None, hook_salt: str | None) -> str | None:
    """The salt a request goes out with: the call's or model's ``cache_salt``, else the
    salt its ContextHook rendered it under (that tenant's blocks: never sent unsalted);
    two different ones are an :class:`InvalidSaltError`."""
    if salt is None:
        return hook_salt
    if hook_salt is not None and hook_salt != salt:
        raise InvalidSaltError(
            f"cache_salt {salt!r} differs from the salt {hook_salt!r} the context hook rendered "
            "this session under: give the model and its ContextHook the same salt (or only one of them)"
        )
    return salt


def check_runner_salt(salt: str | None, runner: Any) -> None:
    """A runner sends every step under its own (tenant) salt: a model salt it would not
    use must not silently become another tenant's, or none."""
    runner_salt = getattr(runner, "salt", salt)
    if salt != runner_salt:
        raise InvalidSaltError(
            f"cache_salt {salt!r} differs from the runner's salt {runner_salt!r}: the "
            "runner's requests use its own salt; build the runner with salt=<this cache_salt>"
        )

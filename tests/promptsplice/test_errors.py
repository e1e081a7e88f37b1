"""The error hierarchy crosses process boundaries (``pickle``) with its fields."""

from __future__ import annotations

import concurrent.futures
import pickle

import pytest

from promptsplice import errors

FIELDS = {
    "InvalidUTF8Error": {"index": 3, "offset": 17},
    "ContextLengthError": {"prompt_tokens": 9000, "max_tokens": 8192},
    "DirectiveError": {"problem": "overlap", "index": 2},
    "EngineRequestError": {"status_code": 429},
    "EngineResponseError": {"status_code": 502},
    "EngineDeadError": {"restarted": True},
}


@pytest.mark.parametrize("name", [n for n in errors.__all__ if not n.endswith("Warning")])
def test_every_error_pickles_with_its_fields(name):
    """Errors with keyword-only fields could not be unpickled (``cls(*args)`` missed
    them), so one raised in a process pool's worker broke the pool."""
    cls = getattr(errors, name)
    fields = FIELDS.get(name, {})
    err = cls(f"{name}: how to fix it", **fields)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err) and back.args == err.args
    assert {k: getattr(back, k) for k in fields} == fields


def _too_long() -> None:
    raise errors.ContextLengthError("prompt of 9000 tokens over 8192", prompt_tokens=9000, max_tokens=8192)


def test_an_error_raised_in_a_process_pool_reaches_the_caller():
    with concurrent.futures.ProcessPoolExecutor(max_workers=1) as pool:
        with pytest.raises(errors.ContextLengthError, match="over 8192") as info:
            pool.submit(_too_long).result(timeout=60)
    assert (info.value.prompt_tokens, info.value.max_tokens) == (9000, 8192)

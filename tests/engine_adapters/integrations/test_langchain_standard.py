"""LangChain's standard chat-model suites (langchain-tests) on the REAL model.

The suites build the model from ``chat_model_class`` + ``chat_model_params``; the model
takes the process default engine (``set_default_engine``), which an autouse fixture
points at the session's ``engine``.  Capability flags declare what the model lacks:

* integration ``has_tool_calling = False`` (so ``has_structured_output``/tool choice too):
  the binding and parsing work (unit suite, tests/engine_adapters/test_langchain_chat.py),
  but the suite asserts answers a 135M model does not give (e.g. ``magic_function(3)``
  called with ``{"input": 3}``, unicode customer names, structured jokes);
* ``supports_image_inputs``/audio/pdf/video/anthropic inputs: text-only model (defaults);
* ``supports_model_override = False``: one engine runs one model;
* ``enable_vcr_tests = False`` (default): nothing goes over HTTP to record.

``test_serdes`` runs for real (``dumpd``, the syrupy snapshot in ``__snapshots__/``,
``load`` with the suite's arguments, ``dict()`` equality).  One thing is arranged for it:
langchain-core's ``load(..., allowed_objects="all")`` revives only the classes in its own
mapping (``langchain_core.load.mapping``: langchain's partner packages), with no way for
a third-party package to register; ``_allow_this_class_in_load`` adds this class's id to
that allowlist for the one test (restored after it).  Users pass
``allowed_objects=[PromptspliceChatModel]`` instead (tests/engine_adapters/
test_langchain_chat.py checks that round trip without any patching).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from promptsplice.engine_adapters.integrations._langchain_chat import PromptspliceChatModel, set_default_engine


@pytest.fixture(autouse=True)
def _default_engine(engine):
    prev = set_default_engine(engine)
    yield
    set_default_engine(prev)


class TestPromptspliceChatUnit(ChatModelUnitTests):
    @pytest.fixture(autouse=True)
    def _allow_this_class_in_load(self, request, monkeypatch):
        if request.node.originalname != "test_serdes":
            return
        load_module = importlib.import_module("langchain_core.load.load")  # the module, not load()
        paths = load_module._get_default_allowed_class_paths("all")
        monkeypatch.setitem(
            load_module._default_class_paths_cache, "all", paths | {tuple(PromptspliceChatModel.lc_id())}
        )

    @property
    def chat_model_class(self) -> type[PromptspliceChatModel]:
        return PromptspliceChatModel

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        return {**super().standard_chat_model_params, "max_tokens": 12}  # keep CPU runs short

    @property
    def has_tool_calling(self) -> bool:
        return True  # bind_tools renders schemas and parses calls (accuracy: see module)

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return (
            {"PROMPTSPLICE_CACHE_SALT": "tenant-from-env", "PROMPTSPLICE_API_KEY": "test"},
            {},
            {"cache_salt": "tenant-from-env", "api_key": "test"},
        )


class TestPromptspliceChatIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[PromptspliceChatModel]:
        return PromptspliceChatModel

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        return {**super().standard_chat_model_params, "max_tokens": 12}  # keep CPU runs short

    @property
    def has_tool_calling(self) -> bool:
        return False  # a 135M model does not answer the suite's tool tasks correctly

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The same long prompt twice: the second reads its full blocks from vLLM's cache."""
        model = PromptspliceChatModel(max_tokens=4, cache_salt="std-cache-read")
        prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 12
        model.invoke(prompt)
        if stream:
            full = None
            for c in model.stream(prompt):
                full = c if full is None else full + c
            msg = full
        else:
            msg = model.invoke(prompt)
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg


def _mark_async_tests(cls: type) -> type:
    """The suites' async tests expect ``asyncio_mode=auto``; this project runs strict
    mode, so mark them here.  The mark goes onto the suite's own function objects, in
    place (``pytest.mark.asyncio(fn)`` stores it on ``fn`` and returns ``fn``): a
    wrapper would be an override, which the suite's ``test_no_overrides_DO_NOT_OVERRIDE``
    rejects; a class-wide ``pytestmark`` would also mark (and warn on) every sync test."""
    for name in dir(cls):
        fn = getattr(cls, name)
        if name.startswith("test_") and inspect.iscoroutinefunction(fn):
            if not any(m.name == "asyncio" for m in getattr(fn, "pytestmark", [])):
                assert pytest.mark.asyncio(fn) is fn
    return cls


_mark_async_tests(TestPromptspliceChatIntegration)

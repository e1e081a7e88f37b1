"""Public surface of ``promptsplice.engine_adapters.connector``: the plans, a served
splice's acknowledgement and the served connector's config, pinned; vLLM
loads the connector class itself by module path."""

from __future__ import annotations

import importlib

from promptsplice.engine_adapters import connector

CONNECTOR_API = [
    "SAME_SALT",
    "BlockDeviation",
    "SpliceAck",
    "SplicePhase",
    "SplicePlan",
    "SpliceSegment",
    "compute_run",
    "extend_recompute",
    "plan_deletion",
    "plan_phases",
    "plan_relocation",
    "plan_segment_phases",
    "kv_transfer_config_json",
]


def test_public_names_are_pinned():
    assert sorted(connector.__all__) == sorted(CONNECTOR_API)
    for name in CONNECTOR_API:
        assert getattr(connector, name) is not None


def test_every_room_names_its_exports():
    """Each private module's ``__all__`` lists names it defines (no stale entries)."""
    for room in ("_plans", "_scheduler", "_worker", "_settings", "_connector"):
        mod = importlib.import_module(f"promptsplice.engine_adapters.connector.{room}")
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not missing, f"{room}: {missing}"


def test_the_module_path_vllm_loads_names_the_connector_class():
    mod = importlib.import_module("promptsplice.engine_adapters.connector._connector")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert issubclass(mod.SpliceConnector, KVConnectorBase_V1)

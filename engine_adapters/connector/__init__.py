"""The splice KV connector, in rooms by audience:

* ``_plans``: the plans the runners build (torch-free, vLLM-free) -- re-exported here;
* ``_scheduler``: vLLM's scheduler side (how much to load, where, what to save; no torch);
* ``_worker``: the worker side (loads, relocation and saves in the paged KV cache; torch);
* ``_settings``: what both roles read from vLLM's config; ``_connector``: the thin
  ``KVConnectorBase_V1`` glue vLLM loads by module path.

Importing this package imports neither vLLM nor torch.
"""

from promptsplice.engine_adapters.connector._plans import (
    SAME_SALT,
    BlockDeviation,
    SplicePhase,
    SplicePlan,
    SpliceSegment,
    compute_run,
    extend_recompute,
    plan_deletion,
    plan_phases,
    plan_relocation,
    plan_segment_phases,
)

from promptsplice.engine_adapters.connector._served import SpliceAck
from promptsplice.engine_adapters.connector._settings import kv_transfer_config_json

__all__ = [
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

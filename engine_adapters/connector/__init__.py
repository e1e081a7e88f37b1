"""The splice KV connector: torch-free plans, vLLM's scheduler side, the worker side.

Importing this package imports neither vLLM nor torch: the plans are what the runners
build; vLLM loads the connector class itself by module path.
"""

from promptsplice.engine_adapters.connector._splice import (
    SplicePhase,
    SplicePlan,
    SpliceSegment,
    plan_deletion,
    plan_phases,
    plan_relocation,
    plan_segment_phases,
)

__all__ = [
    "SplicePhase",
    "SplicePlan",
    "SpliceSegment",
    "plan_deletion",
    "plan_phases",
    "plan_relocation",
    "plan_segment_phases",
]

"""Helpers for the import-isolation tests: what a statement imports, by room."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("dedup", "assembler", "engine_adapters", "kernels", "benchmarks")


def modules_after(stmt: str) -> set[str]:
    """Every module in ``sys.modules`` after running ``stmt`` in a fresh interpreter."""
    code = f"import sys\n{stmt}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO, timeout=300
    )
    return set(out.stdout.split())


def room_of(module: str) -> str:
    """``promptsplice.<room>`` for a module of a room, else the top-level name."""
    parts = module.split(".")
    if parts[0] == "promptsplice" and len(parts) > 1 and parts[1] in ROOMS:
        return f"promptsplice.{parts[1]}"
    return parts[0]


def rooms_after(stmt: str) -> set[str]:
    return {room_of(m) for m in modules_after(stmt)}

"""Fidelity levels: how much approximate KV a runner may use, in one table.

Splice (agent edits) and position-independent reuse (RAG) load KV that was computed at
another position or next to other content: its deep layers are approximate.  A user
chooses how much of that to accept with one setting, on the runner (constructor
default) or per request:

* ``exact`` (the default): no approximate KV at all.  Only exact blocks are reused: vLLM's prefix
  cache and exact loads from the block store (offload hits, delta 0); nothing is
  relocated, nothing position-independent.  A request at this level runs under a salt
  whose cache holds exact blocks only (the tenant's salt; see the runners).
* ``bounded``: relocation after 2 recomputed blocks and a deviation guard.  It meets
  first-token KL p90 <= :data:`BOUNDED_KL_P90` nats on the fixed bar sample (its
  regression test) but **not** on the agent trace families: every edit step of 8
  sessions probed, KL p90 0.028 (BFCL, 63 probes) and 0.058 (coding, 39 probes);
  6 recomputed blocks or 4 recomputed tail blocks did not bring coding under 0.05
  (README, "Fidelity").  Teacher-forced top-1 stays within 0.01 of the control.
  Position-independent reuse adds a run-start guard (``run_max_deviation``): with it,
  KL p90 <= 0.016 on every RAG family with probes (2-13 probes each, measured before
  the gate charged the guard a share of each run; README, "The run-start guard").
* ``fast``: relocation after 1 recomputed block (more reuse, the larger error: KL max
  0.053 on the calibration trace).  r=0 is not a level: its first relocated block
  attends to nothing fresh (top-1 0.865 against a 0.938 control in the README's sweep).

:data:`FIDELITY_TABLE` maps each level to its :class:`FidelitySettings`.
``max_deviation`` is the threshold of the measured-deviation recompute (recompute the
next block while the fresh KV of the last recomputed block deviates from its relocated
KV by more than it; the connector measures it, in process or in a server's acks).  ``bounded``
uses :data:`DEFAULT_MAX_DEVIATION` as a guard: on the calibration trace the deviation
barely predicted KL (README, agent section), so the threshold only catches runs that
deviate beyond anything calibrated.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from promptsplice._validate import check_enum, check_int, check_number, is_derived_salt
from promptsplice.errors import ConfigError

__all__ = [
    "BOUNDED_KL_P90",
    "DEFAULT_FIDELITY",
    "DEFAULT_MAX_DEVIATION",
    "DEFAULT_RUN_MAX_DEVIATION",
    "FIDELITY_TABLE",
    "MAX_DEVIATION_LIMIT",
    "FidelityLevel",
    "FidelitySettings",
    "check_fidelity",
    "check_kl_budget",
    "check_max_deviation",
    "fidelity_settings",
    "RunnerFidelity",
    "step_level",
]

BOUNDED_KL_P90 = 0.02
"""The bar ``bounded`` is chosen to meet: first-token KL p90 (nats) against exact prefill."""
MAX_DEVIATION_LIMIT = 1.0
"""A deviation threshold is a relative deviation (``|fresh - relocated| / |fresh|``) in
``(0, MAX_DEVIATION_LIMIT]``: above 1 it would accept KV off by more than its own size."""


DEFAULT_MAX_DEVIATION = 0.25
"""``bounded``'s deviation guard (``python -m promptsplice.benchmarks.deviation_curve``):
on the calibration trace ``r=1`` alone kept first-token KL p90 at 0.0095 <= 0.02 with
deviations 0.096-0.231 and Spearman(deviation, KL) <= 0.23, so the fewest extra blocks
is none; 0.25 recomputes only runs that deviate beyond anything calibrated, at a
measured probe cost of 1.1% of a splice step's wall time."""


DEFAULT_RUN_MAX_DEVIATION = 0.20
"""``bounded``'s run-start guard for position-independent reuse (``RagRunner``): on the
RAG trace suite the largest deviation over a chunk's recomputed blocks ranked
first-token KL (Spearman 0.70 on 24 probes, unlike the agent's last block); 0.20 is the
largest threshold of the sweep's grid that met KL p90 <= :data:`BOUNDED_KL_P90` on every
family in both calibration runs (30 requests a family, then 80: at 0.22 wiki's p90 was
0.028 over 20 probes, four requests at deviations 0.21-0.22; ``deviation_curve
--rag-budget-sweep``; README, "The run-start guard")."""


class FidelityLevel(enum.Enum):
    """How much approximate KV a request may use (module doc)."""

    EXACT = "exact"
    BOUNDED = "bounded"
    FAST = "fast"


DEFAULT_FIDELITY = FidelityLevel.EXACT
"""Approximate KV is opt-in: no relocation setting measured here keeps first-token KL
p90 <= :data:`BOUNDED_KL_P90` on every trace family (module doc), so by default a runner
reuses exact KV only (prefix cache and exact store loads)."""


def step_level(
    asked: FidelityLevel, planned_relocated_tokens: int, salt: str | None, *, salt_may_hold_relocated: bool = False,
) -> FidelityLevel:
    """The level a step record reports: the one it ran at, but ``exact`` when its plan
    relocated nothing and it ran under the tenant's own salt (a new session, a fallback
    to a plain request, a RAG request the gate sent exact): that salt's cache holds exact
    KV only.  Under a derived salt (a session's scope, a RAG reuse salt) vLLM's prefix
    cache may serve an earlier step's relocated KV, so the asked level stands; so it
    does when the caller says the tenant's salt itself may hold relocated KV
    (``salt_may_hold_relocated``: an ``AgentRunner(scope="none")`` relocating under it)."""
    if planned_relocated_tokens > 0 or salt_may_hold_relocated or is_derived_salt(salt):
        return asked
    return FidelityLevel.EXACT


def check_fidelity(value: Any, what: str = "fidelity") -> FidelityLevel:
    """A :class:`FidelityLevel` or its name (else :class:`ConfigError` naming the value)."""
    return check_enum(value, FidelityLevel, what)


def check_kl_budget(value: Any, what: str = "kl_budget") -> float:
    """A first-token KL budget in nats: a finite number > 0 (``ConfigError`` for 0, a
    negative number, NaN or infinity)."""
    return float(check_number(value, what, minimum=0.0, strict=True))


def check_max_deviation(value: Any, what: str = "max_deviation") -> float | None:
    """``None`` (no measured-deviation recompute) or a threshold in ``(0, 1]``."""
    if value is None:
        return None
    v = check_number(value, what, minimum=0.0, strict=True)
    if v > MAX_DEVIATION_LIMIT:
        raise ConfigError(
            f"{what} must be a relative deviation in (0, {MAX_DEVIATION_LIMIT:g}], got {value!r}: "
            "a threshold above 1 accepts KV off by more than its own size"
        )
    return float(v)


@dataclass(frozen=True, slots=True)
class FidelitySettings:
    """What a fidelity level does (module doc)."""

    level: FidelityLevel
    relocate: bool
    """Whether approximate (relocated) KV may be loaded at all."""
    recompute_blocks: int
    """Blocks computed after each edit (agent) / at the start of each relocated chunk
    (RAG) before relocated KV resumes."""
    max_deviation: float | None = None
    """Measured-deviation threshold (``None``: not used; see the module doc)."""
    kl_p90_budget: float | None = None
    """The first-token KL p90 (nats) the level's regression test holds on the fixed bar
    sample (``None``: no target, or nothing approximate to bound); the values measured
    on the trace families are in the README."""
    run_max_deviation: float | None = None
    """The RAG runner's run-start guard: a run of chunks whose recomputed blocks deviate
    beyond it (the largest of them) is computed whole, not loaded (``None``: not used)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", check_fidelity(self.level, "level"))  # "Bounded" -> the enum
        if not isinstance(self.relocate, bool):
            raise ConfigError(f"relocate must be True or False, got {self.relocate!r}")
        check_int(self.recompute_blocks, "recompute_blocks", minimum=0)
        check_max_deviation(self.max_deviation)
        check_max_deviation(self.run_max_deviation, "run_max_deviation")
        if self.kl_p90_budget is not None:
            check_kl_budget(self.kl_p90_budget, "kl_p90_budget")


FIDELITY_TABLE: dict[FidelityLevel, FidelitySettings] = {
    FidelityLevel.EXACT: FidelitySettings(FidelityLevel.EXACT, relocate=False, recompute_blocks=0),
    FidelityLevel.BOUNDED: FidelitySettings(
        FidelityLevel.BOUNDED, relocate=True, recompute_blocks=2, max_deviation=DEFAULT_MAX_DEVIATION, kl_p90_budget=BOUNDED_KL_P90,
        run_max_deviation=DEFAULT_RUN_MAX_DEVIATION,
    ),
    FidelityLevel.FAST: FidelitySettings(FidelityLevel.FAST, relocate=True, recompute_blocks=1),
}
"""The one mapping from level to settings (the README's fidelity table measured it)."""


def fidelity_settings(
    level: Any, *, recompute_blocks: int | None = None, max_deviation: float | None = None
) -> FidelitySettings:
    """The table's settings for ``level``.  ``recompute_blocks`` / ``max_deviation``
    (when given) replace the table's for the approximate levels (a caller's own sweep:
    the level's KL claim then no longer applies, ``kl_p90_budget`` is ``None``);
    ``exact`` ignores them.  The deviation threshold measures recomputed blocks: with
    ``recompute_blocks=0`` the table's is dropped, and an explicit one is a
    :class:`ConfigError`."""
    lvl = check_fidelity(level)
    base = FIDELITY_TABLE[lvl]
    dev = check_max_deviation(max_deviation)
    if recompute_blocks is not None:
        check_int(recompute_blocks, "recompute_blocks", minimum=0)
    if not base.relocate or (
        recompute_blocks in (None, base.recompute_blocks) and (dev is None or dev == base.max_deviation == base.run_max_deviation)
    ):
        return base
    r = base.recompute_blocks if recompute_blocks is None else recompute_blocks
    if r == 0 and dev is not None:
        raise ConfigError(
            "max_deviation measures the recomputed blocks: set recompute_blocks >= 1 "
            f"(got {r}) or leave max_deviation unset"
        )
    return FidelitySettings(lvl, True, r, (dev if dev is not None else base.max_deviation) if r else None, None,
                            (dev if dev is not None else base.run_max_deviation) if r else None)


class RunnerFidelity:
    """A runner's fidelity: its level and the caller's overrides, turned into the
    :class:`FidelitySettings` of each request (one owner for both runners)."""

    __slots__ = ("level", "recompute_blocks", "max_deviation", "relocating_mode")

    def __init__(
        self,
        level: Any,
        *,
        recompute_blocks: int | None = None,
        max_deviation: float | None = None,
        recompute_tail_blocks: int = 0,
        relocating_mode: str | None = None,
    ) -> None:
        """``relocating_mode``: ``None`` when the runner's mode relocates, else its name
        (``apc``, ``full``, ``exact``): a level or knob that relocates is then refused."""
        self.level = check_fidelity(level)
        if recompute_blocks is not None:
            check_int(recompute_blocks, "recompute_blocks", minimum=0)
        self.recompute_blocks = recompute_blocks
        self.max_deviation = check_max_deviation(max_deviation)
        self.relocating_mode = relocating_mode
        check_int(recompute_tail_blocks, "recompute_tail_blocks", minimum=0)
        knobs = [name for name, v in (("recompute_blocks", recompute_blocks), ("max_deviation", max_deviation),
                                      ("recompute_tail_blocks", recompute_tail_blocks or None)) if v is not None]
        if relocating_mode is not None and (knobs or self.level is not FidelityLevel.EXACT):
            # the mode never relocates: the level and knobs would be ignored, every step exact
            level = [] if self.level is FidelityLevel.EXACT else [f"fidelity={self.level.value!r}"]
            what = ", ".join(level + knobs)
            raise ConfigError(
                f"{what} set, but mode={relocating_mode!r} never relocates KV (every request runs exact): "
                "use the relocating mode (AgentRunner mode='splice', RagRunner "
                "mode='position_independent'), or drop them"
            )
        if self.level is FidelityLevel.EXACT and knobs:
            # exact relocates nothing, so these would be ignored: say so instead
            raise ConfigError(
                f"{', '.join(knobs)} set, but the runner's fidelity is 'exact' (the default), "
                "which relocates nothing: pass fidelity='bounded' (or 'fast') to relocate "
                "with them, or drop them"
            )

    def settings(self, fidelity: Any = None, *, request: bool = True) -> FidelitySettings:
        """The settings of a request at ``fidelity`` (default: the runner's level);
        ``request=False``: only named (a salt), so a mode that never relocates may ask.
        The runner's ``recompute_blocks`` / ``max_deviation`` apply at every relocating
        level (a caller's own settings: the level's KL claim then no longer applies)."""
        level = self.level if fidelity is None else check_fidelity(fidelity)
        if request and self.relocating_mode is not None and level is not FidelityLevel.EXACT:
            # as at the constructor: a step or request of a mode that never relocates
            # asked for a relocating level, and ran exact without a word
            raise ConfigError(
                f"fidelity={level.value!r} asked for a request, but mode={self.relocating_mode!r} never "
                "relocates KV (every request runs exact): use the relocating mode (AgentRunner "
                "mode='splice', RagRunner mode='position_independent'), or drop it"
            )
        return fidelity_settings(level, recompute_blocks=self.recompute_blocks, max_deviation=self.max_deviation)

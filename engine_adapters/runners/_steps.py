"""What the runners' step records share: the meaning of their token counts, and why a
step fell back to a plain request.

Token counts mean the same on :class:`~promptsplice.engine_adapters.RagStep` and
:class:`~promptsplice.engine_adapters.AgentStep`, over every engine request a step took:

* ``prefill_tokens``: tokens the engine computed (each request's ``prefill_tokens``,
  summed; a RAG step's precompute of new chunks included);
* ``cached_tokens = max(0, prompt_tokens - prefill_tokens)``: prompt tokens the engine
  did not compute, by vLLM's meaning of ``num_cached_tokens``: served from its prefix
  cache *or* loaded by the splice connector (for a one-request step it is that
  request's ``num_cached_tokens``);
* ``relocated_tokens``: the part of ``cached_tokens`` the connector loaded from
  another context: at another position than it was computed at (keys re-rotated), or
  in place after other tokens (a same-length edit or chunk before it); approximate
  deep layers either way (``_plans.in_place_blocks`` tells the exact ones apart),
  counted by the connector (not what a derived salt's cache or store serves of the
  step's own prompt: an earlier step's relocated KV there is reported by ``fidelity``);
* ``planned_relocated_tokens``: what the step's plan asked the connector to relocate
  (:func:`planned_relocated_tokens`); below it, the store did not serve some blocks
  and vLLM computed them (exact);
* ``recomputed_tokens``: tokens computed for fidelity although stored KV could have been
  relocated there (the fidelity level's recompute; at ``exact``, all of them).

Both records also carry ``fidelity``: the :class:`~promptsplice.engine_adapters.runners.FidelityLevel`
the step ran at (``exact`` whenever the runner's mode never relocates).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from promptsplice.engine_adapters.connector._plans import (
    SplicePhase,
    approximate_tokens,
    compute_run,
    extend_recompute,
)
from promptsplice.errors import ConfigError

if TYPE_CHECKING:
    from promptsplice.assembler import Assembler

__all__ = [
    "AdaptiveRecompute",
    "RunnerEngine",
    "StepFallback",
    "cached_tokens",
    "check_runner_engine",
    "planned_relocated_tokens",
]

_ABSENT = object()


class RunnerEngine(Protocol):
    """What :class:`~promptsplice.engine_adapters.AgentRunner` and
    :class:`~promptsplice.engine_adapters.RagRunner` use of an engine:
    :class:`~promptsplice.engine_adapters.EmbeddedEngine` and
    :class:`~promptsplice.engine_adapters.RemoteEngine` have it (their docstrings say
    what each member means); :func:`check_runner_engine` checks it by name.  ``RagRunner``
    also reads ``kv_store`` (:data:`RAG_SURFACE`): the in-process block store, or ``None``
    (none, or the server holds it and answers the chunk index's store queries)."""

    @property
    def block_size(self) -> int:
        """vLLM's KV block size in tokens."""
        ...

    @property
    def can_splice(self) -> bool:
        """Whether splice plans can run (a block store behind the connector)."""
        ...

    @property
    def can_relocate(self) -> bool:
        """Whether the connector can relocate KV (verified attention ISA and RoPE)."""
        ...

    def make_assembler(self, **kwargs: Any) -> Assembler:
        """An assembler predicting from this engine's cache."""
        ...

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """One request; ``splice=`` carries a plan."""
        ...

    def generate_phases(self, tokens: Sequence[int], phases: Sequence[SplicePhase], **kwargs: Any) -> Any:
        """A multi-phase splice, one request per phase."""
        ...


_ENGINE_SURFACE = tuple(sorted(n for n in vars(RunnerEngine) if not n.startswith("_")))
RAG_SURFACE = ("kv_store",)
"""What ``RagRunner`` reads of an engine besides :class:`RunnerEngine`."""


def check_runner_engine(engine: object, who: str, extra: Sequence[str] = ()) -> None:
    """A runner's engine: anything with the :class:`RunnerEngine` surface (an
    EmbeddedEngine or a RemoteEngine), else :class:`ConfigError` (``None`` raised
    AttributeError deep inside)."""
    # looked up without running properties: a RemoteEngine's block_size and can_splice
    # ask the server, which a runner that never needs them must not do when built
    missing = [name for name in (*_ENGINE_SURFACE, *extra) if inspect.getattr_static(engine, name, _ABSENT) is _ABSENT]
    if missing:
        raise ConfigError(
            f"{who} needs an EmbeddedEngine or a RemoteEngine, got {type(engine).__name__} "
            f"(without {', '.join(missing)})"
        )


class StepFallback(enum.Enum):
    """Why a runner sent a step as one plain request instead of its splice plan (the
    prefix cache still serves whatever matches exactly; the details are logged)."""

    HOOK_FULL_PREFILL = "hook_full_prefill"
    """The hook made the step a ``FULL_PREFILL`` (its reason: ``PreparedContext.fallback``)."""
    NO_PREVIOUS_RENDER = "no_previous_render"
    """The hook's step has no previous render or diff to plan from."""
    FOREIGN_RENDER = "foreign_render"
    """The session's previous render is not what this runner sent last (another
    runner, a restart, a forgotten session)."""
    INVALID_PLAN = "invalid_plan"
    """The plan did not fit the prompt's tokens (never spliced; for RagRunner also: the
    assembled prompt differed from the preview it was planned on)."""
    NO_GAIN = "no_gain"
    """Relocation was predicted to compute no fewer tokens than one exact request
    (``RagRunner``: new or short chunks, an exact repeat; :func:`pic_choice`)."""
    STRICTER_THAN_SCOPE = "stricter_than_scope"
    """``AgentRunner``: the step asked a stricter fidelity (more recomputed blocks, a
    lower ``max_deviation``) than its session's scope has relocated at, whose cache
    holds that KV (a ``bounded`` step after ``fast`` ones): it ran exact, and the
    session's next relocating step opens a new scope from exact KV."""
    TOO_LONG = "too_long"
    """``RagRunner`` (position-independent): whole-block chunks do not fit the
    engine's context where the exact (``auto``) layout does, so the request went out in
    that layout (unpadded where padding would not fit); only chunks that are whole
    blocks there are indexed."""


def cached_tokens(prompt_tokens: int, prefill_tokens: int) -> int:
    """A step's ``cached_tokens`` (module doc)."""
    return max(0, prompt_tokens - prefill_tokens)


class AdaptiveRecompute:
    """``EmbeddedEngine.generate_phases``'s ``adapt`` for a runner's ``max_deviation``:
    when the recomputed blocks right before the next phase's loaded run deviated from
    their old KV by more than ``max_deviation`` (``BlockDeviation.value``), more of that
    run is computed.  ``window``: how many of those blocks count (the largest
    deviation; the agent runner's guard looks at the last one).  ``whole_run``: compute
    the whole run (:func:`~promptsplice.engine_adapters.connector._plans.compute_run`,
    the RAG runner's: a run whose start deviated keeps none of its stored KV), and
    every later run of the request too (a request whose chunks deviate is sent exact
    from there: computing only the deviating run and loading the others left the worst
    probes of wiki-diverse and pydocs at KL 0.050 and 0.038, README "The run-start
    guard"), else one more block, by one more request
    (:func:`~promptsplice.engine_adapters.connector._plans.extend_recompute`).
    ``extra`` counts the blocks added, ``extended`` lists where each starts, ``deviated``
    those of runs computed because their own start was measured to deviate (not for an
    earlier one, nor for a probe that went unmeasured), ``unmeasured``: the request's
    first trip came from a planned probe that went unmeasured (read as infinite: no
    deviation learnt)."""

    __slots__ = ("max_deviation", "tokens", "extended", "window", "whole_run", "tripped", "deviated", "unmeasured")

    def __init__(self, max_deviation: float, tokens: Sequence[int], *, window: int = 1,
                 whole_run: bool = False) -> None:
        self.max_deviation = max_deviation
        self.tokens = tokens
        self.extended: list[int] = []
        self.window = max(1, window)
        self.whole_run = whole_run
        self.tripped = False  # whole_run: a run start deviated; every later run is computed
        self.deviated: list[int] = []
        self.unmeasured = False

    @property
    def extra(self) -> int:
        return len(self.extended)

    def __call__(self, seen: list[Any], nxt: SplicePhase) -> list[SplicePhase] | None:
        plan = nxt.plan
        if plan is None or not plan.segments:
            return None
        bs, end = plan.block_size, plan.dst_start
        latest = {d.dst_start: d.value for d in seen if end - self.window * bs <= d.dst_start < end}
        own = bool(latest) and max(latest.values()) > self.max_deviation
        # only a missing measurement that decided the request's first trip: after a
        # measured trip every later run is computed anyway (a later unmeasured probe made
        # the request teach nothing, its real trip lost to the gate's rates)
        measured = [v for v in latest.values() if v != float("inf")]
        seen_trip = bool(measured) and max(measured) > self.max_deviation
        self.unmeasured |= own and not self.tripped and not seen_trip
        if not own and not self.tripped:
            return None
        if self.whole_run:
            self.tripped = True
            phases = compute_run(nxt)
            if phases:
                blocks = [g.dst_start + i * bs for g in plan.segments for i in range(g.num_blocks)]
                self.extended.extend(blocks)
                if seen_trip:  # its own start measured above the threshold
                    self.deviated.extend(blocks)
            return phases
        phases = extend_recompute(nxt, self.tokens)
        if phases:
            self.extended.append(plan.dst_start)
        return phases


def planned_relocated_tokens(phases: Iterable[Any], tokens: Sequence[int], salt: str | bytes | None) -> int:
    """Tokens a step's :class:`~promptsplice.engine_adapters.connector._plans.SplicePhase` list
    (for the prompt ``tokens``, sent under ``salt``) loads approximately: its plans'
    segments, but for those in place after the very same tokens (exact blocks)."""
    return sum(approximate_tokens(ph.plan, tokens, salt) for ph in phases if ph.plan is not None)

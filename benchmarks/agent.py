"""``promptsplice bench agent``: agent sessions in three engine modes, with bounds and
measured fidelity.

This is one module (~690 lines): the three modes share one replay loop, one ideal and
its per-mode floors, and one report, which the CLI job and the tests call as a unit;
the probes (``agent_probes``) and the traces live apart.

Every session of an agent trace (:mod:`promptsplice.benchmarks.agent_traces`) is replayed step by
step through :class:`promptsplice.assembler.ContextHook` (the renders already hold the agent's own
edits, so the hook runs without policies) and :class:`promptsplice.engine_adapters.AgentRunner` in
each mode, **each mode on an engine of its own, all of the same capacity**: ``full`` (no
cache: a fresh salt per request) on a plain engine; ``apc`` (vLLM's prefix cache *plus
the same block store* through the splice connector, serving offload hits of exact
prefixes; plain requests, nothing relocated) and ``splice`` (the same store, relocating
by the hook's directives) on two engines started with identical ``kv_store`` configs.
So ``apc`` vs ``splice`` measures relocation, never store capacity (a ``splice`` with a
store against an ``apc`` without one once prefilled *below* the ideal).  No engine sees
another mode's traffic; :func:`run_agent_modes` refuses ``apc``/``splice`` engines of
different KV caches or stores.  The steps of a session run interleaved: ``full``,
``apc``, ``splice``, then the fidelity probes of that step when it is sampled; or, with
``--sequential`` (machines short of memory), one mode after the other, each on its
engine started for it, one engine alive at a time (no fidelity probes).

Bounds reported beside the modes:

* per mode its own floor (``bounds.checks``, :func:`mode_bound_checks`; per mode
  ``steps_below_bound``): ``full`` prefills every prompt token (a fresh salt per
  request: any cache hit is a bug), ``apc`` at least ``prefix_ideal_prefill_tokens``
  (the ideal below without (b) and (c): what no relocation can free) and relocates
  nothing, ``splice`` at least ``ideal_prefill_tokens``.
* ``ideal_prefill_tokens``: a lower bound for every mode at equal capacity.  Per step,
  a token is free when (a) it lies in the longest exact prefix that any earlier step of
  any mode computed (prompt or cached generated tokens, whole blocks: what a cache of
  unlimited capacity would serve, independent of what the modes' caches did serve), or
  that the render shares with the session's previous one, (b) it lies
  in an unchanged run of the token diff against the previous render (what relocation
  can move), or (c) its message (same rendered text and padding) was in the previous
  render (a repeated output); everything else is prefilled, and at least the last
  block's tokens are (vLLM never serves the last prompt token from cache and both the
  cache and the store work in whole blocks).  A mode's total prefill below it, or any
  step of a mode below the step's bound (``steps_below_ideal``), is a bug in the bench or
  the bound: the bench fails (:class:`~promptsplice.benchmarks.bounds.BoundError`, exit
  status ``BOUND_EXIT``, 4, as ``bench rag``) naming the mode and the numbers.
* per edit kind (:func:`promptsplice.benchmarks.agent_traces.classify_step`) the steps and each
  mode's prefill, so users see where splicing pays (deep edits) and where it cannot
  (an edit of the last message leaves nothing to relocate).

Fidelity (edit steps that relocate KV, 32 by default, spread over (edit kind, depth)
strata and sessions: the edits predicted to relocate, :func:`relocating_edits`, ranked
by :func:`probe_ranks` and taken in rank order by :class:`ProbeTurns`, each labelled
with its stratum; 95% intervals resample sessions, the
probes of one session sharing its context: ``ci_unit`` "session"; each probe verified to have measured relocated
KV, :func:`promptsplice.benchmarks.fidelity.verify_step`; measured on the real model against a one-pass full
prefill ``R`` of the same render with 32 greedy tokens ``c``): teacher-forced top-1
agreement (the context plus ``c[:k]`` predicts ``c[k]``, k < 32), the KL divergence
``KL(R || mode)`` of the first-token distributions over the whole vocabulary (nats),
and greedy agreement (the mode's own 32 greedy tokens: the fraction equal to ``c``
before the first divergence).  ``control`` measures ``apc`` the same way: exact KV that
differs from ``R`` only by bf16 rounding (cached vs one-pass attention).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.agent_probes import ProbeTurns, probe_ranks, relocating_edits
from promptsplice.benchmarks.assemble import gap_closed
from promptsplice.benchmarks.agent_traces import AgentSession, classify_step, read_agent_trace
from promptsplice.benchmarks.coverage import COVERAGE_EXIT, Coverage, CoverageError, check_coverage
from promptsplice.benchmarks._stats import capacity_shape, error_report, percentile
from promptsplice.assembler import PrefixCacheMirror
from promptsplice.blocks import chain_hashes
from promptsplice.benchmarks.bounds import BOUND_EXIT, BoundError
from promptsplice.benchmarks.fidelity import (
    DEFAULT_PROBES,
    FIDELITY_FIELDS,
    PROBE_TOKENS,
    Fidelity,
    FidelityError,
    check_probes,
    full_blocks,
    probe_coverage,
    reference,
    verify_step,
)
from promptsplice._validate import check_int, check_optional_int
from promptsplice.errors import ConfigError

__all__ = [
    "ProbeTurns",
    "MODE_FIELDS",
    "FIDELITY_FIELDS",
    "BoundError",
    "run_agent_modes",
    "run_agent_bench",
    "format_agent",
    "start_engines",
    "start_mode_engine",
    "check_bounds",
    "probe_ranks",
]

_log = logging.getLogger(__name__)

MODES = ("full", "apc", "splice")
MODE_FIELDS = (
    "steps",
    "prompt_tokens",
    "prefill_tokens",
    "cached_tokens",
    "relocated_tokens",
    "hit_rate",
    "wall_s",
    "ttft_p50_ms",
    "edit_steps_prefill_tokens",
    "edit_steps_ttft_p50_ms",
)






class _Totals:
    def __init__(self) -> None:
        self.steps = 0
        self.prompt = self.prefill = self.cached = self.relocated = 0
        self.wall = 0.0
        self.ttft: list[float] = []
        self.edit_prefill = 0
        self.edit_ttft: list[float] = []

    def add(self, st: Any, edit: bool) -> None:
        self.steps += 1
        self.prompt += st.prompt_tokens
        self.prefill += st.prefill_tokens
        self.cached += st.cached_tokens
        self.relocated += st.relocated_tokens
        self.wall += st.wall_s
        self.ttft.append(st.ttft_s)
        if edit:
            self.edit_prefill += st.prefill_tokens
            self.edit_ttft.append(st.ttft_s)

    def report(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt,
            "prefill_tokens": self.prefill,
            "cached_tokens": self.cached,
            "relocated_tokens": self.relocated,
            "hit_rate": round(1 - self.prefill / self.prompt, 4) if self.prompt else 0.0,
            "wall_s": round(self.wall, 3),
            "ttft_p50_ms": _ms(percentile(self.ttft, 0.5, empty=None)),
            "edit_steps_prefill_tokens": self.edit_prefill,
            # null, not 0 ms, for a trace without edit steps (0 read as a measurement)
            "edit_steps_ttft_p50_ms": _ms(percentile(self.edit_ttft, 0.5, empty=None)),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


class _Computed:
    """Every full block any mode computed so far (prompts, and the generated tokens the
    engines cache: all but the last), salts aside, in an unbounded
    :class:`~promptsplice.assembler.PrefixCacheMirror` (vLLM's block identity and hit
    rule): the longest exact prefix a cache of unlimited capacity could serve, whatever
    any mode's cache did serve (the ideal once took it from the modes' own hits, so it
    could not catch a mode that hit too little or a hit count that was wrong)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._mirror = PrefixCacheMirror(block_size)

    def hit(self, tokens: Sequence[int]) -> int:
        """Tokens of the leading blocks of ``tokens`` computed before (vLLM's rule: never
        the block of the last token)."""
        return self._mirror.predict(chain_hashes(list(tokens), self.block_size), len(tokens)).cached_tokens

    def add(self, prompt: Sequence[int], outputs: Sequence[Sequence[int]]) -> None:
        prompt = list(prompt)
        for seq in [prompt + list(out or ())[:-1] for out in outputs] + [prompt]:
            self._mirror.admit(chain_hashes(seq, self.block_size), len(seq), record=False)


def _ideal_step(prepared: Any, exact_prefix: int, block_size: int, *, relocation: bool = True) -> int:
    """The step's lower bound at equal capacity (see the module doc): tokens outside
    the exact prefix, the diff's unchanged runs and the previous render's messages,
    and at least the last block's.  ``relocation=False``: the bound of a mode that
    relocates nothing (``apc``): only the exact prefix is free, (a) of the module doc."""
    render, prev, diff = prepared.render, prepared.previous, prepared.diff
    n = len(render.token_ids)
    free: list[tuple[int, int]] = [(0, max(exact_prefix, prepared.first_changed_token))]
    if relocation and diff is not None:
        free += [(r.new_start, r.new_start + r.length) for r in diff.relocations]
    if relocation and prev is not None:
        seen = {(s.key, s.padding) for s in prev.body_segments}
        free += [(s.start, s.end) for s in render.segments if (s.key, s.padding) in seen]
    covered, end = 0, 0
    for a, b in sorted(free):
        a, b = max(a, end), min(b, n)
        if b > a:
            covered += b - a
            end = b
    tail = n - ((n - 1) // block_size) * block_size if n else 0
    return max(n - covered, tail)


def _store_shape(eng: Any) -> dict[str, Any]:
    """What ``apc`` and ``splice`` must share (:func:`~promptsplice.benchmarks._stats.capacity_shape`):
    KV blocks, block size, dtype, prefix caching, context length and the store's tiers."""
    return capacity_shape(eng)


BOUND_NAMES = {"full": "prompt", "apc": "prefix_ideal", "splice": "ideal"}
"""Each mode's floor (module doc): ``full`` prefills every prompt token; ``apc`` the
ideal without relocation (:func:`_ideal_step` with ``relocation=False``); ``splice``
the ideal."""


def mode_bound_checks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each mode's own floor and whether it holds (``report["bounds"]["checks"]``):
    ``full`` >= its prompt tokens (fresh salts: any hit is a bug), ``apc`` >= the prefix
    ideal (``prefix_ideal_prefill_tokens``; the shared ideal in a report without it) and
    ``relocated_tokens == 0``, ``splice`` >= the ideal; no step of a mode below the
    step's floor (``steps_below_bound``) nor below the shared ideal (``steps_below_ideal``)."""
    ideal = report["ideal_prefill_tokens"]
    out: dict[str, dict[str, Any]] = {}
    for m, v in report["modes"].items():
        name = BOUND_NAMES.get(m, "ideal")
        bound = {"prompt": v.get("prompt_tokens", 0), "ideal": ideal,
                 "prefix_ideal": report.get("prefix_ideal_prefill_tokens", ideal)}[name]
        c = {"bound": name, "bound_prefill_tokens": bound, "prefill_tokens": v["prefill_tokens"],
             "steps_below_bound": v.get("steps_below_bound", 0)}
        holds = (v["prefill_tokens"] >= bound and c["steps_below_bound"] == 0
                 and v.get("steps_below_ideal", 0) == 0)
        if m == "apc":
            c["relocated_tokens"] = v.get("relocated_tokens", 0)
            holds = holds and c["relocated_tokens"] == 0
        out[m] = {**c, "holds": holds}
    return out


def check_bounds(report: dict[str, Any]) -> None:
    """:class:`BoundError` when a mode's prefill is below its floor (:func:`mode_bound_checks`,
    the module doc), or ``apc`` relocated anything."""
    ideal = report["ideal_prefill_tokens"]
    checks = mode_bound_checks(report)
    bad = {m: c for m, c in checks.items() if not c["holds"]}
    if bad:
        what = "; ".join(
            f"{m} prefilled {c['prefill_tokens']} tokens, "
            + (f"below the ideal of {ideal}" if c["bound"] == "ideal"
               else f"against its floor ({c['bound']}) of {c['bound_prefill_tokens']}")
            + (f", and relocated {c['relocated_tokens']} tokens (it must relocate none)"
               if c.get("relocated_tokens") else "")
            for m, c in bad.items())
        raise BoundError(
            f"bench agent: {what} (lower bounds at equal capacity): the bench or the bound is wrong; "
            f"steps below the step's bound: { {m: report['modes'][m].get('steps_below_ideal', 0) for m in bad} }, "
            f"below the mode's own step floor: { {m: c['steps_below_bound'] for m, c in bad.items()} }"
        )


def _check_capacity(shapes: dict[str, Any], has_store: bool) -> None:
    if not has_store or shapes["apc"] != shapes["splice"]:
        raise ConfigError(
            "engines: apc and splice must run at equal capacity (same KV blocks, block size, dtype, prefix "
            "caching, max_model_len and kv_store tiers, the remote one included), got apc "
            f"{shapes['apc']} and splice {shapes['splice']}; start them with start_engines()"
        )


def _check_counts(max_tokens: Any, fidelity_steps: Any) -> None:
    """:class:`ConfigError` for a ``max_tokens`` below 1 or a ``fidelity_steps`` below 0
    (-1 or 2.5 gave a probe coverage of -0.0 or 1.2), or either not an int."""
    check_int(max_tokens, "max_tokens")
    check_int(fidelity_steps, "fidelity_steps", minimum=0)


def _full_shape(eng: Any) -> dict[str, Any]:
    """What ``full``'s engine must share with the others: the block size (the one hook
    pads renders, and the ideal counts blocks, in it) and the dtype (the probes compare
    logits across them; until 2026-12-07 not compared).  Its KV blocks and store may
    differ (``full`` runs every step under a fresh salt), and so may its context length:
    interleaved, a step over any engine's is skipped in every mode; one mode at a time,
    the modes must have skipped the same steps (:func:`_merge_replays`)."""
    return {"block_size": eng.block_size, "dtype": eng.config.dtype}


def _check_full(full: dict[str, Any], mode: str, other: dict[str, Any]) -> None:
    """:class:`ConfigError` unless ``full``'s :func:`_full_shape` is ``mode``'s."""
    if other["block_size"] != full["block_size"]:
        raise ConfigError(f"engines: full's block size {full['block_size']} differs from {mode}'s "
                          f"{other['block_size']}; start every mode with one block size")
    if other != full:
        raise ConfigError(f"engines: full's dtype {full['dtype']!r} differs from {mode}'s {other['dtype']!r}; "
                          "start every mode with one dtype (start_engines() does)")


def _merge_replays(recs: list[Any] | None, one: list[Any], mode: str, lens: list[int]) -> list[Any]:
    """One more mode's replay (``--sequential``) merged into the records so far: a step
    counts when every mode ran it.  The modes must have skipped the same steps: a step
    over one engine's context but not another's ran in some modes only (traffic the
    report counts as skipped, and the next step then pairs a fresh start with an edit),
    so differing skips are a :class:`ConfigError` (until 2026-12-07 they were merged)."""
    if recs is None:
        return one
    mine = [i for i, x in enumerate(one) if x is None]
    theirs = [i for i, x in enumerate(recs) if x is None]
    if mine != theirs:
        raise ConfigError(
            f"bench agent --sequential: {mode} skipped steps {mine[:8]} and the modes before it {theirs[:8]} "
            f"(engine contexts {lens}): start every mode with one max_model_len")
    return [None if a is None else (a[0], a[1], a[2], {**a[3], **b[3]}) for a, b in zip(recs, one)]


def _replay(sessions, runners, tokenizer, block_size, max_tokens, on_step=None, log=None) -> list[Any]:
    """Every step of ``sessions`` through one hook and ``runners`` (mode -> runner), in
    order: ``(kind, edit, prepared, {mode: AgentStep})`` or ``None`` for a skipped step
    (a prompt over an engine's context: the session is forgotten, its next step starts
    afresh)."""
    from promptsplice.assembler import ContextHook
    from promptsplice.errors import ContextLengthError

    # One hook for the modes: the render does not depend on the mode (each runner sends
    # it under its own salt), so every step is rendered and diffed once.
    hook = ContextHook(tokenizer, block_size=block_size)
    out: list[Any] = []
    total, t0 = sum(len(s.renders) for s in sessions), time.perf_counter()
    for si, sess in enumerate(sessions):
        for i, msgs in enumerate(sess.renders):
            if log is not None and len(out) % 10 == 0:
                print(f"bench agent: {'/'.join(runners)} step {len(out) + 1} of {total} "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            # after a skipped step the session starts afresh: a first step, not an edit
            # of the render it never ran
            fresh = i == 0 or out[-1] is None
            kind = classify_step(None if fresh else sess.renders[i - 1], msgs)
            prepared = hook(sess.id, msgs, sess.tools or None)
            steps = {}
            try:
                for m, runner in runners.items():
                    steps[m] = runner.step(prepared, max_tokens=max_tokens)
            except ContextLengthError as exc:
                _log.warning("bench agent: session %s step %d skipped: %s", sess.id, i, exc)
                hook.forget(sess.id)
                for runner in runners.values():
                    runner.forget(sess.id)
                out.append(None)
                continue
            rec = (kind, kind not in ("first", "append"), prepared, steps)
            out.append(rec)
            if on_step is not None:
                on_step(si, i, rec)
    return out


def run_agent_modes(
    sessions: Sequence[AgentSession],
    *,
    engines: dict[str, Any] | None = None,
    start_engine: Any = None,
    recompute_blocks: int | None = None,
    max_tokens: int = PROBE_TOKENS,
    fidelity_steps: int = DEFAULT_PROBES,
    scope: str = "session",
    log: Any = None,
) -> dict[str, Any]:
    """Replay ``sessions`` in the three modes; returns the report dict (module doc).

    ``engines``: one :class:`EmbeddedEngine` per mode (``full``, ``apc``, ``splice``),
    three distinct engines; ``apc`` and ``splice`` started with the same KV cache and
    the same ``kv_store`` sizes (:class:`ConfigError` otherwise), all with
    ``max_logprobs=-1`` for the KL probes (:func:`start_engines` makes such a set); the
    steps of the modes run interleaved.  Or ``start_engine`` (``mode -> engine``): the
    modes run one after the other, each on an engine started for it and closed after
    it, so only one engine is alive at a time (for machines short of memory; no
    fidelity probes then: ``fidelity_steps`` must be 0).  ``fidelity_steps``: how many
    edit steps that relocate KV to probe (:func:`probe_ranks`); a probe that did not
    measure relocated KV raises :class:`~promptsplice.benchmarks.fidelity.FidelityError`.  The report's ``coverage``/
    ``steps_run``/``steps_total``/``skipped_steps`` say how much of the trace ran.
    """
    from promptsplice.engine_adapters import AgentRunner
    from promptsplice.engine_adapters.runners._agent import DEFAULT_RECOMPUTE_BLOCKS

    _check_counts(max_tokens, fidelity_steps)
    if (engines is None) == (start_engine is None):
        raise ConfigError("pass engines (interleaved modes) or start_engine (one mode at a time), not both")
    if start_engine is not None and fidelity_steps:
        raise ConfigError(f"fidelity_steps={fidelity_steps} needs the three engines alive together: "
                          "drop --sequential, or pass --fidelity-steps 0 with it")
    if engines is not None:
        if not isinstance(engines, dict) or set(engines) != set(MODES):
            raise ConfigError(f"engines must map each of {MODES} to an engine, got {engines!r}")
        if len({id(e) for e in engines.values()}) != len(MODES):
            raise ConfigError("engines: each mode needs an engine of its own (no mode may see another's traffic)")
        shared = getattr(engines["apc"], "kv_store", None)
        if shared is not None and shared is getattr(engines["splice"], "kv_store", None):
            # engines of one process on equal StoreConfigs share one store: splice would
            # load what apc saved, and the reverse
            raise ConfigError("engines: apc and splice share one block store (engines of one process on "
                              "equal StoreConfigs do); make the two StoreConfigs differ (each its own disk_dir)")
        _check_capacity({m: _store_shape(engines[m]) for m in ("apc", "splice")},
                        engines["apc"].config.kv_store is not None)
        _check_full(_full_shape(engines["full"]), "apc", _full_shape(engines["apc"]))  # (= splice's)
    r = DEFAULT_RECOMPUTE_BLOCKS if recompute_blocks is None else recompute_blocks
    # Salts of this run only: an engine that served an earlier run (a library caller's,
    # a test's) keeps its blocks, which a fixed salt let this run hit (found by the
    # mode-independent ideal: a mode prefilled below it).
    run_id = uuid.uuid4().hex[:12]
    salts = {m: f"bench-agent-{m}-{run_id}" for m in MODES}

    def runner(m: str, eng: Any) -> Any:
        if m == "splice":
            return AgentRunner(eng, mode="splice", salt=salts[m], recompute_blocks=r, scope=scope, fidelity="bounded")
        return AgentRunner(eng, mode=m, salt=salts[m])

    steps_total = sum(len(s.renders) for s in sessions)
    ranks = {}
    if engines is not None and fidelity_steps:  # ranked among the edits predicted to relocate
        eng = engines["splice"]
        ranks = probe_ranks(sessions, only=relocating_edits(sessions, eng.tokenizer, eng.block_size, r))
    turns = ProbeTurns(ranks, fidelity_steps)
    # probes of one session share its context: the intervals resample sessions
    fid = {"splice": Fidelity(ci_unit="session"), "apc": Fidelity(ci_unit="session")}
    t_start = time.perf_counter()
    if engines is not None:
        runners = {m: runner(m, engines[m]) for m in MODES}

        def probe(si: int, i: int, rec: Any) -> None:
            _, _, prepared, steps = rec
            label = turns.take((si, i), steps["splice"].planned_relocated_tokens > 0)
            if label is not None and not _measure(engines, prepared.token_ids, steps, runners,
                                                  prepared.session_id, fid, label=label):
                turns.give_back()  # nothing to probe: a later relocating step takes the turn

        eng0 = engines["full"]
        recs = _replay(sessions, runners, eng0.tokenizer, eng0.block_size, max_tokens, probe, log)
        block_size, max_len, kv_blocks = eng0.block_size, min(e.max_model_len for e in engines.values()), engines["apc"].num_blocks
    else:
        recs, shapes, lens, has_store = None, {}, [], True
        for m in MODES:
            eng = start_engine(m)
            try:
                if m == "full":  # full runs first: the others must match it
                    full_shape = _full_shape(eng)
                else:
                    _check_full(full_shape, m, _full_shape(eng))
                if m in ("apc", "splice"):
                    shapes[m] = _store_shape(eng)
                    has_store = has_store and eng.config.kv_store is not None
                    if len(shapes) == 2:  # before the last mode replays, not after the whole run
                        _check_capacity(shapes, has_store)
                lens.append(eng.max_model_len)
                block_size, kv_blocks = eng.block_size, eng.num_blocks
                one = _replay(sessions, {m: runner(m, eng)}, eng.tokenizer, eng.block_size, max_tokens, log=log)
            finally:
                eng.close()
            recs = _merge_replays(recs, one, m, lens)
        max_len = min(lens)

    totals = {m: _Totals() for m in MODES}
    by_kind: dict[str, dict[str, Any]] = {}
    ideal = prefix_ideal = skipped = fallbacks = 0
    below = {m: 0 for m in MODES}
    below_own = {m: 0 for m in MODES}  # steps below the mode's own floor (mode_bound_checks)
    computed = _Computed(block_size)
    for rec in recs:
        if rec is None:
            skipped += 1
            continue
        kind, edit, prepared, steps = rec
        fallbacks += int(steps["splice"].fallback is not None and edit)
        for m in MODES:
            totals[m].add(steps[m], edit)
        exact = computed.hit(prepared.token_ids)
        computed.add(prepared.token_ids, [steps[m].completion.token_ids for m in MODES])
        step_ideal = _ideal_step(prepared, exact, block_size)
        step_prefix = _ideal_step(prepared, exact, block_size, relocation=False)
        ideal += step_ideal
        prefix_ideal += step_prefix
        floors = {"full": steps["full"].prompt_tokens, "apc": step_prefix, "splice": step_ideal}
        for m in MODES:
            below[m] += int(steps[m].prefill_tokens < step_ideal)
            below_own[m] += int(steps[m].prefill_tokens < floors[m])
        k = by_kind.setdefault(kind, {"steps": 0, **{m: {"prefill_tokens": 0, "ttft_ms": []} for m in MODES}})
        k["steps"] += 1
        for m in MODES:
            k[m]["prefill_tokens"] += steps[m].prefill_tokens
            k[m]["ttft_ms"].append(steps[m].ttft_s * 1e3)
        if log is not None:
            log(f"{prepared.session_id} step {prepared.step} {kind:9s} prefill full {steps['full'].prefill_tokens:5d} "
                f"apc {steps['apc'].prefill_tokens:5d} splice {steps['splice'].prefill_tokens:5d} "
                f"ideal {step_ideal:5d} (relocated {steps['splice'].relocated_tokens}, {steps['splice'].requests} req)")
    report: dict[str, Any] = {
        "modes": {m: {**totals[m].report(), "steps_below_ideal": below[m], "steps_below_bound": below_own[m]}
                  for m in MODES},
        "ideal_prefill_tokens": ideal,
        "prefix_ideal_prefill_tokens": prefix_ideal,
        "fidelity": {**fid["splice"].report(), "control": fid["apc"].report(), "tokens": PROBE_TOKENS,
                     "requested": fidelity_steps, "passed_without_relocation": turns.passed,
                     **probe_coverage(fidelity_steps, turns.eligible, len(fid["splice"].kl))},
        "recompute_blocks": r,
        "scope": scope,
        "sessions": len(sessions),
        **Coverage(steps_total - skipped, steps_total).report(),
        "max_model_len": max_len,
        "kv_cache_blocks": kv_blocks,
        "sequential": engines is None,
        "splice_fallback_steps": fallbacks,
        "by_kind": {
            kind: {"steps": v["steps"], **{m: {"prefill_tokens": v[m]["prefill_tokens"],
                                             "ttft_p50_ms": round(percentile(v[m]["ttft_ms"], 0.5), 2)} for m in MODES}}
            for kind, v in sorted(by_kind.items())
        },
        "bench_wall_s": round(time.perf_counter() - t_start, 1),
    }
    apc, spl = report["modes"]["apc"]["prefill_tokens"], report["modes"]["splice"]["prefill_tokens"]
    report["gap_closed"] = gap_closed(apc, spl, ideal)  # the RAG benches' rule: a loss is negative
    report["bounds"] = {"checks": mode_bound_checks(report)}
    return report


def _measure(engines, tokens, steps, runners, sid, fid, *, label=None) -> bool:
    """Fidelity probes of one step (:mod:`promptsplice.benchmarks.fidelity`): one-pass reference
    (on the ``full`` engine), then ``apc`` (control) and ``splice`` teacher-forced on its
    continuation, each on its own engine.  The splice step must have relocated what its
    plan did, and each of its probes must be served the step's KV (else
    :class:`~promptsplice.benchmarks.fidelity.FidelityError`).  The control is checked
    the same way: ``apc`` must be served the step's cached KV, else it would be a
    one-pass prefill and understate the noise floor.  False when there was nothing to
    probe (the reference ended at once)."""
    verify_step(steps["splice"], f"agent step {sid}/{steps['splice'].step}")
    cont, p_ref = reference(engines["full"], tokens)
    if not cont:  # EOS at once: nothing to probe
        return False
    need = {m: full_blocks(engines[m], tokens) for m in ("apc", "splice")}
    sp = steps["splice"]
    # the edit's signals for both; the splice step's own counts only on its records
    # (the control's carried the splice step's relocated tokens and deviations)
    edit = {"session": sid, "step": sp.step, "changed_share": round(sp.changed_share, 4)}
    own = {"apc": {**edit, "relocated_tokens": 0, "deviation_max": None},
           "splice": {**edit, "relocated_tokens": sp.relocated_tokens, "deviation_max": max(sp.deviations, default=None)}}
    for m in ("apc", "splice"):
        # the mode's own 32 greedy tokens from the step's KV (its completion holds only
        # --max-tokens of them, which capped greedy agreement at max_tokens / 32)
        salt = runners[m].session_salt(sid)
        greedy = engines[m].generate(tokens, max_tokens=PROBE_TOKENS, cache_salt=salt)
        if greedy.num_cached_tokens < need[m]:
            raise FidelityError(f"agent step {sid}/{sp.step}: the {m} greedy probe was served "
                                f"{greedy.num_cached_tokens} cached tokens of the {need[m]} the step's KV covers")
        fid[m].measure(engines[m], tokens, cont, p_ref, salt, greedy.token_ids,
                       need_cached=need[m], label=label, signals=own[m])
    return True


def _fmt_ms(ms: float | None, width: int) -> str:
    return f"{'n/a':>{width}s}  " if ms is None else f"{ms:{width}.0f}ms"


def format_agent(report: dict[str, Any]) -> str:
    lines = [f"{'mode':8s} {'prefill':>9s} {'relocated':>9s} {'hit':>6s} {'TTFT p50':>9s} {'edit TTFT p50':>13s}"]
    for m in MODES:
        x = report["modes"][m]
        lines.append(f"{m:8s} {x['prefill_tokens']:9d} {x['relocated_tokens']:9d} {x['hit_rate']:6.3f} "
                     f"{_fmt_ms(x['ttft_p50_ms'], 7)} {_fmt_ms(x['edit_steps_ttft_p50_ms'], 11)}")
    lines.append(f"ideal prefill (lower bound at equal capacity): {report['ideal_prefill_tokens']}; "
                 f"splice closes {report['gap_closed']} of the apc -> ideal gap")
    checks = report.get("bounds", {}).get("checks", {})
    if checks:
        lines.append("floors: " + ", ".join(
            f"{m} >= {c['bound']} {c['bound_prefill_tokens']} {'ok' if c['holds'] else 'VIOLATED'}"
            for m, c in checks.items()))
    lines.append(f"coverage {report['coverage']} ({report['steps_run']} of {report['steps_total']} steps, "
                 f"{report['skipped_steps']} skipped; max_model_len {report['max_model_len']})")
    f = report["fidelity"]
    c = f["control"]
    lines.append(f"fidelity over {f['steps']} verified edit steps: splice tf-top1 {f['tf_top1_agreement']} "
                 f"{f['tf_top1_ci95']} (p10 {f['tf_top1_p10']}) KL {f['first_token_kl']} {f['first_token_kl_ci95']} "
                 f"(p50 {f['first_token_kl_p50']}, p90 {f['first_token_kl_p90']}, max {f['first_token_kl_max']}) "
                 f"greedy {f['greedy_agreement']} | control (apc) tf-top1 {c['tf_top1_agreement']} KL "
                 f"{c['first_token_kl']} (p90 {c['first_token_kl_p90']}) greedy {c['greedy_agreement']}")
    for kind, v in report["by_kind"].items():
        lines.append(f"  {kind:9s} {v['steps']:4d} steps  prefill apc {v['apc']['prefill_tokens']:7d} "
                     f"splice {v['splice']['prefill_tokens']:7d}  TTFT p50 apc {v['apc']['ttft_p50_ms']:6.0f} "
                     f"splice {v['splice']['ttft_p50_ms']:6.0f} ms")
    return "\n".join(lines)


def start_engines(*, store_dir: str | None = None, dram_bytes: int = 1 << 30) -> dict[str, Any]:
    """The bench's three engines, one per mode, each with the default KV cache: ``full``
    plain, ``apc`` and ``splice`` each with its own store of the same sizes (DRAM then
    disk, in folders of their own under ``store_dir``)."""
    engines: dict[str, Any] = {}
    try:
        for m in MODES:
            engines[m] = start_mode_engine(m, store_dir=store_dir, dram_bytes=dram_bytes)
    except BaseException:
        for eng in engines.values():
            eng.close()
        raise
    return engines


def start_mode_engine(mode: str, *, store_dir: str | None = None, dram_bytes: int = 1 << 30) -> Any:
    """The engine of one mode (see :func:`start_engines`)."""
    from promptsplice.engine_adapters import EmbeddedEngine, StoreConfig

    extra = {"max_logprobs": -1}
    if mode == "full":
        return EmbeddedEngine(extra_kwargs=extra)
    root = Path(store_dir or tempfile.mkdtemp(prefix="promptsplice-agent-store-"))
    (root / mode).mkdir(parents=True, exist_ok=True)
    store = StoreConfig(dram_bytes=dram_bytes, disk_bytes=4 << 30, disk_dir=str(root / mode), fsync=False)
    return EmbeddedEngine(kv_store=store, extra_kwargs=extra)


def run_agent_bench(
    trace: str | Path,
    json_out: str | Path,
    *,
    recompute_blocks: int | None = None,
    sessions: int | None = None,
    max_tokens: int = PROBE_TOKENS,
    fidelity_steps: int = DEFAULT_PROBES,
    scope: str = "session",
    allow_skips: bool = False,
    sequential: bool = False,
    verbose: bool = True,
) -> int:
    """The CLI's job: read the trace, run the modes, write the JSON, print a table.

    The JSON is written in every case (a run that raised writes ``{"trace", "error":
    {"type", "message"}}`` and the error goes on to the caller).  Then a mode below the ideal raises
    ``BOUND_EXIT`` (4, printed), and coverage below ``MIN_COVERAGE`` returns
    ``COVERAGE_EXIT`` (3) unless ``allow_skips``."""

    check_optional_int(sessions, "sessions")  # (-1 sliced off the last session, and the run read 1.0 coverage)
    _check_counts(max_tokens, fidelity_steps)  # before the engines start
    data = read_agent_trace(trace)
    if sessions is not None:
        data = data[:sessions]
    common = {"recompute_blocks": recompute_blocks, "max_tokens": max_tokens, "fidelity_steps": fidelity_steps,
              "scope": scope, "log": print if verbose else None}
    # the stores' disk tiers keep their records on close (a restart reloads them): the
    # bench's own folder goes with the run
    out = Path(json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="promptsplice-agent-store-", ignore_cleanup_errors=True) as store_dir:
            if sequential:
                report = run_agent_modes(data, start_engine=lambda m: start_mode_engine(m, store_dir=store_dir), **common)
            else:
                engines = start_engines(store_dir=store_dir)
                try:
                    report = run_agent_modes(data, engines=engines, **common)
                finally:
                    for eng in engines.values():
                        eng.close()
    except Exception as exc:  # a probe that failed its check, an engine error: the JSON says so too
        out.write_text(json.dumps(error_report(trace, exc), indent=2) + "\n")
        raise
    report["trace"] = str(trace)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_agent(report))
    print(f"wrote {out}")
    try:
        check_bounds(report)
    except BoundError as exc:
        print(f"promptsplice: error: {exc}", file=sys.stderr)
        return BOUND_EXIT
    try:
        check_coverage(Coverage(report["steps_run"], report["steps_total"]), allow_skips=allow_skips,
                       what="bench agent")
        check_probes(report["fidelity"], allow_skips=allow_skips, what="bench agent")
    except CoverageError as exc:
        print(f"promptsplice: error: {exc}", file=sys.stderr)
        return COVERAGE_EXIT
    return 0

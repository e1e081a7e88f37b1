"""Fidelity of approximate KV against exact prefill, measured on the real model.

Shared by ``bench agent`` (spliced edits) and ``bench rag`` (position-independent
chunks).  For a prompt ``P``, a one-pass exact prefill ``R`` gives 32 greedy tokens
``c`` and the first-token distribution over the whole vocabulary.  A mode's KV is
judged by:

* teacher-forced top-1 agreement: ``P + c[:k]`` predicts ``c[k]`` (k < 32), each probe
  a request that reaches the mode's cached KV through its salt;
* ``KL(R || mode)`` of the first-token distributions (nats);
* greedy agreement: the mode's own greedy tokens, the fraction equal to ``c`` before
  the first divergence.

Always beside a ``control``: exact KV that differs from ``R`` only by bf16 rounding
(part of the prompt served from the prefix cache, the rest computed), the noise floor
of each measure.

Probes prove what they measure: a probed step must have relocated exactly what its plan
relocated (the connector's count, :func:`verify_step`), and every probe request must
have been served that step's KV from vLLM's cache (its ``num_cached_tokens`` covers
every full block of the prompt, :func:`probe`); otherwise :class:`FidelityError` fails
the bench: an approximate mode silently measured on exact KV would score as exact.

Reported per configuration (:meth:`Fidelity.report`): the means (fixed field names)
and the distributions: first-token KL mean, p50, p90, max; teacher-forced top-1 mean,
p50, p10 and min (its bad tail is the low one); each mean with a bootstrap 95% interval
(seeded, so the same probes give the same interval), resampling probes or, where probes
share a context (``ci_unit``: the agent bench's sessions), whole clusters of them.  What
the figures rest on is reported beside them: ``small_sample`` (a percentile of too few
probes is their min or max; ``percentile_min_n``) and ``ci95_undefined`` (an interval
over one unit has width 0 and says nothing).
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Sequence
from typing import Any

from promptsplice.benchmarks._stats import percentile, sample_flags
from promptsplice.benchmarks.coverage import MIN_COVERAGE, CoverageError
from promptsplice.errors import PromptspliceError

__all__ = [
    "PROBE_TOKENS",
    "FIDELITY_FIELDS",
    "PERCENTILE_FIELDS",
    "DEFAULT_PROBES",
    "Fidelity",
    "FidelityError",
    "bootstrap_ci",
    "check_probes",
    "full_blocks",
    "kl",
    "probe",
    "probe_coverage",
    "probe_relocated_request",
    "greedy_agreement",
    "reference",
    "verify_step",
]

PROBE_TOKENS = 32
FIDELITY_FIELDS = ("tf_top1_agreement", "first_token_kl", "greedy_agreement")
DEFAULT_PROBES = 32
"""Probed steps (agent) / requests (RAG) per configuration by default: fewer is noise."""
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


FIDELITY_EXIT = 5
"""The exit status of a bench whose fidelity probe could not prove what it measured
(:class:`FidelityError`, after the engines ran; bad input before them is 2)."""


class FidelityError(PromptspliceError, RuntimeError):
    """A fidelity probe did not measure approximate KV: the probed step relocated less
    than its plan, or a probe request was not served the step's KV (module doc)."""


def verify_step(step: Any, what: str = "probed step") -> None:
    """The step relocated KV, exactly what its plan relocated (the connector's count
    against the plan's), else :class:`FidelityError`."""
    planned, moved = step.planned_relocated_tokens, step.relocated_tokens
    if planned <= 0 or moved != planned:
        raise FidelityError(
            f"{what}: the plan relocates {planned} tokens but the connector relocated {moved}: "
            "its probes would measure exact KV (a store that no longer holds the blocks, an "
            "engine that cannot relocate); fix the store size or the engine, not the probe"
        )




LOGPROB_FLOOR = -100.0
"""``q``'s logprobs are read no lower than this: a ``-inf`` (a token the sampler masks)
made the KL infinite, and a ``-inf`` in ``p`` made it NaN (0 x -inf), neither of which
a JSON report can hold."""


def kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) in nats from two full-vocabulary logprob dicts (a token ``q`` lacks
    counts at ``q``'s lowest logprob; ``p``'s zero-probability tokens add nothing)."""
    floor = max(min(q.values()), LOGPROB_FLOOR) if q else LOGPROB_FLOOR
    return sum(math.exp(lp) * (lp - max(q.get(t, floor), LOGPROB_FLOOR))
               for t, lp in p.items() if lp != -math.inf)


def greedy_agreement(tokens: Sequence[int], ref: Sequence[int]) -> float:
    n = 0
    for a, b in zip(tokens, ref):
        if a != b:
            break
        n += 1
    return n / len(ref) if ref else 1.0


def reference(engine: Any, tokens: list[int]) -> tuple[list[int], dict[int, float]]:
    """One-pass exact prefill of ``tokens`` (fresh salts): 32 greedy tokens and the
    first-token distribution.

    Two requests: vLLM turns every logprob into a token string, so asking for the whole
    vocabulary on all 32 tokens is slow on CPU; only the first token's is needed.
    """
    cont = engine.generate(tokens, max_tokens=PROBE_TOKENS, cache_salt=f"ref:{uuid.uuid4().hex}").token_ids
    first = engine.generate(tokens, max_tokens=1, cache_salt=f"ref:{uuid.uuid4().hex}", logprobs=-1).logprobs[0]
    return list(cont), first


def full_blocks(engine: Any, tokens: Sequence[int]) -> int:
    """What a repeat of ``tokens`` is served from cache: every full block but the one
    holding the last token (vLLM always computes the last prompt token)."""
    bs = engine.block_size
    return (len(tokens) - 1) // bs * bs


def _served(out: Any, need: int | None, what: str) -> None:
    if need is not None and out.num_cached_tokens < need:
        raise FidelityError(
            f"{what}: vLLM served {out.num_cached_tokens} of the prompt's tokens from cache, "
            f"the probed KV covers {need}: the probe would have measured recomputed (exact) "
            "KV; the engine's KV cache evicted the step's blocks before the probe"
        )


def probe(
    engine: Any, tokens: list[int], cont: list[int], salt: str | None, *, need_cached: int | None = None
) -> tuple[float, dict[int, float]]:
    """Teacher-forced top-1 agreement of ``tokens + cont[:k]`` -> ``cont[k]`` under
    ``salt``, and the first-token distribution there.  ``need_cached``: every probe
    request must be served at least that many tokens from cache (else
    :class:`FidelityError`)."""
    out = engine.generate(tokens, max_tokens=1, cache_salt=salt, logprobs=-1)
    _served(out, need_cached, "fidelity probe")
    first = out.logprobs[0]
    hits = int(max(first, key=first.get) == cont[0])
    for k in range(1, len(cont)):
        out = engine.generate(tokens + cont[:k], max_tokens=1, cache_salt=salt)
        _served(out, need_cached, f"fidelity probe (teacher-forced token {k})")
        hits += int(out.token_ids[0] == cont[k])
    return hits / len(cont), first


def bootstrap_ci(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED, clusters: Sequence[Any] | None = None) -> list[float] | None:
    """The bootstrap 95% interval of the mean of ``values`` (percentile method, seeded:
    deterministic for the same values).  ``clusters`` (one key per value, e.g. the
    session of each probe): a cluster bootstrap, each resample draws whole clusters
    with replacement and takes the mean of their values (values of one cluster are not
    independent: resampling them one by one gives too narrow an interval).  Of one
    value (one cluster) the interval has width 0: it is undefined, which the reports
    say (``ci95_undefined``)."""
    xs = list(values)
    if not xs:
        return None
    rng = random.Random(seed)
    if clusters is None:
        n = len(xs)
        means = sorted(sum(xs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    else:
        if len(clusters) != len(xs):
            raise ValueError(f"clusters: one key per value, got {len(clusters)} keys for {len(xs)} values")
        groups: dict[Any, list[float]] = {}
        for key, x in zip(clusters, xs):
            groups.setdefault(key, []).append(x)
        sums = [(sum(g), len(g)) for g in groups.values()]
        k = len(sums)
        means = []
        for _ in range(resamples):
            pick = [sums[rng.randrange(k)] for _ in range(k)]
            means.append(sum(t for t, _ in pick) / sum(c for _, c in pick))
        means.sort()
    return [round(percentile(means, 0.025), 4), round(percentile(means, 0.975), 4)]  # nearest rank


def probe_coverage(requested: int, eligible: int, probed: int) -> dict[str, Any]:
    """The probes a bench owed and made: ``eligible`` steps could be probed (they
    relocated KV), ``min(requested, eligible)`` were owed; ``probe_coverage`` is the
    share made (1.0 when none were owed)."""
    owed = min(requested, eligible)
    return {"eligible": eligible, "probe_coverage": round(probed / owed, 4) if owed else 1.0}


def check_probes(fidelity: dict[str, Any], *, allow_skips: bool = False, what: str = "bench") -> None:
    """:class:`CoverageError` when a bench probed less than ``MIN_COVERAGE`` of the
    probes it owed (``--allow-skips`` accepts it; the report says how many)."""
    if fidelity["probe_coverage"] < MIN_COVERAGE and not allow_skips:
        raise CoverageError(
            f"{what} probed {fidelity['steps']} steps for fidelity of the {min(fidelity['requested'], fidelity['eligible'])} "
            f"it owed ({fidelity['requested']} requested, {fidelity['eligible']} relocated KV): the fidelity figures "
            "rest on fewer probes than asked; pass --allow-skips to accept them"
        )


PERCENTILE_FIELDS = {"first_token_kl_p50": 0.5, "first_token_kl_p90": 0.9, "tf_top1_p50": 0.5, "tf_top1_p10": 0.1}
"""The nearest-rank percentiles of :meth:`Fidelity.report` (field -> q): each is an
extreme of the probes below :func:`~promptsplice.benchmarks._stats.min_sample` of them
(p90 the max below 10, p10 the min below 11), which ``small_sample`` flags."""


class Fidelity:
    """The three measures over the probed prompts (module doc).  ``ci_unit``: what the
    bootstrap intervals resample, ``"probe"`` (each probe on its own) or a signal every
    probe carries (``"session"``: the agent bench's probes of one session share its
    context, a cluster bootstrap over sessions)."""

    def __init__(self, ci_unit: str = "probe") -> None:
        self.ci_unit = ci_unit
        self.units: list[Any] = []  # per probe, its ci_unit (None: the probe alone)
        self.tf: list[float] = []
        self.kl: list[float] = []
        self.greedy: list[float] = []
        self.labels: dict[str, int] = {}
        self.kl_by: dict[str, float] = {}  # label -> worst first-token KL
        self.records: list[dict[str, Any]] = []  # per probe, with the caller's signals

    def add(self, tf: float, kl_value: float, greedy: float, label: str | None = None,
            signals: dict[str, Any] | None = None) -> None:
        if signals is not None:
            self.records.append({"label": label, "kl": round(kl_value, 5), "tf_top1": round(tf, 4), **signals})
        self.units.append(None if signals is None else signals.get(self.ci_unit))
        self.tf.append(tf)
        self.kl.append(kl_value)
        self.greedy.append(greedy)
        if label is not None:
            self.labels[label] = self.labels.get(label, 0) + 1
            self.kl_by[label] = max(self.kl_by.get(label, kl_value), kl_value)

    def measure(self, engine: Any, tokens: list[int], cont: list[int], p_ref: dict[int, float],
                salt: str | None, greedy_tokens: Sequence[int], *, need_cached: int | None = None,
                label: str | None = None, signals: dict[str, Any] | None = None) -> None:
        tf, first = probe(engine, tokens, cont, salt, need_cached=need_cached)
        self.add(tf, kl(p_ref, first), greedy_agreement(greedy_tokens, cont), label, signals)

    def _clusters(self) -> list[Any] | None:
        if self.ci_unit == "probe":
            return None
        return [("probe", i) if u is None else ("unit", u) for i, u in enumerate(self.units)]

    def report(self) -> dict[str, Any]:
        """The means, distributions and intervals (module doc), with what they rest on:
        ``small_sample`` (some percentile rests on fewer probes than it needs, then it is
        the sample's min or max; ``percentile_min_n`` says how many each needs),
        ``ci_unit`` and ``ci_units`` (what the intervals resampled, how many of them) and
        ``ci95_undefined`` (the interval fields of width 0 by construction: one unit),
        ``probe_floor_met`` (at least :data:`DEFAULT_PROBES` probes: enough to claim)."""
        mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
        q = lambda xs, p: round(percentile(xs, p), 4) if xs else None  # noqa: E731
        clusters = self._clusters()
        units = len(set(clusters)) if clusters is not None else len(self.tf)
        out = {"tf_top1_agreement": mean(self.tf), "first_token_kl": mean(self.kl),
               "greedy_agreement": mean(self.greedy), "steps": len(self.tf),
               "first_token_kl_p50": q(self.kl, 0.5), "first_token_kl_p90": q(self.kl, 0.9),
               "first_token_kl_max": round(max(self.kl), 4) if self.kl else None,
               "first_token_kl_ci95": bootstrap_ci(self.kl, clusters=clusters),
               "tf_top1_p50": q(self.tf, 0.5), "tf_top1_p10": q(self.tf, 0.1),
               "tf_top1_min": round(min(self.tf), 4) if self.tf else None,
               "tf_top1_ci95": bootstrap_ci(self.tf, clusters=clusters),
               **sample_flags(len(self.tf), PERCENTILE_FIELDS),
               # the floor for a fidelity claim: figures on fewer probes are
               # reported, never a claim (a trace with few relocating steps, a small
               # --fidelity-requests)
               "probe_floor": DEFAULT_PROBES, "probe_floor_met": len(self.tf) >= DEFAULT_PROBES,
               "ci_unit": self.ci_unit, "ci_units": units,
               "ci95_undefined": ["first_token_kl_ci95", "tf_top1_ci95"] if units == 1 else []}
        if self.labels:
            out["probes_by"] = dict(sorted(self.labels.items()))
            out["first_token_kl_max_by"] = {k: round(v, 4) for k, v in sorted(self.kl_by.items())}
        if self.records:
            out["probes"] = list(self.records)
        return out


def probe_relocated_request(engine: Any, kv_engine: Any, step: Any, salt: str, fid: Fidelity, ctl: Fidelity,
                            what: str = "request", signals: dict[str, Any] | None = None) -> None:
    """Fidelity of one request's relocated KV (reached through ``salt`` on ``kv_engine``)
    and of the control (exact, half of it from the prefix cache) on ``engine``.  The
    request must have relocated what its plan did and every probe, the control's too,
    must be served its KV (else :class:`FidelityError`).  ``what`` names the request in errors; ``signals``
    (the request's own counts) go into ``fid``'s per-probe records."""
    verify_step(step, what)
    tokens = list(step.prompt.token_ids)
    cont, p_ref = reference(engine, tokens)
    if not cont:
        return
    need = full_blocks(kv_engine, tokens)
    out = kv_engine.generate(tokens, max_tokens=PROBE_TOKENS, cache_salt=salt)
    if out.num_cached_tokens < need:
        raise FidelityError(f"{what}: the greedy probe was served {out.num_cached_tokens} "
                            f"cached tokens of the {need} the relocated KV covers")
    fid.measure(kv_engine, tokens, cont, p_ref, salt, out.token_ids, need_cached=need, signals=signals)
    c_salt = f"control:{uuid.uuid4().hex}"
    half = max(engine.block_size, (len(tokens) // 2) // engine.block_size * engine.block_size)
    engine.generate(tokens[:half], max_tokens=1, cache_salt=c_salt)
    greedy = engine.generate(tokens, max_tokens=PROBE_TOKENS, cache_salt=c_salt)
    # the control is checked as the probe is: a recomputed "half from cache" would be the
    # reference's own computation again, a perfect noise floor that says nothing
    need_c = min(half, full_blocks(engine, tokens))
    if greedy.num_cached_tokens < need_c:
        raise FidelityError(f"{what}: the control was served {greedy.num_cached_tokens} cached tokens "
                            f"of the {need_c} its first half holds")
    ctl.measure(engine, tokens, cont, p_ref, c_salt, greedy.token_ids, need_cached=need_c)

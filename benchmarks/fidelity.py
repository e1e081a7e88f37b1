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
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["PROBE_TOKENS", "FIDELITY_FIELDS", "Fidelity", "kl", "probe", "greedy_agreement", "reference"]

PROBE_TOKENS = 32
FIDELITY_FIELDS = ("tf_top1_agreement", "first_token_kl", "greedy_agreement")


def _pct(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) in nats from two full-vocabulary logprob dicts."""
    floor = min(q.values()) if q else -100.0
    return sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p.items())


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


def probe(engine: Any, tokens: list[int], cont: list[int], salt: str | None) -> tuple[float, dict[int, float]]:
    """Teacher-forced top-1 agreement of ``tokens + cont[:k]`` -> ``cont[k]`` under
    ``salt``, and the first-token distribution there."""
    first = engine.generate(tokens, max_tokens=1, cache_salt=salt, logprobs=-1).logprobs[0]
    hits = int(max(first, key=first.get) == cont[0])
    for k in range(1, len(cont)):
        out = engine.generate(tokens + cont[:k], max_tokens=1, cache_salt=salt)
        hits += int(out.token_ids[0] == cont[k])
    return hits / len(cont), first


class Fidelity:
    """Running means of the three measures over the probed prompts."""

    def __init__(self) -> None:
        self.tf: list[float] = []
        self.kl: list[float] = []
        self.greedy: list[float] = []

    def add(self, tf: float, kl_value: float, greedy: float) -> None:
        self.tf.append(tf)
        self.kl.append(kl_value)
        self.greedy.append(greedy)

    def measure(self, engine: Any, tokens: list[int], cont: list[int], p_ref: dict[int, float],
                salt: str | None, greedy_tokens: Sequence[int]) -> None:
        tf, first = probe(engine, tokens, cont, salt)
        self.add(tf, kl(p_ref, first), greedy_agreement(greedy_tokens, cont))

    def report(self) -> dict[str, Any]:
        mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
        return {"tf_top1_agreement": mean(self.tf), "first_token_kl": mean(self.kl),
                "greedy_agreement": mean(self.greedy), "steps": len(self.tf),
                "first_token_kl_p50": round(_pct(self.kl, 0.5), 4) if self.kl else None,
                "first_token_kl_max": round(max(self.kl), 4) if self.kl else None}

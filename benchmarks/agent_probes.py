"""Which agent steps ``bench agent`` probes for fidelity: edit steps labelled by their
(edit kind, depth) stratum (:func:`probe_ranks`), the relocating ones probed in replay
order while probes are owed (:class:`ProbeTurns`)."""

from __future__ import annotations

from collections.abc import Sequence

from promptsplice.benchmarks.agent_traces import AgentSession, classify_step, edit_depth

__all__ = ["ProbeTurns", "probe_ranks"]


def _depth_bucket(messages_after: int) -> str:
    """Depth of an edit: messages from the first changed one to the end, in powers of 2."""
    for hi, name in ((1, "1"), (3, "2-3"), (7, "4-7")):
        if messages_after <= hi:
            return name
    return "8+"


def _spread(n: int) -> list[int]:
    """0..n-1 in an order that spreads any prefix over the range (bisection order)."""
    out: list[int] = []
    seen: set[int] = set()
    parts = 1
    while len(out) < n:
        for j in range(parts):
            i = min(n - 1, (2 * j + 1) * n // (2 * parts))
            if i not in seen:
                seen.add(i)
                out.append(i)
        parts *= 2
        if parts > 2 * n:
            out += [i for i in range(n) if i not in seen]
    return out


def probe_ranks(sessions: Sequence[AgentSession]) -> dict[tuple[int, int], tuple[int, str]]:
    """The probe order of every edit step, ``(session index, step) -> (rank, stratum)``.

    Strata are (edit kind, depth: messages from the first changed one to the end of the
    render, 1 / 2-3 / 4-7 / 8+); rank ``r`` takes the ``r // strata``-th pick of each
    stratum in turn, each stratum's picks spread over its steps.  The bench probes the
    edit steps it ranks (labelled by stratum) that relocate KV, in replay order, while
    probes are owed (:class:`ProbeTurns`: an online pick cannot follow the ranks and
    still probe ``min(requested, eligible)``)."""
    strata: dict[str, list[tuple[int, int]]] = {}
    for si, sess in enumerate(sessions):
        for i, rnd in enumerate(sess.renders):
            prev = sess.renders[i - 1] if i else None
            kind = classify_step(prev, rnd)
            if kind in ("first", "append"):
                continue
            label = f"{kind}/{_depth_bucket(len(rnd) - edit_depth(prev, rnd))}"
            strata.setdefault(label, []).append((si, i))
    queues = {k: [v[j] for j in _spread(len(v))] for k, v in sorted(strata.items())}
    ranks: dict[tuple[int, int], tuple[int, str]] = {}
    r = 0
    while queues:
        for k in list(queues):
            ranks[queues[k].pop(0)] = (r, k)
            r += 1
            if not queues[k]:
                del queues[k]
    return ranks


class ProbeTurns:
    """Which edit steps a run probes, taken in replay order, labelled by :func:`probe_ranks`.

    A probe must run right after its step (its KV is in the cache then), and whether a
    later step relocates anything is known only once it ran.  So a ranked step that
    relocates KV is probed whenever probes are still owed: skipping one for a
    better-ranked step yet to come (the rank order this once followed, with turns passed
    on and owed) loses the probe whenever the steps after it relocate nothing; 2,417 of
    20,000 random replays probed fewer than ``min(requested, eligible)`` and the bench
    failed its 0.95 probe coverage with enough relocating steps.  Now every run probes
    exactly ``min(requested, eligible)`` steps: the first relocating edit steps of the
    trace, each labelled with its (edit kind, depth) stratum; the ranks order nothing
    any more.  ``passed`` counts the ranked steps met while probes were owed that
    relocated nothing (the report's ``passed_without_relocation``).
    """

    def __init__(self, ranks: dict[tuple[int, int], tuple[int, str]], requested: int) -> None:
        self.ranks = ranks
        self.requested = requested
        self.passed = self.eligible = self.probed = 0
        self.replayed: set[tuple[int, int]] = set()

    @property
    def owed(self) -> int:
        """Probes owed and not made so far (0 after every :meth:`take`)."""
        return max(0, min(self.requested, self.eligible) - self.probed)

    def take(self, key: tuple[int, int], relocates: bool) -> str | None:
        """The probe's label (its stratum) when step ``key`` is to be probed, else None."""
        if key in self.replayed:  # a step is replayed (and counted) once
            return None
        self.replayed.add(key)
        if key not in self.ranks:
            return None
        _, label = self.ranks[key]
        if not relocates:
            self.passed += self.probed < self.requested
            return None
        self.eligible += 1
        if self.probed < self.requested:
            self.probed += 1
            return label
        return None

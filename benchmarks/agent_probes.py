"""Which agent steps ``bench agent`` probes for fidelity: edit steps ranked across
(edit kind, depth) strata (:func:`probe_ranks`), taken in replay order with turns
passed on by steps that relocate nothing (:class:`ProbeTurns`)."""

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
    steps of lowest rank that relocate KV (a step that relocates nothing is not
    approximate and passes its turn to the next rank)."""
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
    """Which edit steps a run probes, taken in replay order from :func:`probe_ranks`.

    Ranks below ``limit`` (at first the number requested) are probed.  A ranked step
    that relocates nothing passes its turn on to the next rank; when that rank's step
    was replayed already, the turn is owed to the next relocating step instead (it was
    lost: 30 probes of 32 requested on a 24-session trace with 182 eligible steps).
    """

    def __init__(self, ranks: dict[tuple[int, int], tuple[int, str]], requested: int) -> None:
        self.ranks = ranks
        self.by_rank = {rank: key for key, (rank, _) in ranks.items()}
        self.limit = requested
        self.passed = self.owed = self.eligible = 0
        self.replayed: set[tuple[int, int]] = set()

    def take(self, key: tuple[int, int], relocates: bool) -> str | None:
        """The probe's label (its stratum) when step ``key`` is to be probed, else None."""
        self.replayed.add(key)
        if key not in self.ranks:
            return None
        rank, label = self.ranks[key]
        self.eligible += relocates
        if rank < self.limit and not relocates:
            self.limit += 1
            self.passed += 1
            if self.by_rank.get(self.limit - 1) in self.replayed:
                self.owed += 1
            return None
        if rank < self.limit:
            return label
        if relocates and self.owed:
            self.owed -= 1
            return label
        return None

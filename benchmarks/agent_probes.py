"""Which agent steps ``bench agent`` probes for fidelity: the edit steps predicted to
relocate (:func:`relocating_edits`), ranked across (edit kind, depth) strata
(:func:`probe_ranks`), taken in rank order as the replay meets them (:class:`ProbeTurns`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from promptsplice.benchmarks.agent_traces import AgentSession, classify_step, edit_depth

__all__ = ["ProbeTurns", "probe_ranks", "relocating_edits"]


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


def relocating_edits(sessions: Sequence[AgentSession], tokenizer: Any, block_size: int,
                     recompute_blocks: int) -> set[tuple[int, int]]:
    """The edit steps predicted to relocate KV, ``(session index, step)``: those whose
    diff (one :class:`~promptsplice.assembler.ContextHook` pass over the renders, no
    engine) moves a run longer than the ``recompute_blocks`` the plan computes after
    the edit.  A prediction: the bench's test is the runner's plan, and a step the
    engine skips (a prompt over its context) starts its session afresh."""
    from promptsplice.assembler import ContextHook

    hook = ContextHook(tokenizer, block_size=block_size)
    out: set[tuple[int, int]] = set()
    for si, sess in enumerate(sessions):
        for i, msgs in enumerate(sess.renders):
            diff = hook(sess.id, msgs, sess.tools or None).diff
            if i and diff is not None and any(e - s > recompute_blocks * block_size for s, e, _ in diff.relocations):
                out.add((si, i))
    return out


def probe_ranks(sessions: Sequence[AgentSession],
                only: Collection[tuple[int, int]] | None = None) -> dict[tuple[int, int], tuple[int, str]]:
    """The probe order of every edit step, ``(session index, step) -> (rank, stratum)``.

    Strata are (edit kind, depth: messages from the first changed one to the end of the
    render, 1 / 2-3 / 4-7 / 8+); rank ``r`` takes the ``r // strata``-th pick of each
    stratum in turn, each stratum's picks spread over its steps (``only``: rank these
    steps alone, the bench's :func:`relocating_edits`).  The bench probes the
    ranked steps that relocate KV in rank order (:class:`ProbeTurns`)."""
    strata: dict[str, list[tuple[int, int]]] = {}
    for si, sess in enumerate(sessions):
        for i, rnd in enumerate(sess.renders):
            prev = sess.renders[i - 1] if i else None
            kind = classify_step(prev, rnd)
            if kind in ("first", "append") or (only is not None and (si, i) not in only):
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


_MARGIN = 2.0
"""Out of turn, a relocating step is probed while the relocating steps expected to come
are fewer than this many times the probes still needed (a margin for the share that
relocates changing over the trace)."""


class ProbeTurns:
    """Which edit steps a run probes, taken in replay order from :func:`probe_ranks`.

    Ranks below ``limit`` (at first the number requested) are probed, so the probes
    spread over strata and sessions.  A ranked step that relocates nothing passes its
    turn to the next rank; when that rank's step was replayed already, the turn is owed
    to the next relocating step.  A relocating step out of its turn is also probed when
    the ranked steps still to come, at the share of the replayed ones that relocated,
are no more than the probes still needed.  A probe must
    run right after its step, and whether a later step relocates is known only once it
    ran: when every ranked step relocates, exactly ``min(requested, ranked)`` are
    probed; when late steps relocate nothing, a turn can still be lost (the bench's
    probe coverage then says so; the greedy alternative, the first relocating steps,
    probed 4 of 24 sessions and 5 of 8 strata on a BFCL trace).  ``passed`` counts the
    ranked steps that relocated nothing in their turn (``passed_without_relocation``).
    ``eligible`` counts every step that relocated, ranked or not: a step the prediction
    (:func:`relocating_edits`) missed is never probed but is owed, so probe coverage
    falls when the prediction misses (until 2026-12-08 only ranked steps counted: a
    prediction that missed every relocating step reported coverage 1.0 with no probe).
    """

    def __init__(self, ranks: dict[tuple[int, int], tuple[int, str]], requested: int) -> None:
        self.ranks = ranks
        self.by_rank = {rank: key for key, (rank, _) in ranks.items()}
        self.requested = requested
        self.limit = requested
        self.passed = self.eligible = self.probed = 0
        self._ranked_eligible = 0  # ranked steps replayed that relocated (the share below)
        self.owed_turns = 0
        self.replayed: set[tuple[int, int]] = set()
        self._left = len(ranks)  # ranked steps not replayed yet

    @property
    def owed(self) -> int:
        """Probes owed (turns passed to steps replayed already) and not made so far."""
        return self.owed_turns

    def take(self, key: tuple[int, int], relocates: bool) -> str | None:
        """The probe's label (its stratum) when step ``key`` is to be probed, else None."""
        if key in self.replayed:  # a step is replayed (and counted) once
            return None
        self.replayed.add(key)
        self.eligible += relocates  # owed a probe, ranked or not
        if key not in self.ranks:
            return None
        self._left -= 1
        rank, label = self.ranks[key]
        self._ranked_eligible += relocates
        if self.probed >= self.requested:
            return None
        if not relocates:
            if rank < self.limit:  # its turn goes to the next rank
                self.limit += 1
                self.passed += 1
                if self.by_rank.get(self.limit - 1) in self.replayed:
                    self.owed_turns += 1
            return None
        if rank < self.limit:
            pass
        elif self.owed_turns:
            self.owed_turns -= 1
        elif self._left * self._ranked_eligible > _MARGIN * (self.requested - self.probed) * (len(self.ranks) - self._left):
            # the ranked steps to come, at the share of them that relocated so far, are
            # more than the probes still needed: leave the probe to its turn
            return None
        self.probed += 1
        return label

    def give_back(self) -> None:
        """A probe :meth:`take` granted was not made (its reference ended at once, EOS):
        the turn is owed to the next relocating step."""
        if self.probed <= 0:
            raise ValueError("give_back: no probe was taken")
        self.probed -= 1
        self.owed_turns += 1

"""How much of a trace a bench really ran, and the bar below which its numbers mean nothing.

Every engine bench (``bench agent``, ``bench rag``) counts the steps it ran against the
steps in the trace.  A bench that skipped work (a prompt over the engine's context, a
request that failed) reports ``coverage`` = run / total and the skipped steps, and fails
(exit status 3) below :data:`MIN_COVERAGE` unless the caller passes ``--allow-skips``:
a result on 2 steps of 159 is not a result.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from promptsplice.errors import PromptspliceError

__all__ = ["MIN_COVERAGE", "COVERAGE_EXIT", "Coverage", "CoverageError", "check_coverage"]

MIN_COVERAGE = 0.95
"""Below this fraction of the trace's steps a bench fails (``--allow-skips`` to accept)."""
COVERAGE_EXIT = 3
"""The CLI's exit status when a bench ran too little of its trace."""


class CoverageError(PromptspliceError, RuntimeError):
    """A bench ran less than :data:`MIN_COVERAGE` of its trace (pass ``--allow-skips``
    to accept a partial run; the report still says how much it covered)."""


class Coverage(NamedTuple):
    steps_run: int
    steps_total: int

    @property
    def ratio(self) -> float:
        return self.steps_run / self.steps_total if self.steps_total else 0.0  # nothing ran: no result

    @property
    def skipped(self) -> int:
        return self.steps_total - self.steps_run

    def report(self) -> dict[str, Any]:
        """The JSON fields every engine bench carries."""
        return {"coverage": round(self.ratio, 4), "steps_run": self.steps_run,
                "steps_total": self.steps_total, "skipped_steps": self.skipped}


def check_coverage(cov: Coverage, *, allow_skips: bool = False, what: str = "bench") -> None:
    """Raise :class:`CoverageError` when ``cov`` is below the bar and skips are not
    allowed, and always when nothing ran (a report of zeros is no partial result)."""
    why = (
        "steps or requests that do not fit the engine's context (max_model_len) are skipped; "
        "the report's skipped_steps / skipped_requests name them"
    )
    if cov.steps_run == 0:
        raise CoverageError(f"{what} ran none of its {cov.steps_total} steps: {why}")
    if cov.ratio < MIN_COVERAGE and not allow_skips:
        raise CoverageError(
            f"{what} ran {cov.steps_run} of {cov.steps_total} steps (coverage {cov.ratio:.3f} < "
            f"{MIN_COVERAGE}): its numbers do not describe the trace; {why}, or pass "
            "--allow-skips to accept a partial run"
        )

import pytest

from promptsplice.benchmarks.coverage import MIN_COVERAGE, Coverage, CoverageError, check_coverage


def test_ratio_and_report():
    cov = Coverage(48, 159)
    assert cov.skipped == 111
    assert cov.report() == {"coverage": 0.3019, "steps_run": 48, "steps_total": 159, "skipped_steps": 111}
    assert Coverage(0, 0).ratio == 0.0  # nothing ran: was 1.0, so a bench on nothing passed
    with pytest.raises(CoverageError, match="ran none of its 0 steps"):
        check_coverage(Coverage(0, 0))
    with pytest.raises(CoverageError, match="ran none of its 1 steps.*skipped_steps"):
        check_coverage(Coverage(0, 1), allow_skips=True)  # nothing ran: no partial result to accept


def test_below_the_bar_fails_unless_allowed():
    with pytest.raises(CoverageError, match="48 of 159 .*--allow-skips"):
        check_coverage(Coverage(48, 159), what="bench agent")
    check_coverage(Coverage(48, 159), allow_skips=True)


def test_at_the_bar_passes():
    check_coverage(Coverage(95, 100))
    assert Coverage(95, 100).ratio == MIN_COVERAGE
    with pytest.raises(CoverageError):
        check_coverage(Coverage(94, 100))

"""The deviation curve's pure helpers (the bench itself runs the real engine:
``python -m promptsplice.benchmarks.deviation_curve``, README's agent section)."""

from __future__ import annotations

import pytest

from promptsplice.benchmarks.deviation_curve import AGGREGATES, aggregate, spearman
from promptsplice.engine_adapters.connector import BlockDeviation


def test_spearman_is_a_rank_correlation():
    xs = [0.01, 0.2, 0.05, 0.4, 0.3]
    assert spearman(xs, [x**3 for x in xs]) == 1.0  # any increasing map: the same ranks
    assert spearman(xs, [-x for x in xs]) == -1.0
    assert spearman(xs[:2], xs[:2]) is None and spearman(xs, [1.0] * 5) is None
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9487, abs=1e-4)  # ties share a rank


def test_aggregates_read_the_block_deviation():
    d = BlockDeviation(64, -32, (0.0, 0.2, 0.4), (0.0, 0.1, 0.9))
    got = {a: aggregate(d, a) for a in AGGREGATES}
    assert got["mean_kv"] == d.value == pytest.approx(1.6 / 6)
    assert got["mean_k"] == pytest.approx(0.2) and got["mean_v"] == pytest.approx(1.0 / 3)
    assert got["max_layer"] == d.max_layer == 0.9 and got["last_layer"] == pytest.approx(0.65)
    with pytest.raises(ValueError, match="aggregate"):
        aggregate(d, "median")

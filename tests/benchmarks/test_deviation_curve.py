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


def _rows(kls, devs, extra=0):
    from promptsplice.benchmarks.deviation_curve import AGGREGATES

    return {"rows": [{"session": "s", "step": i, "kind": "mask", "kl": k, "prefill_tokens": 100 + 32 * extra,
                      "relocated_tokens": 64, "requests": 2, "extra_blocks": extra, "dev": dict.fromkeys(AGGREGATES, d)}
                     for i, (k, d) in enumerate(zip(kls, devs))], "probe_s": 0.1, "wall_s": 10.0, "unverified": 0}


def test_the_chosen_threshold_is_the_cheapest_that_keeps_the_kl_bar():
    from promptsplice.benchmarks.deviation_curve import curve_report

    devs = [0.1, 0.12, 0.2, 0.22]
    # r1 already meets the bar: nothing extended is cheapest, the next 0.05 above its deviations.
    rep = curve_report({"r1": _rows([0.01] * 4, devs), "t=0.15": _rows([0.005] * 4, devs, 1)}, [0.15], 32)
    assert rep["chosen_max_deviation"] == 0.25 and rep["configs"]["t=0.15"]["extra_prefill_blocks"] == 4
    # r1 misses it (p90 0.05), the threshold meets it: the threshold.
    rep = curve_report({"r1": _rows([0.01, 0.01, 0.05, 0.05], devs), "t=0.15": _rows([0.005] * 4, devs, 1)}, [0.15], 32)
    assert rep["chosen_max_deviation"] == 0.15
    assert rep["spearman_r1"]["mean_kv"] > 0.8 and len(rep["pairs_r1"]) == 4
    # Neither: none.
    rep = curve_report({"r1": _rows([0.05] * 4, devs), "t=0.15": _rows([0.05] * 4, devs, 1)}, [0.15], 32)
    assert rep["chosen_max_deviation"] is None

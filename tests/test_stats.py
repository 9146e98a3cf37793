"""Statistics: seed summaries against scipy, the sign-flip test against brute force, its calibration on null
data and its power on a clear effect, Holm against a hand computation, rankings with ties, and partial
correlation against the residual-regression definition and a confounded example."""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from optquant.errors import OptquantError
from optquant.stats import (
    holm,
    min_p,
    paired_test,
    partial_corr,
    rank_with_ties,
    sign_flip_test,
    summarize,
)


def test_summarize_matches_scipy_t_interval():
    x = [3.1, 3.3, 2.9, 3.05]
    s = summarize(x + [math.nan])
    lo, hi = stats.t.interval(0.95, 3, loc=np.mean(x), scale=stats.sem(x))
    assert (s.mean, s.sd, s.n) == pytest.approx((np.mean(x), np.std(x, ddof=1), 4))
    assert (s.lo, s.hi) == pytest.approx((lo, hi))
    one = summarize([2.0])
    assert one.n == 1 and one.mean == 2.0 and math.isnan(one.sd) and math.isnan(one.lo)
    assert summarize([]).n == 0 and summarize([]).text() == "–"
    assert s.text(2).startswith("3.09 ± 0.17 [") and s.text(2).endswith("(n=4)")


def test_exact_sign_flip_equals_brute_force():
    d = np.array([0.3, -0.1, 0.25, 0.4, 0.05])
    obs = abs(d.mean())
    ref = np.mean([abs(np.mean(np.array(s) * d)) >= obs - 1e-12 for s in itertools.product((-1, 1), repeat=5)])
    assert sign_flip_test(d) == pytest.approx(ref)
    assert sign_flip_test([1.0, 2.0, 3.0]) == pytest.approx(0.25) == min_p(3)  # 3 seeds: p ≥ 0.25
    assert sign_flip_test([0.0, 0.0]) == 1.0
    with pytest.raises(OptquantError, match="finite"):
        sign_flip_test([1.0, math.nan])


def test_sign_flip_is_uniform_under_the_null_and_powerful_on_an_effect():
    rng = np.random.default_rng(0)
    p = np.array([sign_flip_test(rng.normal(size=12)) for _ in range(400)])
    assert abs(p.mean() - 0.5) < 0.05  # uniform on [0, 1] has mean 1/2
    for a in (0.05, 0.1, 0.25, 0.5):
        assert abs(np.mean(p <= a) - a) < 0.05, a
    effect = rng.normal(1.5, 1.0, size=12)
    assert sign_flip_test(effect) < 0.01
    mc = sign_flip_test(rng.normal(1.0, 1.0, size=40), n_mc=5000)  # beyond 16 units: Monte-Carlo
    assert mc < 0.01 and mc >= 1 / 5001


def test_paired_test_pairs_by_unit_and_bootstraps_the_mean():
    a = pd.Series([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], index=range(6))
    b = pd.Series([0.5, 1.5, 2.6, 3.4, 4.5, 5.5, 99.0], index=range(7))  # unit 6 has no partner
    t = paired_test(a, b)
    assert t.n == 6 and t.mean_diff == pytest.approx(0.5) and t.p == pytest.approx(2 / 64)
    assert t.lo <= 0.5 <= t.hi and t.min_p == pytest.approx(2 / 64) and t.method == "exact sign-flip"


def test_holm_against_hand_computation():
    assert holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_ranking_with_ties_and_pooling():
    rng = np.random.default_rng(1)
    units = pd.MultiIndex.from_product([("s", "m", "l"), range(3)], names=["size", "seed"])
    base = rng.normal(0, 0.01, len(units))
    vals = {"good": pd.Series(base, units), "bad": pd.Series(base + 0.5, units),
            "twin": pd.Series(base + 0.5 + rng.normal(0, 0.01, len(units)), units)}
    r = rank_with_ties(vals)
    assert r.n_units == 9 and r.rank["good"] == 1
    assert r.rank["bad"] == r.rank["twin"] == 2 and r.label("bad") == "2=" and r.label("good") == "1"
    per_size = rank_with_ties({k: v.xs("l") for k, v in vals.items()})  # 3 seeds: min p 0.25, all tied
    assert set(per_size.rank.values()) == {1} and not per_size.resolved()
    hi = rank_with_ties(vals, lower_is_better=False)
    assert hi.rank["good"] == 3 and hi.rank["bad"] == 1


def test_partial_corr_matches_residual_definition_and_removes_a_confounder():
    rng = np.random.default_rng(2)
    z = rng.normal(size=60)
    x = z + 0.3 * rng.normal(size=60)
    y = -z + 0.3 * rng.normal(size=60)  # x and y only related through z
    assert stats.pearsonr(x, y).statistic < -0.8
    c = partial_corr(x, y, z, n_boot=500)

    def resid(v, w):
        return v - np.polyval(np.polyfit(w, v, 1), w)

    r = stats.pearsonr(resid(x, z), resid(y, z)).statistic
    t = r * math.sqrt(57 / (1 - r * r))
    assert c.r == pytest.approx(r) and c.p == pytest.approx(2 * stats.t.sf(abs(t), 57)) and c.n == 60
    assert c.lo <= c.r <= c.hi and abs(c.r) < 0.3
    w = rng.normal(size=60)
    s = partial_corr(x + 0.5 * w, w, z, "spearman", n_boot=500)
    rx, rw, rz = (stats.rankdata(v) for v in (x + 0.5 * w, w, z))
    assert s.r == pytest.approx(stats.pearsonr(resid(rx, rz), resid(rw, rz)).statistic)
    assert s.r > 0.5 and s.p < 1e-4 and 0 < s.lo < s.hi
    assert math.isnan(partial_corr([1, 2, 3], [1, 2, 4], [0, 1, 1]).r)  # n < 4


def test_six_optimizers_need_ten_units_before_holm_over_all_pairs_can_resolve():
    rng = np.random.default_rng(3)

    def ranking(n_units):
        noise = rng.normal(0, 0.01, n_units)
        return rank_with_ties({f"o{k}": pd.Series(k + noise + rng.normal(0, 0.001, n_units)) for k in range(6)})

    nine = ranking(9)  # 3 sizes × 3 seeds: 2/2^9 = 0.0039 > 0.05/15, so no pair can pass Holm
    assert set(nine.rank.values()) == {1} and not nine.resolved()
    ten = ranking(10)
    assert ten.rank == {f"o{k}": k + 1 for k in range(6)} and ten.resolved()

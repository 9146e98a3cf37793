"""Metric–damage correlations across models.

Strategy: point estimates and p-values against scipy.stats; the vectorised bootstrap against a plain
loop over the same resample indices (exact) and against scipy.stats.bootstrap (statistically);
degenerate inputs (n < 3, constant columns, NaN/inf) give NaN rows without raising.
The Common Loss protocol (study/plan.py cl_stage) is checked on a real smoke study in test_study.py.
"""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from optquant.errors import OptquantError
from optquant.study.correlate import bootstrap_ci, correlate


def _models(n=20, seed=0):
    rng = np.random.default_rng(seed)
    mmr = rng.uniform(5, 50, n)
    r_l = rng.uniform(0.01, 0.2, n)
    d_acc = -40 * r_l + rng.normal(0, 0.5, n)
    d_loss = 3 * r_l + rng.normal(0, 0.02, n)
    size = ["s"] * (n // 2) + ["m"] * (n - n // 2)
    return pd.DataFrame({"mmr": mmr, "R_L": r_l, "d_acc": d_acc, "d_val_loss": d_loss, "size": size})


def test_point_estimates_match_scipy():
    df = _models()
    out = correlate(df, n_boot=200)
    assert len(out) == 2 * 2 * 2  # 2 metrics present × 2 targets × 2 methods
    for _, row in out.iterrows():
        x, y = df[row.metric].to_numpy(), df[row.target].to_numpy()
        ref = stats.pearsonr(x, y) if row.method == "pearson" else stats.spearmanr(x, y)
        assert row.r == pytest.approx(ref.statistic, rel=1e-9)
        assert row.p == pytest.approx(ref.pvalue, rel=1e-6)
        assert row.n == len(df)
    r_l = out[(out.metric == "R_L") & (out.target == "d_acc") & (out.method == "pearson")].iloc[0]
    assert r_l.r < -0.9 and r_l.ci_low <= r_l.r <= r_l.ci_high < 0


@pytest.mark.parametrize("method", ["pearson", "spearman"])
def test_bootstrap_equals_loop_over_same_resamples(method):
    df = _models(n=12, seed=1)
    x, y = df["mmr"].to_numpy(), df["d_acc"].to_numpy()
    lo, hi, degenerate = bootstrap_ci(x, y, method, n_boot=300, level=0.9, seed=7)
    idx = np.random.default_rng(7).integers(0, len(x), size=(300, len(x)))
    fn = stats.pearsonr if method == "pearson" else stats.spearmanr
    rs = np.array([fn(x[i], y[i]).statistic for i in idx])
    assert degenerate == 0
    assert (lo, hi) == pytest.approx(tuple(np.quantile(rs, [0.05, 0.95])), rel=1e-9)


def test_bootstrap_agrees_with_scipy():
    df = _models(n=40, seed=2)
    x, y = df["R_L"].to_numpy(), df["d_acc"].to_numpy()
    lo, hi, _ = bootstrap_ci(x, y, "pearson", n_boot=4000, seed=0)
    ref = stats.bootstrap(
        (x, y),
        lambda a, b: stats.pearsonr(a, b).statistic,
        paired=True,
        vectorized=False,
        n_resamples=4000,
        method="percentile",
        rng=np.random.default_rng(1),
    )
    assert lo == pytest.approx(ref.confidence_interval.low, abs=0.03)
    assert hi == pytest.approx(ref.confidence_interval.high, abs=0.03)


def test_seeded_and_deterministic():
    df = _models()
    a, b = correlate(df, n_boot=300, seed=3), correlate(df, n_boot=300, seed=3)
    pd.testing.assert_frame_equal(a, b)
    c = correlate(df, n_boot=300, seed=4)
    assert not np.allclose(a.ci_low, c.ci_low)


def test_degenerate_inputs_give_nan():
    rows = [{"mmr": 1.0, "kurtosis": 2.0, "d_acc": 0.1}, {"mmr": 2.0, "kurtosis": 2.0, "d_acc": 0.3}]
    out = correlate(rows)  # n = 2 < 3
    assert out.r.isna().all() and out.ci_low.isna().all() and (out.n == 2).all()
    rows += [
        {"mmr": 3.0, "kurtosis": 2.0, "d_acc": 0.2},
        {"mmr": math.nan, "kurtosis": 2.0, "d_acc": 0.9},
        {"mmr": math.inf, "kurtosis": 2.0, "d_acc": 0.9},
    ]
    out = correlate(rows, n_boot=200).set_index(["metric", "method"])
    assert out.loc[("mmr", "pearson"), "n"] == 3  # the NaN and inf rows are dropped pairwise
    assert np.isfinite(out.loc[("mmr", "pearson"), "r"])
    assert out.loc[("kurtosis", "pearson")].isna()[["r", "p", "ci_low", "ci_high"]].all()  # constant


def test_grouping_and_errors():
    df = _models()
    out = correlate(df, ["R_L"], ["d_acc"], by="size", n_boot=100)
    assert sorted(out["size"].unique()) == ["m", "s"] and len(out) == 4
    with pytest.raises(OptquantError, match="not in the data"):
        correlate(df, ["nope"])
    with pytest.raises(OptquantError, match="default metric"):
        correlate(pd.DataFrame({"d_acc": [1.0, 2.0]}))


def test_spearman_sees_monotone_nonlinear():
    x = np.linspace(1, 5, 15)
    out = correlate(pd.DataFrame({"mmr": x, "d_acc": np.exp(3 * x)}), n_boot=100).set_index("method")
    assert out.loc["spearman", "r"] == pytest.approx(1.0)
    assert out.loc["pearson", "r"] < 0.9


# ---- Common Loss ----

def test_partial_methods_control_for_a_column():
    from optquant.stats import partial_corr

    df = _models(n=30, seed=5)
    df["loss"] = df["R_L"] * 2 + np.random.default_rng(0).normal(0, 0.05, len(df))
    out = correlate(df, ["R_L", "mmr"], ["d_val_loss"], control="loss", n_boot=200).set_index(["metric", "method"])
    assert set(out.index.get_level_values("method")) == {"pearson", "spearman", "pearson_partial", "spearman_partial"}
    ref = partial_corr(df["R_L"], df["d_val_loss"], df["loss"], "spearman", n_boot=200)
    assert out.loc[("R_L", "spearman_partial"), "r"] == pytest.approx(ref.r)
    assert out.loc[("R_L", "spearman_partial"), "p"] == pytest.approx(ref.p)
    with pytest.raises(OptquantError, match="control column"):
        correlate(df, control="nope")


def _long(models):
    """results.parquet rows (the study's long layout) for models given as dicts of per-scheme metrics."""
    rows = []
    for m in models:
        base = {k: m[k] for k in ("run_id", "size", "optimizer", "kind")} | {"n_params": 1, "lr": 1e-3, "seed": 0,
                                                                              "best_lr": False}
        for scheme, metrics in m["metrics"].items():
            rows += [base | {"scheme": scheme, "metric": k, "value": float(v)} for k, v in metrics.items()]
    return pd.DataFrame(rows)


def test_study_correlations_within_size_over_sweep_and_cl_models():
    from optquant.study.results import correlations

    rng = np.random.default_rng(0)
    models = []
    for size in ("s", "l"):
        for i in range(8):
            kind = "cl" if i < 2 else "fp"
            loss, r_l = 3 - 0.1 * i + rng.normal(0, 0.01), rng.uniform(0.01, 0.1)
            dmg = 0.5 * r_l + 0.05 * i + rng.normal(0, 0.001)  # damage grows as loss falls
            none = {"mmr": rng.uniform(5, 9), "kurtosis": 3.0 + i, "diverged": float(i == 7)}
            none |= {"val_loss": loss} if kind == "cl" else {"final_val_loss": loss}
            models.append({"run_id": f"{size}{i}", "size": size, "optimizer": "adamw", "kind": kind,
                           "metrics": {"none": none, "w4a4-rtn": {"R_L": r_l, "delta_val_loss": dmg,
                                                                 "val_loss": loss + dmg}}})
    c = correlations(_long(models), n_boot=100).set_index(["size", "metric"])
    assert set(c["scheme"]) == {"w4a4-rtn"} and set(c.index.get_level_values("size")) == {"s", "l", "pooled"}
    assert c.loc[("l", "R_L"), "n"] == 7 and c.loc[("pooled", "R_L"), "n"] == 14  # the diverged run is out
    assert c.loc[("l", "R_L"), "n_cl"] == 2
    assert c.loc[("l", "R_L"), "pearson_partial"] > 0.9 > c.loc[("l", "R_L"), "pearson"]
    # kurtosis tracks only the loss here: strong plain correlation, nothing left once loss is controlled
    assert c.loc[("l", "kurtosis"), "pearson"] > 0.9 and c.loc[("l", "kurtosis"), "pearson_p"] < 0.01
    assert c.loc[("l", "kurtosis"), "pearson_partial_p"] > 0.05
    for col in ("pearson_lo", "pearson_hi", "pearson_p", "pearson_partial_lo", "pearson_partial_p", "spearman_p"):
        assert np.isfinite(c.loc[("l", "R_L"), col]), col

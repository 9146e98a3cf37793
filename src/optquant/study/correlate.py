"""Correlation of each model-level metric with PTQ damage across models (paper.md §6.2, §10.3).

The paper's Fig. 1 reports ρ(MMR) = 0.62, ρ(kurtosis) = 0.70, ρ(R_L) = −0.89 against post-PTQ accuracy
(Pearson per one digest). Here every metric column is correlated with every damage column (Δ val loss,
Δ accuracy), with both Pearson and Spearman, scipy's p-values, and a seeded percentile bootstrap CI
over models (pairs resampled with replacement).

The bootstrap is written out instead of `scipy.stats.bootstrap` because with the handful of models a
study has (six optimizers), many resamples repeat one model and have no defined correlation; scipy
then returns NaN for the whole interval, while here those resamples are dropped (their share is
reported as `boot_degenerate`). With fewer than 3 models or a constant column every number is NaN.

With `control` (e.g. the models' FP validation loss: damage grows as loss falls, so a metric that tracks
loss looks predictive), two more methods are added per pair: `pearson_partial` and `spearman_partial`,
the correlation controlling for that column (`optquant.stats.partial_corr`: residuals of a linear
regression on the control, p from t with n − 3 dof, bootstrap CI).
Left out on purpose: multiple-comparison corrections.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from optquant.errors import OptquantError
from optquant.stats import partial_corr, pearson_rows, percentile_ci

METRICS = ("mmr", "kurtosis", "kurt_rms", "R_L", "sum_A", "sum_B")
TARGETS = ("d_val_loss", "d_acc")
METHODS = ("pearson", "spearman")


def bootstrap_ci(
    x: np.ndarray, y: np.ndarray, method: str, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """(low, high, degenerate share) of the percentile bootstrap of r over resampled (x, y) pairs."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    xb, yb = x[idx], y[idx]
    if method == "spearman":  # Spearman = Pearson of average ranks
        xb, yb = stats.rankdata(xb, axis=1), stats.rankdata(yb, axis=1)
    r = pearson_rows(xb, yb)
    return (*percentile_ci(r, n_boot, level), 1.0 - np.isfinite(r).sum() / n_boot)


def _one(x: np.ndarray, y: np.ndarray, method: str, n_boot: int, level: float, seed: int) -> dict:
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return dict.fromkeys(("r", "p", "ci_low", "ci_high", "boot_degenerate"), math.nan)
    res = stats.pearsonr(x, y) if method == "pearson" else stats.spearmanr(x, y)
    lo, hi, degenerate = bootstrap_ci(x, y, method, n_boot=n_boot, level=level, seed=seed)
    return dict(r=float(res.statistic), p=float(res.pvalue), ci_low=lo, ci_high=hi, boot_degenerate=degenerate)


def _columns(df: pd.DataFrame, asked: Sequence[str] | None, default: Sequence[str], what: str) -> list[str]:
    if asked is not None:
        missing = [c for c in asked if c not in df.columns]
        if missing:
            raise OptquantError(f"correlate: {what} column(s) {missing} not in the data ({list(df.columns)})")
        return list(asked)
    cols = [c for c in default if c in df.columns]
    if not cols:
        raise OptquantError(f"correlate: none of the default {what} columns {list(default)} is in the data")
    return cols


def correlate(
    data: pd.DataFrame | Iterable[Mapping],
    metrics: Sequence[str] | None = None,
    targets: Sequence[str] | None = None,
    *,
    by: str | None = None,
    control: str | None = None,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Tidy table: one row per (group, metric, target, method) with n, r, p, ci_low, ci_high.

    `data` has one row per model. `metrics`/`targets` default to those of METRICS/TARGETS present.
    `by` (e.g. "size") correlates within each group. Rows with a non-finite value in either column are dropped
    pairwise (for the partial methods, also rows with a non-finite `control`).
    """
    df = data if isinstance(data, pd.DataFrame) else pd.DataFrame(list(data))
    metrics = _columns(df, metrics, METRICS, "metric")
    targets = _columns(df, targets, TARGETS, "target")
    if by is not None and by not in df.columns:
        raise OptquantError(f"correlate: group column {by!r} not in the data")
    if control is not None and control not in df.columns:
        raise OptquantError(f"correlate: control column {control!r} not in the data")
    groups = df.groupby(by, sort=True) if by else [(None, df)]
    out = []
    for key, g in groups:
        group = {by: key[0] if isinstance(key, tuple) else key} if by else {}
        for metric in metrics:
            for target in targets:
                pair = g[[metric, target]].apply(pd.to_numeric, errors="coerce").to_numpy(np.float64)
                x, y = pair[np.isfinite(pair).all(axis=1)].T
                for method in METHODS:
                    out.append(group | {"metric": metric, "target": target, "method": method, "n": len(x)}
                               | _one(x, y, method, n_boot, level, seed))
                if control is None:
                    continue
                cols = g[[metric, target, control]].apply(pd.to_numeric, errors="coerce").to_numpy(np.float64)
                for method in METHODS:  # partial_corr drops the rows with a non-finite value itself
                    c = partial_corr(*cols.T, method, n_boot=n_boot, level=level, seed=seed)
                    row = {"metric": metric, "target": target, "method": f"{method}_partial", "n": c.n,
                           "r": c.r, "p": c.p, "ci_low": c.lo, "ci_high": c.hi, "boot_degenerate": math.nan}
                    out.append(group | row)
    return pd.DataFrame(out)

"""Intervals on a fit's parameters: a percentile bootstrap or a leave-one-out jackknife over points
(θ̂ ± z·se).

The bootstrap is clustered: when every size has at least two seeds it resamples seeds within each size
(a seed's points at one size, all optimizers and precisions, move together, so the sizes stay fixed and
the interval measures seed noise; rescaled for the few seeds, see `bootstrap`); with one seed per size
it resamples points within each (optimizer, precision) group. Resamples too small to identify the law
are redrawn; if too few survive the intervals are NaN.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.stats import norm

from optquant.errors import OptquantError
from optquant.scaling.law import FitConfig, ScalingPoint
from optquant.scaling.solver import DesignFn, Fit, check_points, fit_design, starts

log = logging.getLogger(__name__)

BY_SEED = "seeds within each size"  # the bootstrap's resampling with ≥ 2 seeds at every size


def refit(pts: list[ScalingPoint], design: DesignFn, cfg: FitConfig, full: Fit) -> dict[str, float] | None:
    """Refit a subsample from the full fit and one grid start; None if it cannot identify the law
    (or lost a whole group of points, and with it a parameter)."""
    try:
        d = check_points(pts, design)
    except OptquantError:
        return None
    if len(d.names) != len(full.theta) - 3:
        return None
    return fit_design(d, cfg, [full.theta, starts(d)[4]]).params


def bootstrap(pts: list[ScalingPoint], design: DesignFn, cfg: FitConfig, full: Fit) -> dict[str, tuple]:
    """Percentile intervals over clustered resamples (`resampling_strata`). Resampling k seeds within a size
    shrinks the variance by (k − 1)/k (k = 3: the interval would be 18 % too narrow), so with seed
    clusters the endpoints' distances from the estimate are scaled by √(k/(k − 1)), k the fewest
    seeds of any size (the rescaled bootstrap of Rao & Wu 1988, applied to the percentiles)."""
    rng = np.random.default_rng(cfg.seed)
    how, strata = resampling_strata(pts)
    k = min(len(c) for c in strata)
    scale = math.sqrt(k / (k - 1)) if how == BY_SEED else 1.0
    draws: list[dict[str, float]] = []
    for _ in range(5 * cfg.n_boot):  # unidentifiable resamples are redrawn, up to a limit
        if len(draws) == cfg.n_boot:
            break
        idx = np.concatenate(
            [np.concatenate([clusters[k] for k in rng.integers(len(clusters), size=len(clusters))])
             for clusters in strata]
        )
        if (fit := refit([pts[i] for i in idx], design, cfg, full)) is not None:
            draws.append(fit)
    q = ((1 - cfg.level) / 2, (1 + cfg.level) / 2)

    def interval(v: np.ndarray, name: str) -> tuple[float, float]:
        est = full.params[name]
        return tuple(est + scale * (b - est) for b in np.quantile(v, q))  # type: ignore[return-value]

    return _summarize(draws, full, max(3, cfg.n_boot // 2), interval)


def resampling_strata(pts: list[ScalingPoint]) -> tuple[str, list[list[np.ndarray]]]:
    """Strata of clusters of point indices for the bootstrap, and what they are.

    Every size has ≥ 2 seeds: one stratum per size, one cluster per seed (all optimizers and precisions
    of that seed at that size), so seed-to-seed noise is resampled and each size keeps its points.
    Otherwise: one stratum per (optimizer, precision), one cluster per point (sizes are resampled).
    A point without a seed counts as seed k when it is the k-th point of its (optimizer, precision, N)."""
    seen: dict[tuple[str, str, float], int] = {}
    by_size: dict[float, dict[Any, list[int]]] = {}
    for i, p in enumerate(pts):
        cell = (p.optimizer, p.precision, p.n_params)
        seed = p.seed if p.seed is not None else ("ordinal", seen.get(cell, 0))
        seen[cell] = seen.get(cell, 0) + 1
        by_size.setdefault(p.n_params, {}).setdefault(seed, []).append(i)
    if all(len(seeds) >= 2 for seeds in by_size.values()):
        strata = [[np.array(ix) for ix in seeds.values()] for _, seeds in sorted(by_size.items())]
        return BY_SEED, strata
    groups: dict[tuple[str, str], list[np.ndarray]] = {}
    for i, p in enumerate(pts):
        groups.setdefault((p.optimizer, p.precision), []).append(np.array([i]))
    return "points within each (optimizer, precision) group", list(groups.values())


def jackknife(pts: list[ScalingPoint], design: DesignFn, cfg: FitConfig, full: Fit) -> dict[str, tuple]:
    """Leave-one-out jackknife: θ̂ ± z·se, se² = (m−1)/m Σ(θ_i − θ̄)² over the m identifiable refits."""
    draws = [
        f for i in range(len(pts)) if (f := refit(pts[:i] + pts[i + 1 :], design, cfg, full)) is not None
    ]
    z = float(norm.ppf((1 + cfg.level) / 2))

    def interval(v: np.ndarray, name: str) -> tuple[float, float]:
        se = math.sqrt((len(v) - 1) / len(v) * float(((v - v.mean()) ** 2).sum()))
        return full.params[name] - z * se, full.params[name] + z * se

    return _summarize(draws, full, 3, interval)


def _summarize(
    draws: list[dict[str, float]], full: Fit, need: int, interval: Callable[[np.ndarray, str], tuple]
) -> dict[str, tuple]:
    """One (lo, hi) per parameter, or NaN when fewer than `need` refits could identify the law."""
    if len(draws) < need:
        log.warning("only %d refits identify the scaling law; intervals are NaN", len(draws))
        return {n: (math.nan, math.nan) for n in full.params}
    return {n: tuple(float(b) for b in interval(np.array([f[n] for f in draws]), n)) for n in full.params}

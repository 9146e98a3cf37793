"""Statistics for a study's answers: seed aggregation, paired tests, rankings with ties, partial correlation.

Why: a study ranks optimizers by numbers that differ by less than their seed noise can. Every headline number
carries mean ± sd and a 95 % interval across seeds, every ranking a paired test, and every claim says
whether it is resolved (issue 9).

- `summarize`: mean, sample sd (ddof = 1), n, and the 95 % Student-t interval mean ± t_{n−1}·sd/√n
  (NaN sd and interval for n = 1).
- `sign_flip_test`: the exact paired permutation (sign-flip) test of H0 "each per-unit difference is
  symmetric about 0", statistic |mean difference|, two-sided. All 2^n sign patterns are enumerated up to
  n = 16 units; beyond that a seeded Monte-Carlo sample of patterns, p = (1 + #{|T*| ≥ |T|}) / (1 + B).
  Its smallest attainable p is 2 / 2^n (the observed pattern and its mirror): 0.25 with 3 seeds, so a
  single size with 3 seeds can never resolve a difference at α = 0.05; pooling sizes as blocks (units =
  size × seed) is what gives the test power.
- `paired_test`: that test plus a paired percentile-bootstrap CI of the mean difference (units resampled
  with replacement).
- `holm`: Holm's step-down adjustment of a family of p-values.
- `rank_with_ties`: an optimizer's rank = 1 + the number of optimizers significantly better than it at α
  after Holm over all pairs, so optimizers not told apart share a rank.
- `partial_corr`: Pearson or Spearman correlation of x and y controlling for z (the correlation of the
  residuals of x and y after a linear regression on z, on ranks for Spearman), p-value from the t
  distribution with n − 3 degrees of freedom, and a percentile bootstrap CI over resampled rows.

Left out on purpose: parametric paired t-tests (3 seeds say nothing about normality) and corrections across
different tables (each table's family is its own pairs).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from scipy import stats

from optquant.errors import OptquantError

ALPHA = 0.05
EXACT_MAX_UNITS = 16
NOT_RESOLVED = "not resolved at this scale"


@dataclass(frozen=True)
class Summary:
    mean: float
    sd: float
    n: int
    lo: float  # 95 % t-interval of the mean
    hi: float

    def text(self, digits: int = 4, signed: bool = False) -> str:
        """'mean ± sd [lo, hi] (n=k)'; with one value just the value and (n=1)."""
        def f(v: float) -> str:  # a value that rounds to zero prints without a sign ("-0.0000" is noise)
            return f"{0.0 if round(v, digits) == 0 else v:{'+' if signed and round(v, digits) != 0 else ''}.{digits}f}"

        if self.n == 0 or not math.isfinite(self.mean):
            return "–"
        if self.n == 1:
            return f"{f(self.mean)} (n=1)"
        sd = digits if self.sd == 0 or round(self.sd, digits) else -math.floor(math.log10(self.sd))  # never "± 0.00"
        return f"{f(self.mean)} ± {self.sd:.{sd}f} [{f(self.lo)}, {f(self.hi)}] (n={self.n})"


def summarize(values: Sequence[float] | np.ndarray, level: float = 0.95) -> Summary:
    """Mean, sd, n and Student-t interval of the finite values (non-finite ones are dropped)."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    n = len(x)
    if n == 0:
        return Summary(math.nan, math.nan, 0, math.nan, math.nan)
    mean = float(x.mean())
    if n == 1:
        return Summary(mean, math.nan, 1, math.nan, math.nan)
    sd = float(x.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return Summary(mean, sd, n, mean - half, mean + half)


def min_p(n: int) -> float:
    """Smallest two-sided p the exact sign-flip test can give with n units: 2/2^n (1 for n = 0)."""
    return 1.0 if n <= 0 else min(1.0, 2.0 / 2.0**n)


def sign_flip_test(diffs: Sequence[float] | np.ndarray, *, n_mc: int = 20000, seed: int = 0) -> float:
    """Two-sided p of the paired sign-flip permutation test on per-unit differences (see module doc)."""
    d = np.asarray(diffs, dtype=float)
    if d.ndim != 1 or not np.isfinite(d).all():
        raise OptquantError("sign_flip_test: differences must be a 1-D array of finite numbers")
    n = len(d)
    if n == 0:
        return 1.0
    obs = abs(d.mean())
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))
    exact = n <= EXACT_MAX_UNITS
    signs = (1.0 - 2.0 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) if exact  # every ± pattern
             else np.random.default_rng(seed).choice((-1.0, 1.0), size=(n_mc, n)))
    hits = np.sum(np.abs(signs @ d) / n >= obs - tol)
    return float(hits / 2**n if exact else (1 + hits) / (1 + n_mc))


@dataclass(frozen=True)
class PairedTest:
    mean_diff: float  # mean of a − b over the paired units
    p: float  # exact (n ≤ 16) or Monte-Carlo sign-flip p, two-sided
    lo: float  # paired percentile-bootstrap 95 % CI of the mean difference
    hi: float
    n: int  # paired units
    min_p: float  # smallest p attainable with n units

    @property
    def method(self) -> str:
        return "exact sign-flip" if self.n <= EXACT_MAX_UNITS else "Monte-Carlo sign-flip"


def paired_test(a: pd.Series, b: pd.Series, *, seed: int = 0) -> PairedTest:
    """Paired test of a vs b over the units (index labels) both have with finite values."""
    both = pd.concat([a.rename("a"), b.rename("b")], axis=1, join="inner").astype(float)
    both = both[np.isfinite(both.to_numpy()).all(axis=1)]
    d = (both["a"] - both["b"]).to_numpy()
    n = len(d)
    if n == 0:
        return PairedTest(math.nan, 1.0, math.nan, math.nan, 0, 1.0)
    means = d[np.random.default_rng(seed).integers(0, n, size=(4000, n))].mean(axis=1)  # units resampled
    lo, hi = percentile_ci(means, 4000, 0.95) if n > 1 else (math.nan, math.nan)
    return PairedTest(float(d.mean()), sign_flip_test(d, seed=seed), lo, hi, n, min_p(n))


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm step-down adjusted p-values (monotone, capped at 1), in the input order."""
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p, kind="stable")
    adj = np.empty(len(p))
    adj[order] = np.minimum(1.0, np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order]))
    return adj


@dataclass(frozen=True)
class Ranking:
    rank: dict[str, int]  # 1 + number of options significantly better
    pairs: dict[tuple[str, str], tuple[PairedTest, float]]  # (a, b) a < b in input order -> (test, Holm p)
    n_units: int  # the largest number of paired units of any pair
    alpha: float
    lower_is_better: bool = True

    def test(self, a: str, b: str) -> tuple[PairedTest, float] | None:
        """The paired test of a − b (a pair stored as (b, a) turned round) with its Holm p, or None."""
        if (a, b) in self.pairs or (b, a) not in self.pairs:
            return self.pairs.get((a, b))
        t, p_adj = self.pairs[(b, a)]
        return PairedTest(-t.mean_diff, t.p, -t.hi, -t.lo, t.n, t.min_p), p_adj

    def better(self, a: str, b: str) -> bool:
        """Is `a` significantly better than `b` (after Holm)?"""
        if (got := self.test(a, b)) is None:
            return False
        return got[1] < self.alpha and got[0].mean_diff * (1.0 if self.lower_is_better else -1.0) < 0

    def tied(self, o: str) -> bool:
        return sum(r == self.rank[o] for r in self.rank.values()) > 1

    def label(self, o: str) -> str:
        """'2' or '1=' (shared with another option)."""
        return f"{self.rank[o]}{'=' if self.tied(o) else ''}" if o in self.rank else "–"

    def resolved(self) -> bool:
        """Could any pair reach significance at all with this many units and pairs?"""
        m = max(1, len(self.pairs))
        return min_p(self.n_units) < self.alpha / m or any(p < self.alpha for _, p in self.pairs.values())


def rank_with_ties(
    values: Mapping[str, pd.Series], *, lower_is_better: bool = True, alpha: float = ALPHA, seed: int = 0
) -> Ranking:
    """Rank options whose values are Series indexed by unit (e.g. seed, or (size, seed) to pool sizes)."""
    opts = [o for o, s in values.items() if np.isfinite(np.asarray(s, dtype=float)).any()]
    pairs = list(itertools.combinations(opts, 2))
    tests = [paired_test(values[a], values[b], seed=seed) for a, b in pairs]
    adj = holm([t.p for t in tests]) if tests else np.array([])
    r = Ranking({}, {pr: (t, float(p)) for pr, t, p in zip(pairs, tests, adj, strict=True)},
                max((t.n for t in tests), default=0), alpha, lower_is_better)  # fmt: skip
    return replace(r, rank={o: 1 + sum(r.better(x, o) for x in opts if x != o) for o in opts})


# ---------------------------------------------------------------- partial correlation
@dataclass(frozen=True)
class Corr:
    r: float
    p: float
    lo: float
    hi: float
    n: int


def pearson_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair of x, y (observations along the last axis); NaN where a row is constant."""
    xc = x - x.mean(axis=-1, keepdims=True)
    yc = y - y.mean(axis=-1, keepdims=True)
    den = np.sqrt((xc * xc).sum(axis=-1) * (yc * yc).sum(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (xc * yc).sum(axis=-1) / den
    return np.where(den > 1e-300, np.clip(r, -1.0, 1.0), np.nan)


def _partial_rows(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Partial r of each row from the three pairwise r's; equals the residual correlation for one z."""
    rxy, rxz, ryz = pearson_rows(x, y), pearson_rows(x, z), pearson_rows(y, z)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (rxy - rxz * ryz) / np.sqrt((1 - rxz**2) * (1 - ryz**2))
    return np.clip(r, -1.0, 1.0)


def _residual(v: np.ndarray, z: np.ndarray) -> np.ndarray:
    design = np.column_stack([np.ones_like(z), z])
    coef, *_ = np.linalg.lstsq(design, v, rcond=None)
    return v - design @ coef


def partial_corr(
    x: Sequence[float], y: Sequence[float], z: Sequence[float], method: str = "pearson", *,
    n_boot: int = 2000, level: float = 0.95, seed: int = 0,
) -> Corr:  # fmt: skip
    """Correlation of x and y controlling for z (module doc); NaN with fewer than 4 complete rows."""
    if method not in ("pearson", "spearman"):
        raise OptquantError(f"partial_corr: method must be pearson or spearman, not {method!r}")
    xyz = np.column_stack([np.asarray(v, dtype=float) for v in (x, y, z)])
    raw = xyz = xyz[np.isfinite(xyz).all(axis=1)]  # raw: unranked, for the bootstrap
    n = len(xyz)
    nan = Corr(math.nan, math.nan, math.nan, math.nan, n)
    if n < 4 or (np.ptp(xyz, axis=0) == 0).any():
        return nan
    if method == "spearman":
        xyz = stats.rankdata(xyz, axis=0)
    x_, y_, z_ = xyz.T
    r = float(pearson_rows(_residual(x_, z_), _residual(y_, z_)))
    if not math.isfinite(r):
        return nan
    dof = n - 3
    t = r * math.sqrt(dof / max(1e-300, 1 - r * r))
    p = float(2 * stats.t.sf(abs(t), dof))
    rng = np.random.default_rng(seed)
    res = raw[rng.integers(0, n, size=(n_boot, n))]  # (B, n, 3)
    if method == "spearman":
        res = stats.rankdata(res, axis=1)
    lo, hi = percentile_ci(_partial_rows(res[..., 0], res[..., 1], res[..., 2]), n_boot, level)
    return Corr(r, p, lo, hi, n)


def percentile_ci(samples: np.ndarray, n_boot: int, level: float) -> tuple[float, float]:
    """The percentile interval of the defined (finite) bootstrap samples; NaN with fewer than
    max(10, n_boot / 10) of them, too few for a meaningful interval."""
    ok = samples[np.isfinite(samples)]
    if ok.size < max(10, n_boot // 10):
        return math.nan, math.nan
    lo, hi = np.quantile(ok, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def verdict(supported: bool, contradicted: bool) -> str:
    """The three-way answer of a claim (never a bare yes/no)."""
    return "contradicted" if contradicted else ("supported" if supported else NOT_RESOLVED)

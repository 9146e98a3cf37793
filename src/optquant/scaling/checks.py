"""How far a fit's numbers can be trusted (`FitDiagnostics`, in every fit and in fits.json).

Per-point log residuals and their RMS; the parameter correlation matrix from the Gauss–Newton covariance
(JᵀJ)⁻¹ of the log residuals at the optimum, in the fit's own coordinates (log A at the geometric-mean
N, α, log E, log ρ), with the condition number of the column-scaled J; the parameters at a bound; each
interval's width; the number and span of distinct sizes. A fit is "not identified" (with the reason,
per parameter or "fit" for the whole fit) when it has fewer than `FitConfig.min_sizes` distinct N or an
N span below `min_span`× (α and E are then not separable), when a parameter sits at its bound (A, α or
E: the whole fit), when a ρ has no finite interval (or none were computed), or when a ρ interval is
wider than the spread of that ρ across optimizers (`judge`: per-optimizer fits against each other, a
joint fit within itself): per-optimizer fits let each ρ trade off against its own E.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TypeVar

import numpy as np

from optquant.scaling.law import FitConfig, FitDiagnostics, JointFit, LawFit, ScalingPoint
from optquant.scaling.solver import Design, Fit, terms

_SHARED = ("A", "alpha", "E")  # a bound or a failed check on these affects every ρ of the fit


def diagnose(
    pts: list[ScalingPoint], d: Design, fit: Fit, intervals: dict[str, tuple], resampling: str
) -> FitDiagnostics:
    """Residuals, Gauss–Newton correlations and interval widths at the optimum (no verdict yet)."""
    x0 = float(d.x.mean())
    s, lse, p = terms(np.r_[fit.theta[0] - fit.theta[1] * x0, fit.theta[1:]], d, x0)  # log A at N0, as fitted
    res = lse - d.y
    # ∂(log L̂)/∂θ in the fit's coordinates, the same derivatives as `objective`'s gradient
    J = np.column_stack([p, -p * s, 1 - p, -fit.theta[1] * p[:, None] * d.M])
    scale = np.linalg.norm(J, axis=0)
    Js = J / np.where(scale > 0, scale, 1.0)
    sv = np.linalg.svd(Js, compute_uv=False)
    condition = float(sv[0] / sv[-1]) if sv[-1] > 0 else math.inf
    cov = np.linalg.pinv(Js.T @ Js)
    sd = np.sqrt(np.clip(np.diag(cov), 0, None))
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = np.clip(cov / np.outer(sd, sd), -1, 1)
    off = np.abs(corr[~np.eye(len(corr), dtype=bool)])
    names = ("A", "alpha", "E") + d.names
    residuals = tuple(
        {"optimizer": q.optimizer, "precision": q.precision, "n_params": q.n_params, "seed": q.seed,
         "loss": q.loss, "predicted": float(math.exp(lse[i])), "residual": float(res[i])}
        for i, q in enumerate(pts)
    )
    sizes = np.exp(np.unique(d.x))
    return FitDiagnostics(
        names=names,
        residuals=residuals,
        residual_rms=float(np.sqrt(np.mean(res**2))),
        correlation=tuple(tuple(float(c) for c in row) for row in corr),
        max_abs_correlation=float(np.nanmax(off)) if off.size and np.isfinite(off).any() else math.nan,
        condition=condition,
        interval_width={n: float(intervals[n][1] - intervals[n][0]) if n in intervals else math.nan
                        for n in names},
        n_sizes=len({q.n_params for q in pts}),
        size_span=float(sizes.max() / sizes.min()),
        resampling=resampling,
        reasons={},
    )


_F = TypeVar("_F", LawFit, JointFit)


def judge(per_optimizer: dict[str, LawFit], cfg: FitConfig = FitConfig()) -> dict[str, LawFit]:
    """Set each per-optimizer fit's verdict, comparing its ρ intervals with the spread of the ρ point
    estimates across all the fits given (a ρ known to ±0.1 cannot rank optimizers 0.05 apart). The
    size, bound and missing-interval checks are redone too, so judging twice changes nothing. A joint
    fit is judged within itself by `fit_joint`, against `spreads(fit.rho.values(), fit.rho_fp.values())`."""
    ranges = spreads([f.rho for f in per_optimizer.values()])
    return {o: judged(f, ranges, cfg) for o, f in per_optimizer.items()}


def spreads(rhos: Iterable[dict[str, float]], rho_fp: Iterable[float] = ()) -> dict[str, float]:
    """Spread (max − min) of each ρ_<precision> across the optimizers' `rhos`, and of ρ_fp when given."""
    values: dict[str, list[float]] = {"rho_fp": list(rho_fp)}
    for r in rhos:
        for k, v in r.items():
            values.setdefault(f"rho_{k}", []).append(v)
    return {k: max(v) - min(v) for k, v in values.items() if len(v) > 1}


def judged(fit: _F, spreads: dict[str, float], cfg: FitConfig) -> _F:
    diag = fit.diagnostics
    if diag is None:
        return fit
    params = {"A": fit.A, "alpha": fit.alpha, "E": fit.E}
    reasons: dict[str, list[str]] = {}
    if diag.n_sizes < cfg.min_sizes:
        reasons.setdefault("fit", []).append(f"{diag.n_sizes} distinct sizes (< {cfg.min_sizes})")
    if diag.size_span < cfg.min_span:
        reasons.setdefault("fit", []).append(f"sizes span {diag.size_span:.3g}× (< {cfg.min_span:g}×)")
    for name in fit.at_bound:
        reasons.setdefault("fit" if name in _SHARED else name, []).append(
            f"{name} at its bound" + (f" ({params[name]:.3g})" if name in params else ""))
    if fit.method == "none":
        reasons.setdefault("fit", []).append("no intervals computed (interval=none)")
    for name in diag.names:
        if not name.startswith("rho_") or fit.method == "none":
            continue
        width = diag.interval_width.get(name, math.nan)
        spread = spreads.get(name.split("/")[0])
        if not math.isfinite(width):
            reasons.setdefault(name, []).append(f"no {name} interval (too few identifiable refits)")
        elif spread is not None and width > spread:
            reasons.setdefault(name, []).append(
                f"{name} interval width {width:.3g} > spread {spread:.3g} across optimizers")
    reasons_s = {k: "; ".join(v) for k, v in reasons.items()}
    return dataclasses.replace(fit, diagnostics=dataclasses.replace(diag, reasons=reasons_s))

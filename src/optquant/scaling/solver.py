"""The fit itself (the paper gives none; Hoffmann et al. 2022 style): Huber loss (δ = 1e-3) on
log L̂ − log L, L-BFGS-B from a grid of starts, best objective kept.

Parameters are log A, α, log E and log ρ, with N centred at its geometric mean so log A and α are not
collinear; bounds keep α ∈ [1e-3, 3] and ρ ∈ [1e-3, ρ_max]. ρ_4bit is capped at 1 by default (the paper
notes' suggested constraint 0 < ρ ≤ 1; `FitConfig.rho_max=None` lifts it to 1e3); ρ_fp is never capped,
since another optimizer can be more efficient than the reference. Fits that end on a bound name the
parameter in `at_bound`. A design maps the points to the columns of ρ each point's N is scaled by.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import minimize

from optquant.errors import OptquantError
from optquant.scaling.law import FitConfig, ScalingPoint

_ALPHA_BOUNDS = (1e-3, 3.0)
_LOG_RHO_MIN, _LOG_RHO_MAX = math.log(1e-3), math.log(1e3)
_LBFGS = {"maxiter": 3000, "ftol": 1e-15, "gtol": 1e-10}


@dataclass(frozen=True)
class Design:
    """log N, log L, and which log-efficiencies (columns of M) each point's N is scaled by."""

    x: np.ndarray  # (n,)
    y: np.ndarray  # (n,)
    M: np.ndarray  # (n, k) in {0, 1}
    names: tuple[str, ...]  # (k,)
    capped: np.ndarray  # (k,) bool: bounded above by rho_max


DesignFn = Callable[[list[ScalingPoint]], Design]


def law_design(pts: list[ScalingPoint]) -> Design:
    keys = sorted({p.precision for p in pts} - {"fp"})
    M = np.array([[float(p.precision == k) for k in keys] for p in pts]).reshape(len(pts), len(keys))
    return _make_design(pts, M, tuple(f"rho_{k}" for k in keys), [True] * len(keys))


def joint_design(ref: str) -> DesignFn:
    def design(pts: list[ScalingPoint]) -> Design:
        opts = sorted({p.optimizer for p in pts} - {ref})
        cols = [(o, "fp") for o in opts] + sorted(
            {(p.optimizer, p.precision) for p in pts} - {(o, "fp") for o in opts + [ref]}
        )
        M = np.array(
            [[float(p.optimizer == o and (k == "fp" or p.precision == k)) for o, k in cols] for p in pts]
        )
        names = tuple(f"rho_{k}/{o}" for o, k in cols)
        return _make_design(pts, M.reshape(len(pts), len(cols)), names, [k != "fp" for _, k in cols])

    return design


def _make_design(
    pts: list[ScalingPoint], M: np.ndarray, names: tuple[str, ...], capped: list[bool]
) -> Design:
    logs = np.log([[p.n_params, p.loss] for p in pts]).reshape(len(pts), 2)
    return Design(logs[:, 0], logs[:, 1], M, names, np.array(capped, dtype=bool))


def check_points(pts: list[ScalingPoint], design: DesignFn) -> Design:
    """The design of `pts`; OptquantError unless the points can identify every parameter."""
    if not pts:
        raise OptquantError("a scaling-law fit needs points, got none")
    for p in pts:
        if not (np.isfinite(p.n_params) and p.n_params > 0 and np.isfinite(p.loss) and p.loss > 0):
            raise OptquantError(f"scaling point needs finite n_params > 0 and loss > 0, got {p}")
    d = design(pts)
    for opt in sorted({p.optimizer for p in pts}):
        if not any(p.optimizer == opt and not p.quantized for p in pts):
            raise OptquantError(f"optimizer {opt!r} has no full-precision points; ρ needs an FP reference")
    n_distinct = len({(p.optimizer, p.precision, p.n_params) for p in pts})
    n_free = 3 + len(d.names)
    if n_distinct < n_free:
        raise OptquantError(
            f"a scaling law with {n_free} free parameters needs at least {n_free} distinct "
            f"(optimizer, precision, size) points, got {n_distinct}"
        )
    return d


def terms(theta: np.ndarray, d: Design, x0: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per point, with θ = (log A at N0, α, log E, log ρ_1..k): s = log(Nρ/N0), log L̂ and the share p of the
    reducible term A/(Nρ)^α in L̂."""
    s = d.x - x0 + d.M @ theta[3:]
    u = theta[0] - theta[1] * s  # log of the reducible term
    lse = np.logaddexp(u, theta[2])
    return s, lse, np.exp(u - lse)


def objective(theta: np.ndarray, d: Design, x0: float, delta: float) -> tuple[float, np.ndarray]:
    """c·Σ Huber_δ(log L̂ − log L) and its gradient; θ = (log A at N0, α, log E, log ρ_1..k)."""
    s, lse, p = terms(theta, d, x0)
    res = lse - d.y
    huber = np.where(np.abs(res) <= delta, 0.5 * res**2, delta * (np.abs(res) - 0.5 * delta))
    g = np.clip(res, -delta, delta)
    # Scaling keeps gradients O(1) per point for residuals ≳ 1e-3 whatever δ (least squares too), so
    # L-BFGS-B's absolute tolerances bind where they should.
    c = 1 / min(delta, 1e-3)
    grad = np.concatenate(([g @ p, -(g * p) @ s, g @ (1 - p)], -theta[1] * ((g * p) @ d.M)))
    return float(huber.sum() * c), grad * c


def starts(d: Design) -> list[np.ndarray]:
    """Grid over α and E (a fraction of the smallest loss), with A putting L̂ at the median loss at the
    mean log N and ρ_4bit = 0.8; log A in raw N units, like `Fit.theta`."""
    L_min, L_mid, x0 = math.exp(d.y.min()), math.exp(np.median(d.y)), float(d.x.mean())
    r = np.where(d.capped, math.log(0.8), 0.0)
    grid = [(alpha, frac * L_min) for alpha in (0.1, 0.3, 0.6, 1.0) for frac in (0.1, 0.5, 0.9)]
    return [np.r_[math.log(max(L_mid - E, 1e-3)) + alpha * x0, alpha, math.log(E), r] for alpha, E in grid]


@dataclass(frozen=True)
class Fit:
    theta: np.ndarray  # (log A with N in parameters, α, log E, log ρ…)
    params: dict[str, float]
    objective: float  # Σ Huber
    at_bound: tuple[str, ...]


def fit_design(d: Design, cfg: FitConfig, starts: list[np.ndarray]) -> Fit:
    """Best L-BFGS-B optimum over the starts (given with log A in raw N units)."""
    x0 = float(d.x.mean())  # centring N at its geometric mean decorrelates log A and α
    hi_q = math.log(cfg.rho_max) if cfg.rho_max is not None else _LOG_RHO_MAX
    lo = np.array([-np.inf, _ALPHA_BOUNDS[0], math.log(1e-6)] + [_LOG_RHO_MIN] * len(d.names))
    hi = np.array([np.inf, _ALPHA_BOUNDS[1], float(d.y.max())] + [hi_q if c else _LOG_RHO_MAX for c in d.capped])
    bounds = list(zip(lo, hi, strict=True))
    best: Any = None
    for th in starts:
        th = np.clip(th - np.r_[th[1] * x0, np.zeros(len(th) - 1)], lo, hi)
        r = minimize(objective, th, (d, x0, cfg.delta), "L-BFGS-B", jac=True, bounds=bounds, options=_LBFGS)
        if np.isfinite(r.fun) and (best is None or r.fun < best.fun):
            best = r
    if best is None:
        raise OptquantError("the scaling-law fit diverged from every start; check the losses")
    names = ("A", "alpha", "E") + d.names
    at_bound = tuple(n for n, v, a, b in zip(names, best.x, lo, hi, strict=True) if min(v - a, b - v) < 1e-6)
    theta = best.x + np.r_[best.x[1] * x0, np.zeros(len(best.x) - 1)]
    params = {"A": math.exp(theta[0]), "alpha": float(theta[1]), "E": math.exp(theta[2])}
    params.update({n: math.exp(v) for n, v in zip(d.names, theta[3:], strict=True)})
    return Fit(theta, params, float(best.fun * min(cfg.delta, 1e-3)), at_bound)


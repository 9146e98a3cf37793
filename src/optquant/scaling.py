"""Scaling-law fits L(N) = A/(N·ρ)^α + E, per optimizer and jointly, with uncertainty.

Why: the paper (arXiv 2509.23500, Table 10; reference/paper.md §9) compares optimizers under 4-bit QAT
by a parameter efficiency ρ_4bit: an N-parameter QAT model is worth a ρ_4bit·N-parameter FP model.
All runs use D = 20·N, so the iso-ratio form has one size variable.

- `fit_law`: one optimizer. A, α, E are shared by its FP (ρ = 1) and QAT points; one free ρ per QAT
  bit width ("4bit", …), as in the paper.
- `fit_joint`: all optimizers at once with α and E shared. A per-optimizer A_o is the same model as a
  shared A times ρ_fp,o^(−α), so the joint fit reports a shared A, an FP efficiency ρ_fp,o relative to
  a reference optimizer (AdamW by default, ρ_fp = 1) and ρ_4bit,o relative to that optimizer's own FP
  (QAT points use N·ρ_fp,o·ρ_4bit,o). Sharing α and E stops each optimizer's ρ from trading off
  against its own E with only a handful of points (Table 10's E spread, 1.39–2.22, hints at that).

Fitting (the paper gives none; Hoffmann et al. 2022 style): Huber loss (δ = 1e-3) on log L̂ − log L,
L-BFGS-B from a grid of starts, best objective kept. Parameters are log A, α, log E and log ρ, with
N centred at its geometric mean so log A and α are not collinear; bounds keep α ∈ [1e-3, 3] and
ρ ∈ [1e-3, ρ_max]. ρ_4bit is capped at 1 by default (the paper notes' suggested constraint 0 < ρ ≤ 1;
`FitConfig.rho_max=None` lifts it to 1e3); ρ_fp is never capped, since another optimizer can be more
efficient than the reference. Fits that end on a bound name the parameter in `at_bound`.
Intervals: a percentile bootstrap over points, resampled within each (optimizer, precision)
group, or a leave-one-out jackknife (θ̂ ± z·se). Resamples too small to identify the law are
redrawn; if too few survive the intervals are NaN.

Left out on purpose: the two-variable form B/D^β (D is tied to N here), and fitting bits as a
continuous variable (Kumar et al. 2024); each bit width gets its own ρ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import numpy as np
from scipy.optimize import minimize
from scipy.stats import norm

from optquant.errors import OptquantError

log = logging.getLogger(__name__)

_ALPHA_BOUNDS = (1e-3, 3.0)
_LOG_RHO_MIN, _LOG_RHO_MAX = math.log(1e-3), math.log(1e3)
_LBFGS = {"maxiter": 3000, "ftol": 1e-15, "gtol": 1e-10}


@dataclass(frozen=True)
class ScalingPoint:
    """One finished run: final validation loss of a model with `n_params` parameters."""

    optimizer: str
    n_params: float
    loss: float
    quantized: bool = False  # QAT from scratch at `bits`, else full precision
    bits: int = 4

    @property
    def precision(self) -> str:
        return f"{self.bits}bit" if self.quantized else "fp"


@dataclass(frozen=True)
class FitConfig:
    delta: float = 1e-3  # Huber threshold on log-loss residuals; a huge value gives least squares
    rho_max: float | None = 1.0  # cap on ρ_4bit (None: up to 1e3)
    interval: Literal["bootstrap", "loo", "none"] = "bootstrap"
    n_boot: int = 200
    level: float = 0.95
    seed: int = 0
    reference: str = "adamw"  # joint fit: optimizer with ρ_fp = 1 (first by name if absent)

    def __post_init__(self) -> None:
        if not (self.delta > 0 and 0 < self.level < 1 and self.n_boot >= 1):
            raise OptquantError(f"FitConfig needs delta > 0, 0 < level < 1, n_boot >= 1; got {self}")
        if self.rho_max is not None and not 1e-3 < self.rho_max <= 1e3:
            raise OptquantError(f"FitConfig.rho_max must be in (1e-3, 1e3] or None, got {self.rho_max}")


class _Serializable:
    """JSON round trip for the fit dataclasses (fits.json); NaN bounds are stored as null."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)  # type: ignore[call-overload]
        d["intervals"] = {k: [None if math.isnan(b) else b for b in v] for k, v in d["intervals"].items()}
        return d | {"at_bound": list(d["at_bound"]), "kind": type(self).__name__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        iv = {k: tuple(math.nan if b is None else float(b) for b in v) for k, v in d["intervals"].items()}
        fields = {k: v for k, v in d.items() if k != "kind"}
        return cls(**fields | {"intervals": iv, "at_bound": tuple(d["at_bound"])})


@dataclass(frozen=True)
class LawFit(_Serializable):
    """Per-optimizer fit. `rho` maps precision ("4bit") to ρ; `intervals` maps "A", "alpha", "E",
    "rho_4bit" to (lo, hi); `objective` is Σ Huber at the optimum."""

    optimizer: str
    A: float
    alpha: float
    E: float
    rho: dict[str, float]
    n_points: int
    objective: float
    intervals: dict[str, tuple[float, float]]
    at_bound: tuple[str, ...]
    method: str


@dataclass(frozen=True)
class JointFit(_Serializable):
    """Shared A, α, E; `rho_fp[opt]` relative to `reference`; `rho[opt]["4bit"]` relative to that
    optimizer's FP. Interval names: "A", "alpha", "E", "rho_fp/<opt>", "rho_4bit/<opt>"."""

    A: float
    alpha: float
    E: float
    reference: str
    rho_fp: dict[str, float]
    rho: dict[str, dict[str, float]]
    n_points: int
    objective: float
    intervals: dict[str, tuple[float, float]]
    at_bound: tuple[str, ...]
    method: str


def predict(
    fit: LawFit | JointFit,
    n_params: float | np.ndarray,
    quantized: bool = False,
    *,
    bits: int = 4,
    optimizer: str | None = None,
) -> np.ndarray:
    """L̂ = A/(N·ρ)^α + E for FP (ρ = 1, or ρ_fp in a joint fit) or QAT at `bits`."""
    key = f"{bits}bit"
    if isinstance(fit, JointFit):
        if optimizer not in fit.rho_fp:
            raise OptquantError(f"joint fit has no optimizer {optimizer!r}; known: {sorted(fit.rho_fp)}")
        rho, rho_q = fit.rho_fp[optimizer], fit.rho[optimizer]
    else:
        rho, rho_q = 1.0, fit.rho
    if quantized:
        if key not in rho_q:
            raise OptquantError(f"fit has no ρ for {key} QAT; known: {sorted(rho_q)}")
        rho *= rho_q[key]
    return fit.A / (np.asarray(n_params, dtype=float) * rho) ** fit.alpha + fit.E


def fit_law(points: Sequence[ScalingPoint], cfg: FitConfig = FitConfig()) -> LawFit:
    """Fit one optimizer's FP and QAT points (paper §9): shared A, α, E, one ρ per QAT bit width."""
    pts = list(points)
    if len({p.optimizer for p in pts}) > 1:
        raise OptquantError(f"fit_law takes one optimizer's points, got {sorted({p.optimizer for p in pts})}")
    params, common = _fit_with_intervals(pts, _law_design, cfg)
    rho = {k[4:]: v for k, v in params.items() if k.startswith("rho_")}
    return LawFit(pts[0].optimizer, params["A"], params["alpha"], params["E"], rho, **common)


def fit_laws(points: Sequence[ScalingPoint], cfg: FitConfig = FitConfig()) -> dict[str, LawFit]:
    """`fit_law` for each optimizer in `points`."""
    opts = sorted({p.optimizer for p in points})
    return {o: fit_law([p for p in points if p.optimizer == o], cfg) for o in opts}


def fit_joint(points: Sequence[ScalingPoint], cfg: FitConfig = FitConfig()) -> JointFit:
    """Fit all optimizers with shared A, α, E; per-optimizer ρ_fp (vs. the reference) and ρ_4bit."""
    pts = list(points)
    opts = sorted({p.optimizer for p in pts})
    ref = cfg.reference if cfg.reference in opts or not opts else opts[0]
    if ref != cfg.reference:
        log.info("reference optimizer %r not among %s; using %r", cfg.reference, opts, ref)
    params, common = _fit_with_intervals(pts, _joint_design(ref), cfg)
    rho: dict[str, dict[str, float]] = {o: {} for o in opts}
    for name, v in params.items():
        if name.startswith("rho_") and not name.startswith("rho_fp/"):
            key, opt = name[4:].split("/", 1)
            rho[opt][key] = v
    rho_fp = {o: params.get(f"rho_fp/{o}", 1.0) for o in opts}
    return JointFit(params["A"], params["alpha"], params["E"], ref, rho_fp, rho, **common)


# ---------------------------------------------------------------- designs
@dataclass(frozen=True)
class _Design:
    """log N, log L, and which log-efficiencies (columns of M) each point's N is scaled by."""

    x: np.ndarray  # (n,)
    y: np.ndarray  # (n,)
    M: np.ndarray  # (n, k) in {0, 1}
    names: tuple[str, ...]  # (k,)
    capped: np.ndarray  # (k,) bool: bounded above by rho_max


Design = Callable[[list[ScalingPoint]], _Design]


def _law_design(pts: list[ScalingPoint]) -> _Design:
    keys = sorted({p.precision for p in pts} - {"fp"})
    M = np.array([[float(p.precision == k) for k in keys] for p in pts]).reshape(len(pts), len(keys))
    return _make_design(pts, M, tuple(f"rho_{k}" for k in keys), [True] * len(keys))


def _joint_design(ref: str) -> Design:
    def design(pts: list[ScalingPoint]) -> _Design:
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
) -> _Design:
    logs = np.log([[p.n_params, p.loss] for p in pts]).reshape(len(pts), 2)
    return _Design(logs[:, 0], logs[:, 1], M, names, np.array(capped, dtype=bool))


def _checked(pts: list[ScalingPoint], design: Design) -> _Design:
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


# ---------------------------------------------------------------- fitting
def _objective(theta: np.ndarray, d: _Design, x0: float, delta: float) -> tuple[float, np.ndarray]:
    """c·Σ Huber_δ(log L̂ − log L) and its gradient; θ = (log A at N0, α, log E, log ρ_1..k)."""
    a0, alpha, e, r = theta[0], theta[1], theta[2], theta[3:]
    s = d.x - x0 + d.M @ r  # log(Nρ/N0)
    u = a0 - alpha * s  # log of the reducible term
    lse = np.logaddexp(u, e)
    p = np.exp(u - lse)  # share of the reducible term in L̂
    res = lse - d.y
    huber = np.where(np.abs(res) <= delta, 0.5 * res**2, delta * (np.abs(res) - 0.5 * delta))
    g = np.clip(res, -delta, delta)
    # Scaling keeps gradients O(1) per point for residuals ≳ 1e-3 whatever δ (least squares too), so
    # L-BFGS-B's absolute tolerances bind where they should.
    c = 1 / min(delta, 1e-3)
    grad = np.concatenate(([g @ p, -(g * p) @ s, g @ (1 - p)], -alpha * ((g * p) @ d.M)))
    return float(huber.sum() * c), grad * c


def _bounds(d: _Design, cfg: FitConfig) -> tuple[np.ndarray, np.ndarray]:
    hi_q = math.log(cfg.rho_max) if cfg.rho_max is not None else _LOG_RHO_MAX
    lo = [-np.inf, _ALPHA_BOUNDS[0], math.log(1e-6)] + [_LOG_RHO_MIN] * len(d.names)
    hi = [np.inf, _ALPHA_BOUNDS[1], float(d.y.max())] + [hi_q if c else _LOG_RHO_MAX for c in d.capped]
    return np.array(lo), np.array(hi)


def _starts(d: _Design) -> list[np.ndarray]:
    """Grid over α and E (a fraction of the smallest loss), with A putting L̂ at the median loss at the
    mean log N and ρ_4bit = 0.8; log A in raw N units, like `_Fit.theta`."""
    L_min, L_mid, x0 = math.exp(d.y.min()), math.exp(np.median(d.y)), float(d.x.mean())
    r = np.where(d.capped, math.log(0.8), 0.0)
    grid = [(alpha, frac * L_min) for alpha in (0.1, 0.3, 0.6, 1.0) for frac in (0.1, 0.5, 0.9)]
    return [np.r_[math.log(max(L_mid - E, 1e-3)) + alpha * x0, alpha, math.log(E), r] for alpha, E in grid]


@dataclass(frozen=True)
class _Fit:
    theta: np.ndarray  # (log A with N in parameters, α, log E, log ρ…)
    params: dict[str, float]
    objective: float  # Σ Huber
    at_bound: tuple[str, ...]


def _fit_design(d: _Design, cfg: FitConfig, starts: list[np.ndarray]) -> _Fit:
    """Best L-BFGS-B optimum over the starts (given with log A in raw N units)."""
    x0 = float(d.x.mean())  # centring N at its geometric mean decorrelates log A and α
    lo, hi = _bounds(d, cfg)
    bounds = list(zip(lo, hi, strict=True))
    best: Any = None
    for th in starts:
        th = np.clip(th - np.r_[th[1] * x0, np.zeros(len(th) - 1)], lo, hi)
        r = minimize(_objective, th, (d, x0, cfg.delta), "L-BFGS-B", jac=True, bounds=bounds, options=_LBFGS)
        if np.isfinite(r.fun) and (best is None or r.fun < best.fun):
            best = r
    if best is None:
        raise OptquantError("the scaling-law fit diverged from every start; check the losses")
    names = ("A", "alpha", "E") + d.names
    at_bound = tuple(n for n, v, a, b in zip(names, best.x, lo, hi, strict=True) if min(v - a, b - v) < 1e-6)
    theta = best.x + np.r_[best.x[1] * x0, np.zeros(len(best.x) - 1)]
    params = {"A": math.exp(theta[0]), "alpha": float(theta[1]), "E": math.exp(theta[2])}
    params.update({n: math.exp(v) for n, v in zip(d.names, theta[3:], strict=True)})
    return _Fit(theta, params, float(best.fun * min(cfg.delta, 1e-3)), at_bound)


def _one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """L-BFGS-B calls BLAS on tiny matrices; threaded OpenBLAS makes that up to 50× slower on a busy
    machine (measured on 2 cores). threadpoolctl pins it to one thread when installed."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


# ---------------------------------------------------------------- uncertainty
def _fit_with_intervals(
    pts: list[ScalingPoint], design: Design, cfg: FitConfig
) -> tuple[dict[str, float], dict]:
    """Named parameters, and the fields every fit result shares."""
    d = _checked(pts, design)
    with _one_blas_thread():
        fit = _fit_design(d, cfg, _starts(d))
        if cfg.interval == "bootstrap":
            intervals = _bootstrap(pts, design, cfg, fit)
        elif cfg.interval == "loo":
            intervals = _jackknife(pts, design, cfg, fit)
        else:
            intervals = {}
    if fit.at_bound:
        log.warning("scaling fit ended on the bound of %s", ", ".join(fit.at_bound))
    common = dict(n_points=len(pts), objective=fit.objective, intervals=intervals, at_bound=fit.at_bound)
    return fit.params, common | dict(method=cfg.interval)


def _refit(pts: list[ScalingPoint], design: Design, cfg: FitConfig, full: _Fit) -> dict[str, float] | None:
    """Refit a subsample from the full fit and one grid start; None if it cannot identify the law
    (or lost a whole group of points, and with it a parameter)."""
    try:
        d = _checked(pts, design)
    except OptquantError:
        return None
    if len(d.names) != len(full.theta) - 3:
        return None
    return _fit_design(d, cfg, [full.theta, _starts(d)[4]]).params


def _bootstrap(pts: list[ScalingPoint], design: Design, cfg: FitConfig, full: _Fit) -> dict[str, tuple]:
    """Percentile intervals over resamples drawn within each (optimizer, precision) group."""
    rng = np.random.default_rng(cfg.seed)
    strata: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(pts):
        strata.setdefault((p.optimizer, p.precision), []).append(i)
    draws: list[dict[str, float]] = []
    for _ in range(5 * cfg.n_boot):  # unidentifiable resamples are redrawn, up to a limit
        if len(draws) == cfg.n_boot:
            break
        idx = np.concatenate([rng.choice(ix, size=len(ix)) for ix in strata.values()])
        if (fit := _refit([pts[i] for i in idx], design, cfg, full)) is not None:
            draws.append(fit)
    q = ((1 - cfg.level) / 2, (1 + cfg.level) / 2)
    return _summarize(draws, full, max(3, cfg.n_boot // 2), lambda v, _: tuple(np.quantile(v, q)))


def _jackknife(pts: list[ScalingPoint], design: Design, cfg: FitConfig, full: _Fit) -> dict[str, tuple]:
    """Leave-one-out jackknife: θ̂ ± z·se, se² = (m−1)/m Σ(θ_i − θ̄)² over the m identifiable refits."""
    draws = [
        f for i in range(len(pts)) if (f := _refit(pts[:i] + pts[i + 1 :], design, cfg, full)) is not None
    ]
    z = float(norm.ppf((1 + cfg.level) / 2))

    def interval(v: np.ndarray, name: str) -> tuple[float, float]:
        se = math.sqrt((len(v) - 1) / len(v) * float(((v - v.mean()) ** 2).sum()))
        return full.params[name] - z * se, full.params[name] + z * se

    return _summarize(draws, full, 3, interval)


def _summarize(
    draws: list[dict[str, float]], full: _Fit, need: int, interval: Callable[[np.ndarray, str], tuple]
) -> dict[str, tuple]:
    """One (lo, hi) per parameter, or NaN when fewer than `need` refits could identify the law."""
    if len(draws) < need:
        log.warning("only %d refits identify the scaling law; intervals are NaN", len(draws))
        return {n: (math.nan, math.nan) for n in full.params}
    return {n: tuple(float(b) for b in interval(np.array([f[n] for f in draws]), n)) for n in full.params}

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
Points may repeat a size (one point per seed; each seed is its own point, never pre-averaged).
Intervals: a percentile bootstrap or a leave-one-out jackknife over points (θ̂ ± z·se). The bootstrap
is clustered: when every size has at least two seeds it resamples seeds within each size (a seed's
points at one size, all optimizers and precisions, move together, so the sizes stay fixed and the
interval measures seed noise; rescaled for the few seeds, see `_bootstrap`); with one seed per size it
resamples points within each (optimizer, precision) group. Resamples too small to identify the law
are redrawn; if too few survive the intervals are NaN.

Diagnostics (`FitDiagnostics`, in every fit and in fits.json): per-point log residuals and their RMS;
the parameter correlation matrix from the Gauss–Newton covariance (JᵀJ)⁻¹ of the log residuals at the
optimum, in the fit's own coordinates (log A at the geometric-mean N, α, log E, log ρ), with the
condition number of the column-scaled J; the parameters at a bound; each interval's width; the number
and span of distinct sizes. A fit is "not identified" (with the reason, per parameter or "fit" for
the whole fit) when it has fewer than `FitConfig.min_sizes` distinct N or an N span below
`min_span`× (α and E are then not separable), when a parameter sits at its bound (A, α or E: the whole
fit), when a ρ has no finite interval (or none were computed), or when a ρ interval is wider than the
spread of that ρ across optimizers (`judge`: per-optimizer fits against each other, a joint fit within
itself). The joint fit with shared α and E is the headline ρ, as the authors later recommended:
per-optimizer fits let each ρ trade off against its own E.

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
from typing import Any, Literal, Self, TypeVar

import numpy as np
from scipy.optimize import minimize
from scipy.stats import norm

from optquant.errors import OptquantError

log = logging.getLogger(__name__)

_ALPHA_BOUNDS = (1e-3, 3.0)
_LOG_RHO_MIN, _LOG_RHO_MAX = math.log(1e-3), math.log(1e3)
_LBFGS = {"maxiter": 3000, "ftol": 1e-15, "gtol": 1e-10}
_BY_SEED = "seeds within each size"  # the bootstrap's resampling with ≥ 2 seeds at every size
_SHARED = ("A", "alpha", "E")  # a bound or a failed check on these affects every ρ of the fit


@dataclass(frozen=True)
class ScalingPoint:
    """One finished run: final validation loss of a model with `n_params` parameters."""

    optimizer: str
    n_params: float
    loss: float
    quantized: bool = False  # QAT from scratch at `bits`, else full precision
    bits: int = 4
    seed: int | None = None  # training seed; points of one seed at one size are resampled together

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
    min_sizes: int = 4  # fewer distinct N: "not identified"
    min_span: float = 8.0  # max N / min N below this: "not identified"

    def __post_init__(self) -> None:
        if not (self.delta > 0 and 0 < self.level < 1 and self.n_boot >= 1):
            raise OptquantError(f"FitConfig needs delta > 0, 0 < level < 1, n_boot >= 1; got {self}")
        if not (self.min_sizes >= 1 and self.min_span >= 1):
            raise OptquantError(f"FitConfig needs min_sizes >= 1 and min_span >= 1; got {self}")
        if self.rho_max is not None and not 1e-3 < self.rho_max <= 1e3:
            raise OptquantError(f"FitConfig.rho_max must be in (1e-3, 1e3] or None, got {self.rho_max}")


def _jsonable(v: Any) -> Any:
    """Tuples as lists, non-finite floats as null: what json.dumps(allow_nan=False) accepts."""
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _float(v: Any) -> float:
    return math.nan if v is None else float(v)


@dataclass(frozen=True)
class FitDiagnostics:
    """How far a fit's numbers can be trusted. `reasons` maps a parameter name (or "fit", for the
    whole fit) to why it is not identified; empty means identified."""

    names: tuple[str, ...]  # parameters, in the order of `correlation`
    residuals: tuple[dict[str, Any], ...]  # per point: optimizer, precision, n_params, seed, loss, predicted, residual
    residual_rms: float  # RMS of log L̂ − log L (a relative error)
    correlation: tuple[tuple[float, ...], ...]  # Gauss–Newton, fit coordinates (log A at N0, α, log E, log ρ)
    max_abs_correlation: float  # largest off-diagonal |correlation|
    condition: float  # condition number of the column-scaled Jacobian
    interval_width: dict[str, float]  # hi − lo per parameter (NaN: no interval)
    n_sizes: int  # distinct N
    size_span: float  # max N / min N
    resampling: str  # what the bootstrap resampled ("" for other interval methods)
    reasons: dict[str, str]

    @property
    def identified(self) -> bool:
        return not self.reasons

    def why_not(self, name: str) -> str:
        """Why parameter `name` is not identified ("" if it is): its own reasons and the fit's."""
        return "; ".join(self.reasons[k] for k in ("fit", name) if k in self.reasons)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self)) | {"identified": self.identified}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return cls(
            names=tuple(d["names"]),
            residuals=tuple({k: _float(v) if k in ("predicted", "residual") else v for k, v in r.items()}
                            for r in d["residuals"]),
            residual_rms=_float(d["residual_rms"]),
            correlation=tuple(tuple(_float(c) for c in row) for row in d["correlation"]),
            max_abs_correlation=_float(d["max_abs_correlation"]),
            condition=_float(d["condition"]),
            interval_width={k: _float(v) for k, v in d["interval_width"].items()},
            n_sizes=int(d["n_sizes"]),
            size_span=_float(d["size_span"]),
            resampling=d["resampling"],
            reasons=dict(d["reasons"]),
        )


class _Serializable:
    """JSON round trip for the fit dataclasses (fits.json); NaN bounds are stored as null."""

    def to_dict(self) -> dict[str, Any]:
        diag = self.diagnostics  # type: ignore[attr-defined]
        d = _jsonable({f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                       if f.name != "diagnostics"})
        return d | {"diagnostics": None if diag is None else diag.to_dict(), "kind": type(self).__name__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        iv = {k: tuple(math.nan if b is None else float(b) for b in v) for k, v in d["intervals"].items()}
        fields = {k: v for k, v in d.items() if k != "kind"}
        diag = d.get("diagnostics")
        diag = None if diag is None else FitDiagnostics.from_dict(diag)
        return cls(**fields | {"intervals": iv, "at_bound": tuple(d["at_bound"]), "diagnostics": diag})

    @property
    def identified(self) -> bool:
        """True when the diagnostics found no reason to distrust the fit (False without diagnostics)."""
        diag = self.diagnostics  # type: ignore[attr-defined]
        return diag is not None and diag.identified


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
    diagnostics: FitDiagnostics | None = None


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
    diagnostics: FitDiagnostics | None = None


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
    fit = LawFit(pts[0].optimizer, params["A"], params["alpha"], params["E"], rho, **common)
    return _judged(fit, {}, cfg)  # alone: no spread across optimizers to compare with (see `judge`)


def fit_laws(points: Sequence[ScalingPoint], cfg: FitConfig = FitConfig()) -> dict[str, LawFit]:
    """`fit_law` for each optimizer in `points`, judged against each other (`judge`)."""
    opts = sorted({p.optimizer for p in points})
    return judge({o: fit_law([p for p in points if p.optimizer == o], cfg) for o in opts}, cfg)


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
    fit = JointFit(params["A"], params["alpha"], params["E"], ref, rho_fp, rho, **common)
    return _judged(fit, _spreads(fit), cfg)


# ---------------------------------------------------------------- identification
_F = TypeVar("_F", LawFit, JointFit)


def judge(per_optimizer: dict[str, LawFit], cfg: FitConfig = FitConfig()) -> dict[str, LawFit]:
    """Set each per-optimizer fit's verdict, comparing its ρ intervals with the spread of the ρ point
    estimates across all the fits given (a ρ known to ±0.1 cannot rank optimizers 0.05 apart). The
    size, bound and missing-interval checks are redone too, so judging twice changes nothing. A joint
    fit is judged within itself by `fit_joint`."""
    values: dict[str, list[float]] = {}
    for f in per_optimizer.values():
        for k, v in f.rho.items():
            values.setdefault(f"rho_{k}", []).append(v)
    spreads = {k: max(v) - min(v) for k, v in values.items() if len(v) > 1}
    return {o: _judged(f, spreads, cfg) for o, f in per_optimizer.items()}


def _spreads(fit: JointFit) -> dict[str, float]:
    """Spread of ρ_fp (the reference's 1 included) and of each ρ_<bits> across the joint fit's optimizers."""
    values: dict[str, list[float]] = {"rho_fp": list(fit.rho_fp.values())}
    for r in fit.rho.values():
        for k, v in r.items():
            values.setdefault(f"rho_{k}", []).append(v)
    return {k: max(v) - min(v) for k, v in values.items() if len(v) > 1}


def _judged(fit: _F, spreads: dict[str, float], cfg: FitConfig) -> _F:
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
    resampling = _clusters(pts)[0] if cfg.interval == "bootstrap" else ""
    common = dict(n_points=len(pts), objective=fit.objective, intervals=intervals, at_bound=fit.at_bound)
    return fit.params, common | dict(method=cfg.interval, diagnostics=_diagnose(pts, d, fit, intervals, resampling))


def _diagnose(
    pts: list[ScalingPoint], d: _Design, fit: _Fit, intervals: dict[str, tuple], resampling: str
) -> FitDiagnostics:
    """Residuals, Gauss–Newton correlations and interval widths at the optimum (no verdict yet)."""
    x0 = float(d.x.mean())
    a0, alpha, e, r = fit.theta[0] - fit.theta[1] * x0, fit.theta[1], fit.theta[2], fit.theta[3:]
    s = d.x - x0 + d.M @ r
    u = a0 - alpha * s
    lse = np.logaddexp(u, e)
    p = np.exp(u - lse)
    res = lse - d.y
    # ∂(log L̂)/∂θ in the fit's coordinates, the same derivatives as `_objective`'s gradient
    J = np.column_stack([p, -p * s, 1 - p, -alpha * p[:, None] * d.M])
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
    """Percentile intervals over clustered resamples (`_clusters`). Resampling k seeds within a size
    shrinks the variance by (k − 1)/k (k = 3: the interval would be 18 % too narrow), so with seed
    clusters the endpoints' distances from the estimate are scaled by √(k/(k − 1)), k the fewest
    seeds of any size (the rescaled bootstrap of Rao & Wu 1988, applied to the percentiles)."""
    rng = np.random.default_rng(cfg.seed)
    how, strata = _clusters(pts)
    k = min(len(c) for c in strata)
    scale = math.sqrt(k / (k - 1)) if how == _BY_SEED else 1.0
    draws: list[dict[str, float]] = []
    for _ in range(5 * cfg.n_boot):  # unidentifiable resamples are redrawn, up to a limit
        if len(draws) == cfg.n_boot:
            break
        idx = np.concatenate(
            [np.concatenate([clusters[k] for k in rng.integers(len(clusters), size=len(clusters))])
             for clusters in strata]
        )
        if (fit := _refit([pts[i] for i in idx], design, cfg, full)) is not None:
            draws.append(fit)
    q = ((1 - cfg.level) / 2, (1 + cfg.level) / 2)

    def interval(v: np.ndarray, name: str) -> tuple[float, float]:
        est = full.params[name]
        return tuple(est + scale * (b - est) for b in np.quantile(v, q))  # type: ignore[return-value]

    return _summarize(draws, full, max(3, cfg.n_boot // 2), interval)


def _clusters(pts: list[ScalingPoint]) -> tuple[str, list[list[np.ndarray]]]:
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
        return _BY_SEED, strata
    groups: dict[tuple[str, str], list[np.ndarray]] = {}
    for i, p in enumerate(pts):
        groups.setdefault((p.optimizer, p.precision), []).append(np.array([i]))
    return "points within each (optimizer, precision) group", list(groups.values())


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

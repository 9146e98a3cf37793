"""The scaling law's data: points, the fit's settings and results (JSON round trip for fits.json), and
`predict`, L̂ = A/(N·ρ)^α + E.

Points may repeat a size (one point per seed; each seed is its own point, never pre-averaged).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Self

import numpy as np

from optquant.errors import OptquantError
from optquant.files import finite_json


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
        return finite_json(dataclasses.asdict(self)) | {"identified": self.identified}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        floats = {k: _float(d[k]) for k in ("residual_rms", "max_abs_correlation", "condition", "size_span")}
        return cls(
            names=tuple(d["names"]),
            residuals=tuple({k: _float(v) if k in ("predicted", "residual") else v for k, v in r.items()}
                            for r in d["residuals"]),
            correlation=tuple(tuple(_float(c) for c in row) for row in d["correlation"]),
            interval_width={k: _float(v) for k, v in d["interval_width"].items()},
            n_sizes=int(d["n_sizes"]),
            resampling=d["resampling"],
            reasons=dict(d["reasons"]),
            **floats,
        )


class _Serializable:
    """JSON round trip for the fit dataclasses (fits.json); NaN bounds are stored as null."""

    def to_dict(self) -> dict[str, Any]:
        diag = self.diagnostics  # type: ignore[attr-defined]
        d = finite_json({f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
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

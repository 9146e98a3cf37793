"""The entry points: `fit_law` (one optimizer), `fit_laws` (each optimizer, judged against each other)
and `fit_joint` (all optimizers, shared α and E); see the package docstring for the two models."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from threadpoolctl import threadpool_limits

from optquant.errors import OptquantError
from optquant.scaling.checks import diagnose, judge, judged, spreads
from optquant.scaling.intervals import bootstrap, jackknife, resampling_strata
from optquant.scaling.law import FitConfig, JointFit, LawFit, ScalingPoint
from optquant.scaling.solver import DesignFn, check_points, fit_design, joint_design, law_design, starts

log = logging.getLogger(__name__)


def fit_law(points: Sequence[ScalingPoint], cfg: FitConfig = FitConfig()) -> LawFit:
    """Fit one optimizer's FP and QAT points (paper §9): shared A, α, E, one ρ per QAT bit width."""
    pts = list(points)
    if len({p.optimizer for p in pts}) > 1:
        raise OptquantError(f"fit_law takes one optimizer's points, got {sorted({p.optimizer for p in pts})}")
    params, common = _fit_with_intervals(pts, law_design, cfg)
    rho = {k[4:]: v for k, v in params.items() if k.startswith("rho_")}
    fit = LawFit(pts[0].optimizer, params["A"], params["alpha"], params["E"], rho, **common)
    return judged(fit, {}, cfg)  # alone: no spread across optimizers to compare with (see `judge`)


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
    params, common = _fit_with_intervals(pts, joint_design(ref), cfg)
    rho: dict[str, dict[str, float]] = {o: {} for o in opts}
    for name, v in params.items():
        if name.startswith("rho_") and not name.startswith("rho_fp/"):
            key, opt = name[4:].split("/", 1)
            rho[opt][key] = v
    rho_fp = {o: params.get(f"rho_fp/{o}", 1.0) for o in opts}
    fit = JointFit(params["A"], params["alpha"], params["E"], ref, rho_fp, rho, **common)
    return judged(fit, spreads(fit.rho.values(), fit.rho_fp.values()), cfg)


def _fit_with_intervals(
    pts: list[ScalingPoint], design: DesignFn, cfg: FitConfig
) -> tuple[dict[str, float], dict]:
    """Named parameters, and the fields every fit result shares."""
    d = check_points(pts, design)
    with threadpool_limits(1, user_api="blas"):  # L-BFGS-B's tiny BLAS calls crawl threaded (docs/benchmarks.md)
        fit = fit_design(d, cfg, starts(d))
        resample = {"bootstrap": bootstrap, "loo": jackknife}.get(cfg.interval)  # "none": no intervals
        intervals = resample(pts, design, cfg, fit) if resample else {}
    if fit.at_bound:
        log.warning("scaling fit ended on the bound of %s", ", ".join(fit.at_bound))
    resampling = resampling_strata(pts)[0] if cfg.interval == "bootstrap" else ""
    common = dict(n_points=len(pts), objective=fit.objective, intervals=intervals, at_bound=fit.at_bound)
    return fit.params, common | dict(method=cfg.interval, diagnostics=diagnose(pts, d, fit, intervals, resampling))

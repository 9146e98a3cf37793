"""Tests for optquant.scaling (law, fit, solver, intervals, diagnostics).

Strategy: losses generated from a known law L = A/(N·ρ)^α + E (A = 400, α = 0.3, E = 1.8, ρ_4bit = 0.85,
six sizes from 1e6 to 1e9, FP and QAT) must give the parameters back: exactly without noise, within
5 % with 0.2 % log-normal noise. The joint fit gets three optimizers with different ρ_fp and ρ_4bit.
Intervals must cover the truth; one corrupted point must not move the Huber fit while it moves
least squares; unidentifiable inputs raise OptquantError. Bootstraps use few resamples to stay fast.
Diagnostics: three sizes within 2.3× are "not identified" (with the reason); six sizes over three decades
are identified and recover the law; ρ intervals wider than the spread between optimizers, and parameters
at a bound, make a fit "not identified"; the correlation matrix matches one from a finite-difference
Jacobian of `predict`; repeated sizes (seeds) fit and bootstrap by resampling seeds within each size.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.optimize import check_grad

from optquant.errors import OptquantError
from optquant.scaling import FitConfig, JointFit, LawFit, ScalingPoint, fit_joint, fit_law, fit_laws, judge, predict
from optquant.scaling.intervals import resampling_strata
from optquant.scaling.solver import joint_design, objective

TRUE = dict(A=400.0, alpha=0.3, E=1.8)
SIZES = np.geomspace(1e6, 1e9, 6)
NO_CI = FitConfig(interval="none")


def law_points(opt="adamw", rho=0.85, rho_fp=1.0, noise=0.0, seed=0, bits=(4,), rhos=None, sizes=SIZES,
               seeds=None, E=TRUE["E"]):
    """FP and QAT points from the true law; log-normal noise of relative size `noise`; with `seeds` (a
    count) one point per seed and size, each with its own noise."""
    rng = np.random.default_rng(seed)
    groups = [(False, 4, 1.0)] + [(True, b, r) for b, r in zip(bits, rhos or [rho], strict=True)]
    pts = []
    for quantized, b, r in groups:
        for N in sizes:
            L = TRUE["A"] / (N * rho_fp * r) ** TRUE["alpha"] + E
            for k in range(seeds or 1):
                loss = float(L * math.exp(noise * rng.standard_normal()))
                pts.append(ScalingPoint(opt, float(N), loss, quantized, b, None if seeds is None else k))
    return pts


def assert_close(got: float, want: float, rel: float, name: str = "") -> None:
    assert abs(got - want) <= rel * abs(want), f"{name}: got {got}, want {want} (rel {rel})"


def test_fit_law_recovers_noiseless_parameters():
    fit = fit_law(law_points(), NO_CI)
    for k, v in TRUE.items():
        assert_close(getattr(fit, k), v, 1e-4, k)
    assert_close(fit.rho["4bit"], 0.85, 1e-4, "rho")
    assert fit.at_bound == () and fit.n_points == 12 and fit.objective < 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_law_recovers_parameters_under_noise_within_5_percent(seed):
    fit = fit_law(law_points(noise=0.002, seed=seed), NO_CI)
    for k, v in TRUE.items():
        assert_close(getattr(fit, k), v, 0.05, k)
    assert_close(fit.rho["4bit"], 0.85, 0.05, "rho")


def test_fit_law_gives_one_rho_per_bit_width():
    fit = fit_law(law_points(bits=(4, 8), rhos=[0.7, 0.95]), NO_CI)
    assert_close(fit.rho["4bit"], 0.7, 1e-4, "rho_4bit")
    assert_close(fit.rho["8bit"], 0.95, 1e-4, "rho_8bit")
    assert_close(float(predict(fit, 1e8, True, bits=8)), 400 / (0.95e8) ** 0.3 + 1.8, 1e-6)


def joint_points(noise=0.0):
    spec = {"adamw": (1.0, 0.85), "muon": (1.3, 0.75), "shampoo": (0.8, 0.9)}
    return [
        p for i, (o, (rf, r)) in enumerate(spec.items()) for p in law_points(o, r, rf, noise, seed=i)
    ], spec


@pytest.mark.parametrize("noise", [0.0, 0.002])
def test_fit_joint_recovers_shared_law_and_per_optimizer_rho(noise):
    pts, spec = joint_points(noise)
    fit = fit_joint(pts, NO_CI)
    rel = 1e-4 if noise == 0 else 0.05
    assert fit.reference == "adamw" and fit.rho_fp["adamw"] == 1.0
    for k, v in TRUE.items():
        assert_close(getattr(fit, k), v, rel, k)
    for o, (rf, r) in spec.items():
        assert_close(fit.rho_fp[o], rf, rel, f"rho_fp/{o}")
        assert_close(fit.rho[o]["4bit"], r, rel, f"rho_4bit/{o}")
    want = 400 / (1e8 * 1.3 * 0.75) ** 0.3 + 1.8
    assert_close(float(predict(fit, 1e8, True, optimizer="muon")), want, rel)


def test_bootstrap_intervals_cover_truth():
    fit = fit_law(law_points(noise=0.002, seed=3), FitConfig(n_boot=20, seed=0))
    truth = TRUE | {"rho_4bit": 0.85}
    assert set(fit.intervals) == set(truth) and fit.method == "bootstrap"
    for k, v in truth.items():
        lo, hi = fit.intervals[k]
        assert lo < v < hi, f"{k}: {v} not in ({lo}, {hi})"
        assert hi - lo < 0.2 * v, f"{k}: interval ({lo}, {hi}) is uninformative"


def test_bootstrap_is_seeded():
    pts = law_points(noise=0.002, seed=4)
    a, b = (fit_law(pts, FitConfig(n_boot=5, seed=7)) for _ in range(2))
    assert a.intervals == b.intervals


def test_jackknife_intervals_cover_truth():
    fit = fit_law(law_points(noise=0.002, seed=5), FitConfig(interval="loo"))
    for k, v in (TRUE | {"rho_4bit": 0.85}).items():
        lo, hi = fit.intervals[k]
        assert lo < v < hi, f"{k}: {v} not in ({lo}, {hi})"


def rel_errors(fit: LawFit) -> np.ndarray:
    truth = TRUE | {"rho": 0.85}
    got = [fit.A, fit.alpha, fit.E, fit.rho["4bit"]]
    return np.abs(np.array(got) / np.array(list(truth.values())) - 1)


@pytest.mark.parametrize("index", [2, 8, 11])  # an FP, a mid QAT and the largest QAT point
def test_huber_ignores_one_outlier_that_moves_least_squares(index):
    pts = law_points(noise=0.001, seed=1)
    p = pts[index]
    pts[index] = ScalingPoint("adamw", p.n_params, p.loss * 1.05, p.quantized)  # one loss 5 % too high
    huber = rel_errors(fit_law(pts, NO_CI))
    lsq = rel_errors(fit_law(pts, FitConfig(interval="none", delta=1e9)))  # δ → ∞: least squares
    assert huber.max() < 0.02, huber
    assert lsq.max() > 0.1 and lsq.max() > 5 * huber.max(), (lsq, huber)


def test_rho_cap_is_reported_and_can_be_lifted():
    pts = law_points(rho=1.2)
    capped = fit_law(pts, NO_CI)
    assert capped.rho["4bit"] == pytest.approx(1.0) and "rho_4bit" in capped.at_bound
    free = fit_law(pts, FitConfig(interval="none", rho_max=None))
    assert_close(free.rho["4bit"], 1.2, 1e-4) and free.at_bound == ()


def test_degenerate_inputs_raise_clear_errors():
    pts = law_points()
    with pytest.raises(OptquantError, match="at least 4 distinct"):
        fit_law(pts[:2] + pts[6:7], NO_CI)  # 2 FP sizes + 1 QAT point for 4 parameters
    with pytest.raises(OptquantError, match="at least 4 distinct"):
        fit_law(pts[:2] * 3 + pts[6:7] * 2, NO_CI)  # repeats add no information
    with pytest.raises(OptquantError, match="no full-precision"):
        fit_law(pts[6:], NO_CI)
    with pytest.raises(OptquantError, match="needs points"):
        fit_law([], NO_CI)
    with pytest.raises(OptquantError, match="loss > 0"):
        fit_law(pts[:5] + [ScalingPoint("adamw", 1e7, -1.0)], NO_CI)
    with pytest.raises(OptquantError, match="one optimizer"):
        fit_law(pts + law_points("muon"), NO_CI)
    with pytest.raises(OptquantError, match="rho_max"):
        FitConfig(rho_max=0.0)


def test_exactly_identified_fit_has_nan_jackknife_intervals():
    pts = law_points()
    fit = fit_law(pts[:3] + pts[6:7], FitConfig(interval="loo"))  # any point left out → unidentifiable
    assert_close(fit.rho["4bit"], 0.85, 1e-3, "rho")
    assert all(math.isnan(lo) and math.isnan(hi) for lo, hi in fit.intervals.values())


def test_fit_laws_and_json_round_trip():
    pts, _ = joint_points()
    fits = fit_laws(pts, NO_CI)
    assert sorted(fits) == ["adamw", "muon", "shampoo"]
    assert_close(fits["muon"].rho["4bit"], 0.75, 1e-4)
    nan_fit = fit_law(law_points()[:3] + law_points()[6:7], FitConfig(interval="loo"))
    for fit in [*fits.values(), nan_fit, fit_joint(pts, NO_CI)]:
        text = json.dumps(fit.to_dict(), allow_nan=False)
        back = type(fit).from_dict(json.loads(text))
        assert back.to_dict() == fit.to_dict() and isinstance(back, LawFit | JointFit)
    assert predict(fits["adamw"], SIZES).shape == (6,)


def test_objective_gradient_matches_finite_differences():
    pts, _ = joint_points(noise=0.01)
    d = joint_design("adamw")(pts)
    x0 = float(d.x.mean())
    rng = np.random.default_rng(0)
    for delta in (1e9, 0.02):  # pure quadratic, and a mix of quadratic and linear residuals
        theta = np.r_[0.5, 0.3, 0.6, 0.2 * rng.standard_normal(len(d.names))]
        s = d.x - x0 + d.M @ theta[3:]
        res = np.logaddexp(theta[0] - theta[1] * s, theta[2]) - d.y
        assert (np.abs(res) > delta).any() == (delta < 1), "both Huber branches must be exercised"

        def f(t: np.ndarray, delta: float = delta) -> float:
            return objective(t, d, x0, delta)[0]

        def g(t: np.ndarray, delta: float = delta) -> np.ndarray:
            return objective(t, d, x0, delta)[1]

        assert check_grad(f, g, theta, epsilon=1e-7) < 1e-4 * np.linalg.norm(g(theta))


# ---------------------------------------------------------------- diagnostics and identification
SPEC = {"adamw": (1.0, 0.85), "muon": (1.3, 0.75), "shampoo": (0.8, 0.9)}  # ρ_fp, ρ_4bit; 4bit spread 0.15
CLOSE = np.geomspace(1e6, 2.3e6, 3)  # three sizes within 2.3×, like the old cpu preset


def spec_points(sizes, noise, seeds=None, spec=SPEC):
    return [p for i, (o, (rf, r)) in enumerate(spec.items())
            for p in law_points(o, r, rf, noise, seed=i, sizes=sizes, seeds=seeds)]


def test_three_close_sizes_are_not_identified():
    pts = spec_points(CLOSE, 0.002)
    fits = fit_laws(pts, NO_CI)  # the size checks need no interval (and the bootstrap is slow here)
    joint = fit_joint(pts, NO_CI)
    for fit in [*fits.values(), joint]:
        assert not fit.identified
        why = fit.diagnostics.why_not("rho_4bit" if isinstance(fit, LawFit) else "rho_4bit/muon")
        assert "3 distinct sizes (< 4)" in why and "sizes span 2.3× (< 8×)" in why, why
        assert fit.to_dict()["diagnostics"]["identified"] is False
    # α and E are barely separable over 2.3×: the Jacobian is far worse conditioned than over 3 decades
    wide = fit_joint(spec_points(SIZES, 0.002), NO_CI)
    assert joint.diagnostics.condition > 10 * wide.diagnostics.condition
    assert joint.diagnostics.max_abs_correlation > 0.99


def test_six_sizes_over_three_decades_are_identified_and_recover_the_law():
    pts = spec_points(SIZES, 0.002)
    cfg = FitConfig(n_boot=10)
    fits = fit_laws(pts, cfg)
    joint = fit_joint(pts, cfg)
    for o, (rf, r) in SPEC.items():
        assert fits[o].identified, fits[o].diagnostics.reasons
        assert_close(fits[o].rho["4bit"], r, 0.05, o)
        assert_close(joint.rho[o]["4bit"], r, 0.05, o)
        assert_close(joint.rho_fp[o], rf, 0.05, o)
    assert joint.identified, joint.diagnostics.reasons
    for k, v in TRUE.items():
        assert_close(getattr(joint, k), v, 0.05, k)
    diag = joint.diagnostics
    assert diag.n_sizes == 6 and diag.size_span == pytest.approx(1e3) and joint.at_bound == ()
    assert diag.residual_rms < 0.004  # the noise is 0.2 %
    assert 0 < diag.interval_width["rho_4bit/muon"] < 0.15


def test_rho_interval_wider_than_the_spread_is_not_identified():
    close_rho = {"adamw": (1.0, 0.85), "muon": (1.0, 0.853), "shampoo": (1.0, 0.856)}  # spread 0.006
    pts = spec_points(SIZES, 0.01, spec=close_rho)
    cfg = FitConfig(n_boot=6)
    fits = fit_laws(pts, cfg)
    spread = max(f.rho["4bit"] for f in fits.values()) - min(f.rho["4bit"] for f in fits.values())
    for f in fits.values():
        width = f.diagnostics.interval_width["rho_4bit"]
        assert width > spread  # 1 % noise: ρ known to a few hundredths, optimizers 0.006 apart
        assert f"interval width {width:.3g} > spread {spread:.3g}" in f.diagnostics.reasons["rho_4bit"]
        assert not f.identified and "fit" not in f.diagnostics.reasons  # the law itself is fine
    alone = judge({"adamw": fits["adamw"]}, cfg)["adamw"]  # one optimizer: no spread to compare with
    assert alone.identified, alone.diagnostics.reasons
    assert judge(fits, cfg) == fits  # judging twice changes nothing
    joint = fit_joint(pts, cfg)
    assert "across optimizers" in joint.diagnostics.why_not("rho_4bit/muon")


def test_at_bound_makes_the_fit_not_identified():
    capped = fit_law(law_points(rho=1.2, sizes=SIZES), FitConfig(n_boot=5))  # ρ_4bit hits its cap of 1
    assert capped.at_bound == ("rho_4bit",)
    assert "rho_4bit at its bound" in capped.diagnostics.reasons["rho_4bit"]
    assert "fit" not in capped.diagnostics.reasons and not capped.identified
    no_floor = fit_law(law_points(E=0.0), NO_CI)  # a pure power law: E goes to its lower bound
    assert "E" in no_floor.at_bound
    assert "E at its bound" in no_floor.diagnostics.reasons["fit"] and not no_floor.identified
    free = fit_law(law_points(), FitConfig(n_boot=5))
    assert free.at_bound == () and free.identified, free.diagnostics.reasons


def test_no_interval_is_not_identified():
    fit = fit_law(law_points(), NO_CI)
    assert fit.diagnostics.reasons == {"fit": "no intervals computed (interval=none)"}
    nan = fit_law(law_points()[:3] + law_points()[6:7], FitConfig(interval="loo"))  # every refit fails
    assert nan.diagnostics.reasons["rho_4bit"] == "no rho_4bit interval (too few identifiable refits)"


def test_residuals_and_correlations_match_an_independent_computation():
    pts = law_points(noise=0.01, seed=2)
    fit = fit_law(pts, NO_CI)
    diag = fit.diagnostics
    want = [math.log(float(predict(fit, p.n_params, p.quantized))) - math.log(p.loss) for p in pts]
    assert [r["residual"] for r in diag.residuals] == pytest.approx(want, abs=1e-12)
    assert diag.residual_rms == pytest.approx(math.sqrt(np.mean(np.square(want))))
    # finite-difference Jacobian of log L̂ in the fit's coordinates (log A at the geometric-mean N, α, log E,
    # log ρ), through `predict`; correlations from (JᵀJ)⁻¹
    x0 = float(np.mean(np.log([p.n_params for p in pts])))
    theta = np.array([math.log(fit.A) - fit.alpha * x0, fit.alpha, math.log(fit.E), math.log(fit.rho["4bit"])])

    def log_pred(t):
        f = LawFit("adamw", math.exp(t[0] + t[1] * x0), t[1], math.exp(t[2]), {"4bit": math.exp(t[3])}, 0, 0.0,
                   {}, (), "none")
        return np.log([float(predict(f, p.n_params, p.quantized)) for p in pts])

    eps = 1e-6
    J = np.column_stack([(log_pred(theta + eps * e) - log_pred(theta - eps * e)) / (2 * eps) for e in np.eye(4)])
    cov = np.linalg.inv(J.T @ J)
    corr = cov / np.sqrt(np.outer(np.diag(cov), np.diag(cov)))
    assert np.array(diag.correlation) == pytest.approx(corr, abs=1e-5)
    assert diag.names == ("A", "alpha", "E", "rho_4bit")
    assert diag.max_abs_correlation == pytest.approx(np.abs(corr[~np.eye(4, dtype=bool)]).max(), abs=1e-5)


def test_repeated_sizes_fit_and_bootstrap_seeds_within_each_size():
    pts = law_points(noise=0.002, seed=6, seeds=3)
    fit = fit_law(pts, FitConfig(n_boot=10))
    assert fit.n_points == 36 and fit.diagnostics.n_sizes == 6
    assert fit.diagnostics.resampling == "seeds within each size"
    for k, v in (TRUE | {"rho_4bit": 0.85}).items():
        lo, hi = fit.intervals[k]
        assert lo < hi and hi - lo < 0.2 * v, f"{k}: interval ({lo}, {hi})"
    lo, hi = fit.intervals["rho_4bit"]
    assert lo < fit.rho["4bit"] < hi and 0.002 < hi - lo < 0.05 and fit.identified  # seed noise, not zero
    assert_close(fit.rho["4bit"], 0.85, 0.02, "rho")
    assert fit_law(pts, FitConfig(n_boot=10)).intervals == fit.intervals  # seeded
    # one stratum per size, one cluster per seed holding that seed's FP and QAT points at that size
    how, strata = resampling_strata(pts)
    assert len(strata) == 6 and all(len(clusters) == 3 for clusters in strata)
    for clusters in strata:
        assert len({pts[i].n_params for c in clusters for i in c}) == 1
        for c in clusters:
            assert len({pts[i].seed for i in c}) == 1 and {pts[i].precision for i in c} == {"fp", "4bit"}
    # seeds not recorded: the k-th point of a (optimizer, precision, size) counts as seed k
    unseeded = [ScalingPoint(p.optimizer, p.n_params, p.loss, p.quantized, p.bits) for p in pts]
    assert [sorted(map(sorted, s)) for s in resampling_strata(unseeded)[1]] == [sorted(map(sorted, s)) for s in strata]
    # one size with a single seed: resample points within (optimizer, precision) groups, as with one seed
    mixed = [p for p in pts if not (p.n_params == SIZES[0] and p.seed)]
    assert resampling_strata(mixed)[0] == "points within each (optimizer, precision) group"
    assert resampling_strata(law_points())[0] == "points within each (optimizer, precision) group"

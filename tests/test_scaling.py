"""Tests for optquant.scaling.

Strategy: losses generated from a known law L = A/(N·ρ)^α + E (A = 400, α = 0.3, E = 1.8, ρ_4bit = 0.85,
six sizes from 1e6 to 1e9, FP and QAT) must give the parameters back: exactly without noise, within
5 % with 0.2 % log-normal noise. The joint fit gets three optimizers with different ρ_fp and ρ_4bit.
Intervals must cover the truth; one corrupted point must not move the Huber fit while it moves
least squares; unidentifiable inputs raise OptquantError. Bootstraps use few resamples to stay fast.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.optimize import check_grad

from optquant import scaling as S
from optquant.errors import OptquantError
from optquant.scaling import FitConfig, JointFit, LawFit, ScalingPoint, fit_joint, fit_law, fit_laws, predict

TRUE = dict(A=400.0, alpha=0.3, E=1.8)
SIZES = np.geomspace(1e6, 1e9, 6)
NO_CI = FitConfig(interval="none")


def law_points(opt="adamw", rho=0.85, rho_fp=1.0, noise=0.0, seed=0, bits=(4,), rhos=None):
    """FP and QAT points from the true law; log-normal noise of relative size `noise`."""
    rng = np.random.default_rng(seed)
    groups = [(False, 4, 1.0)] + [(True, b, r) for b, r in zip(bits, rhos or [rho], strict=True)]
    pts = []
    for quantized, b, r in groups:
        for N in SIZES:
            L = TRUE["A"] / (N * rho_fp * r) ** TRUE["alpha"] + TRUE["E"]
            pts.append(
                ScalingPoint(opt, float(N), float(L * math.exp(noise * rng.standard_normal())), quantized, b)
            )
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
    d = S._joint_design("adamw")(pts)
    x0 = float(d.x.mean())
    rng = np.random.default_rng(0)
    for delta in (1e9, 0.02):  # pure quadratic, and a mix of quadratic and linear residuals
        theta = np.r_[0.5, 0.3, 0.6, 0.2 * rng.standard_normal(len(d.names))]
        s = d.x - x0 + d.M @ theta[3:]
        res = np.logaddexp(theta[0] - theta[1] * s, theta[2]) - d.y
        assert (np.abs(res) > delta).any() == (delta < 1), "both Huber branches must be exercised"

        def f(t: np.ndarray, delta: float = delta) -> float:
            return S._objective(t, d, x0, delta)[0]

        def g(t: np.ndarray, delta: float = delta) -> np.ndarray:
            return S._objective(t, d, x0, delta)[1]

        assert check_grad(f, g, theta, epsilon=1e-7) < 1e-4 * np.linalg.norm(g(theta))

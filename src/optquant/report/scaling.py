"""Table 10 rebuilt from a study's fits.json: per-optimizer fits (10), the joint headline fit (10b) and
how well each fit's numbers are identified (10c).

fits.json is `optquant.scaling` `to_dict` output (load.py). A parameter the fit's diagnostics judged not
identified (too few or too close sizes, a bound, an interval wider than the spread across optimizers) is
shown as "not identified (why)" instead of a number that only looks precise.
"""

from __future__ import annotations

import numpy as np

from optquant.report.load import StudyData, fit_interval, fit_rho4, fmt, fmt_ci
from optquant.report.paper import by_label
from optquant.report.tables import Table, not_run
from optquant.scaling import FitConfig


def _not_identified(fit: dict, name: str, whole: str = "") -> str:
    """"not identified (why)" for parameter `name` of a fits.json entry, or "" if its diagnostics (when
    stored; older files have none) found nothing against it; reasons under "fit" apply to every parameter
    (given as `whole` instead, when set, so a table can state them once)."""
    reasons = (fit.get("diagnostics") or {}).get("reasons") or {}
    own = [reasons[name]] if name in reasons else []
    fit_wide = ([whole] if whole else [reasons["fit"]]) if "fit" in reasons else []
    why = "; ".join(fit_wide + own)
    return f"not identified ({why})" if why else ""


def verdict(fit: dict) -> str:
    """A fits.json entry's verdict: "identified", or "not identified: " and every reason its diagnostics give."""
    reasons = (fit.get("diagnostics") or {}).get("reasons") or {}
    return "not identified: " + "; ".join(reasons.values()) if reasons else "identified"


def _param(fit: dict, key: str) -> str:
    """A shared parameter (E, alpha) of a fits.json entry with its stored interval."""
    return fmt_ci(float(fit[key]), fit_interval(fit.get("intervals"), key))


def table10(d: StudyData) -> Table:
    title = "Table 10 — per-optimizer scaling-law fits, L(N) = A/(N·ρ)^α + E"
    per = (d.fits or {}).get("per_optimizer") or {}
    if not per:
        return not_run("table10", title, "no fits.json (or no per-optimizer fits in it)")
    rows = []
    for o in by_label(per):
        f = per[o]
        iv = f.get("intervals") or {}
        rho = fit_rho4(f.get("rho"))
        notes = ", ".join(f.get("at_bound") or []) or ""
        rows.append((o, _not_identified(f, "rho_4bit") or fmt_ci(rho, fit_interval(iv, "rho_4bit", "rho")),
                     _param(f, "E"), _param(f, "alpha"), f"{float(f['A']):.4g}", str(f.get("n_points", "–")),
                     f"at bound: {notes}" if notes else ""))  # fmt: skip
    n_count = (d.fits or {}).get("n_count")
    caption = (
        "From fits.json per_optimizer: A, α, E shared by the optimizer's FP (ρ = 1) and QAT points; ρ_4bit "
        "free. Brackets: the interval stored with the fit (method: "
        f"{next(iter(per.values())).get('method', 'unstated')})."
        + (f" N counts {n_count} parameters, as the token budget does." if n_count else "")
        + " A ρ is shown as “not identified” when the fit has too few or too close sizes, a parameter at its "
        "bound, or a ρ interval wider than the spread of ρ across optimizers (Table 10c). Each optimizer's ρ "
        "can trade off against its own E; the joint fit (Table 10b) is the headline."
    )
    cols = ("optimizer", "ρ_4bit [CI]", "E [CI]", "α [CI]", "A", "points", "fit notes")
    return Table("table10", title, cols, tuple(rows), caption)


def table10_joint(d: StudyData) -> Table:
    title = "Table 10b — joint fit (shared A, α, E across optimizers): the headline ρ"
    j = (d.fits or {}).get("joint")
    if not j:
        return not_run("table10b", title, "no joint fit in fits.json")
    iv = j.get("intervals") or {}
    rho_fp = j.get("rho_fp") or {}
    rows = []
    for o in by_label(j.get("rho") or {}):
        fp = fmt_ci(float(rho_fp.get(o, 1.0)), fit_interval(iv, f"rho_fp/{o}"))
        if o == j.get("reference"):
            fp += " (reference)"
        rho4 = fmt_ci(fit_rho4(j["rho"][o]), fit_interval(iv, f"rho_4bit/{o}", f"rho/{o}", o))
        rows.append((o, _not_identified(j, f"rho_fp/{o}", "whole fit, see below") or fp,
                     _not_identified(j, f"rho_4bit/{o}", "whole fit, see below") or rho4))  # fmt: skip
    shared = f"A = {float(j['A']):.4g}, α = {_param(j, 'alpha')}, E = {_param(j, 'E')}"
    headline = (d.fits or {}).get("headline")
    whole = ((j.get("diagnostics") or {}).get("reasons") or {}).get("fit")
    caption = (
        (f"The whole fit is not identified: {whole}. " if whole else "")
        + f"From fits.json joint: {shared}; {j.get('n_points', '?')} points. ρ_fp is relative to "
        f"{d.label(j.get('reference', 'adamw'))} (ρ_fp = 1); ρ_4bit is relative to the optimizer's own FP."
        + (" This joint fit is the study's headline ρ (fits.json headline: joint): sharing α and E stops "
           "each ρ trading off against its own E, as the authors later recommended." if headline == "joint" else "")
    )
    return Table("table10b", title, ("optimizer", "ρ_fp [CI]", "ρ_4bit [CI]"), tuple(rows), caption)


def fit_diagnostics_table(d: StudyData) -> Table:
    """Table 10c, one row per fit in fits.json: how well its numbers are identified (scaling.FitDiagnostics)."""
    cfg = FitConfig()  # the thresholds optquant.study.results judges with
    title = "Table 10c — scaling-fit diagnostics"
    fits = d.fits or {}
    per = fits.get("per_optimizer") or {}
    entries = [(f"{d.label(o)} (per optimizer)", per[o], "rho_4bit") for o in by_label(per)]
    if fits.get("joint"):
        entries.append(("joint (headline)", fits["joint"], "rho_4bit/"))
    if not entries:
        return not_run("table10c", title, "no fits in fits.json")
    entries = [e for e in entries if e[1].get("diagnostics")]
    if not entries:
        return Table("table10c", title, missing="fits.json has no diagnostics (written by an older optquant; "
                                                "`optquant fit STUDY_DIR` recomputes it)")
    per_rho = [fit_rho4(f.get("rho")) for _, f, p in entries if p == "rho_4bit"]
    joint_rho = [fit_rho4(r) for r in ((fits.get("joint") or {}).get("rho") or {}).values()]
    rows = []
    for name, f, prefix in entries:
        g = f["diagnostics"]
        names = g["names"]
        corr = np.array(g["correlation"], dtype=float)  # null (JSON's NaN) becomes NaN
        off = np.where(np.eye(len(names), dtype=bool), np.nan, np.abs(corr))
        if np.isfinite(off).any():
            i, j = np.unravel_index(np.nanargmax(off), off.shape)
            top = f"{off[i, j]:.3f} ({names[i]}, {names[j]})"
        else:
            top = "–"
        widths = [w for k, w in g["interval_width"].items() if k.startswith(prefix) and w is not None]
        rhos = [v for v in (per_rho if prefix == "rho_4bit" else joint_rho) if np.isfinite(v)]
        spread = fmt(max(rhos) - min(rhos), 3) if len(rhos) > 1 else "–"
        width = fmt(max(widths), 3) if widths else "–"
        rows.append((
            name, str(f.get("n_points", "–")),
            f"{g['n_sizes']} over {g['size_span']:.3g}×" if g.get("size_span") else str(g["n_sizes"]),
            fmt(100 * g["residual_rms"], 2) if g.get("residual_rms") is not None else "–",
            top,
            f"{g['condition']:.3g}" if g.get("condition") is not None else "∞",
            ", ".join(f.get("at_bound") or []) or "none",
            f"{width} ({spread})",
            verdict(f),
        ))  # fmt: skip
    caption = (
        "From fits.json diagnostics. Residual RMS: of log L̂ − log L, in % (a relative error). Max |corr|: the "
        "largest parameter correlation from the Gauss–Newton covariance (JᵀJ)⁻¹ at the optimum, in the fit's "
        "coordinates (log A at the geometric-mean N, α, log E, log ρ); cond: condition number of the "
        "column-scaled Jacobian (large: parameters trade off). ρ_4bit width: the widest ρ_4bit interval of the "
        "fit, with the spread of the ρ_4bit point estimates across optimizers in brackets; an interval wider "
        f"than the spread cannot rank the optimizers. A fit needs ≥ {cfg.min_sizes} distinct sizes spanning "
        f"≥ {cfg.min_span:g}× in N."
    )
    cols = ("fit", "points", "sizes", "residual RMS (%)", "max |corr|", "cond", "at bound",
            "ρ_4bit width (spread)", "verdict")
    return Table("table10c", title, cols, tuple(rows), caption)


"""What a study's design can decide: the requirements a claim's verdict rests on, checked before it is judged.

A rigorous test on a design that cannot decide gives a confident wrong answer, so each claim names what it
needs and, where the study lacks it, its verdict is "not testable with this design" with the reason:

- tuned: every optimizer it compares had its LR search bracketed at every size (a diverged neighbour counts
  as a worse one), and every step size moving ≥ 1 % of the parameters searched or tied to a searched ratio,
  that search bracketed too (best.json, study/tuning.py);
- depth: ≥ 2 blocks at every size, so that quantization error has earlier layers to propagate from
  (the propagation claims: A vs B and C, the layer gains, R_L);
- identified ρ: ≥ 3 optimizers with an identified ρ_4bit for an ordering or a rank correlation over them;
- quiet timing: a wall-clock ranking only where the step times of one configuration agree across its seeds
  within 10 % (on a shared or loaded machine they do not).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from optquant.report.load import StudyData, fit_interval, fit_rho4

NOT_TESTABLE = "not testable with this design"
MIN_SHARE = 0.01  # a group moving at least this share of the parameters must have a tuned step size
MIN_BLOCKS = 2
MIN_RHO = 3
TIMING_CV = 0.10
_TUNED = ("bracketed", "diverged")

Need = Callable[[StudyData], str | None]  # the reason a requirement is not met, or None


def tuned(d: StudyData) -> str | None:
    """Every optimizer's LR search bracketed at every size and every group of ≥ 1 % of the parameters tuned."""
    if not d.best:
        return "no best.json: the LR searches cannot be checked"
    problems = []
    for (opt, size), r in sorted(d.best.items()):
        if opt not in d.optimizers:
            continue
        if r.get("status") not in _TUNED:
            problems.append(f"{d.label(opt)}'s LR at {size} ({r.get('status')})")
        for g in r.get("groups") or []:
            if g.get("share", 0) < MIN_SHARE or g.get("rule") == "searched":
                continue
            if g.get("rule") != "tied":
                problems.append(f"{d.label(opt)}'s {g['group']} step size at {size} ({g['share']:.0%} of the "
                                f"parameters, {g['rule']} at {g['lr']:.3g})")
            elif (st := (r.get("ratio_status") or {}).get(g.get("field"))) not in _TUNED:
                problems.append(f"{d.label(opt)}'s {g['group']} ratio at {size} ({st})")
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        return "untuned: " + "; ".join(problems[:3]) + more
    return None


def depth(d: StudyData) -> str | None:
    sizes = [s for s in d.sizes if s in d.blocks]
    if not sizes:
        return "the models' depth is not recorded"
    shallow = [f"{s} ({d.blocks[s]})" for s in sizes if d.blocks[s] < MIN_BLOCKS]
    if shallow:
        return (f"blocks per model below {MIN_BLOCKS} at {', '.join(shallow)}: quantization error has no earlier "
                "layers to propagate from")
    return None


def identified_rhos(d: StudyData) -> tuple[dict[str, tuple[float, float, float]], list[str]]:
    """The headline (joint-fit) ρ_4bit with its interval for every optimizer whose ρ is identified, and
    the optimizers whose ρ is not (optquant.scaling's verdict: a bound, too few sizes, or an interval wider
    than the spread across optimizers). A ρ that is not identified is not evidence either way."""
    joint = (d.fits or {}).get("joint") or {}
    reasons = (joint.get("diagnostics") or {}).get("reasons") or {}
    out, unidentified = {}, []
    for o, r in (joint.get("rho") or {}).items():
        rho = fit_rho4(r)
        if "fit" in reasons or f"rho_4bit/{o}" in reasons or not math.isfinite(rho):
            unidentified.append(o)
            continue
        lo, hi = fit_interval(joint.get("intervals"), f"rho_4bit/{o}")
        out[o] = (rho, lo, hi)
    return out, unidentified


def identified_rho(d: StudyData) -> str | None:
    n = len(identified_rhos(d)[0])
    return f"{n} identified ρ_4bit (an ordering needs ≥ {MIN_RHO})" if n < MIN_RHO else None


def quiet_timing(d: StudyData) -> str | None:
    df = d.seeds("fp", "mean_step_seconds", best=True)
    if df.empty:
        return "no timed runs"
    cv = [float(np.std(g["value"], ddof=1) / np.mean(g["value"])) for _, g in df.groupby(["size", "optimizer"])
          if len(g) > 1]
    if not cv:
        return "step times of one seed only: their noise is unknown"
    if max(cv) > TIMING_CV:
        return (f"step times of one configuration vary by up to {max(cv):.0%} across seeds (> {TIMING_CV:.0%}: "
                "a shared or loaded machine)")
    return None


NEEDS: dict[str, tuple[Need, ...]] = {
    "fp_best": (tuned,),
    "mmr_low": (tuned,),
    "ptq_least": (tuned,),
    "ptq_most": (tuned,),
    "rl_predicts": (depth,),
    "a_dominates": (depth,),
    "gain_rank": (tuned, depth),
    "qat_least": (tuned,),
    "qat_not_fp": (tuned,),
    "rho_rank": (tuned, identified_rho),
    "ptq_qat_link": (tuned, identified_rho),
    "shampoo_cost": (quiet_timing,),
}


def untestable(d: StudyData, key: str) -> str | None:
    """The verdict of claim `key` when the design cannot decide it (with every reason), else None."""
    base = key.removesuffix("_acc")
    reasons = [r for need in NEEDS.get(base, ()) if (r := need(d))]
    return f"{NOT_TESTABLE}: " + "; ".join(reasons) if reasons else None


def needs_text(key: str) -> str:
    return ", ".join(n.__name__.replace("_", " ") for n in NEEDS.get(key.removesuffix("_acc"), ())) or "–"

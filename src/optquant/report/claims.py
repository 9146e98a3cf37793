"""The paper's qualitative claims, each judged against this study's numbers with its uncertainty.

Each check is computed from the same files as the tables (paper.md §1, §6.2, §7.4–7.5, §10). Our PTQ damage
is Δ val loss (quantized − FP, lower = more robust) where the paper uses the accuracy drop; a study that ran
lm-eval tasks (`eval.tasks`) also judges the two PTQ claims on that drop, Δ acc_norm. A verdict is
"supported" or "contradicted" only when the data resolve it, otherwise "not resolved at this scale", and
every verdict names its p-value or interval (optquant.stats):

- "X is best/most robust": paired exact sign-flip tests of X against each other optimizer, pooled over
  sizes as blocks (units = size × seed), Holm-corrected over those k − 1 comparisons, α = 0.05.
  Supported: X is significantly better than every other optimizer; contradicted: some optimizer is
  significantly better than X. (The tables' ranks correct over all k(k − 1)/2 pairs, which with 6
  optimizers needs ≥ 10 units before any pair can resolve: 2/2^9 > 0.05/15.)
- correlations: the within-size correlation at the largest size (the paper's setting), with its CI.
- ρ_4bit order: pairs whose intervals do not overlap.
"n/a: …" names the missing input. Nothing here is a reproduction: our models are tiny and our score is
validation loss; "supported" means this study's data agree with the claim at its own scale.

Left out on purpose: claims about 1.5B-only behaviour and about absolute accuracies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

from optquant.report.design import NOT_TESTABLE, identified_rhos, needs_text, untestable
from optquant.report.load import StudyData
from optquant.report.paper import CLAIMS, RHO_RANKING, Claim
from optquant.report.tables import Table, rank_over
from optquant.stats import (
    ALPHA,
    NOT_RESOLVED,
    Ranking,
    holm,
    min_p,
    summarize,
    verdict,
)

G1_TOLERANCE = 0.1  # "G₁ ≈ 1" read as the 95 % interval of mean G₁ inside [1 − tol, 1 + tol]
A_SHARE = 0.8  # "A dominates at almost all modules" read as A ≥ max(B, |C|) at ≥ 80 % of chain modules


@dataclass(frozen=True)
class Check:
    how: str
    ours: str
    verdict: str  # "supported" | "contradicted" | NOT_RESOLVED | "n/a: <why>"


def _na(how: str, why: str, ours: str = "–") -> Check:
    return Check(how, ours, f"n/a: {why}")


def _ranking(d: StudyData, kind: str, metric: str, scheme: str | None = "none", best: bool | None = None,
             lower_is_better: bool = True) -> Ranking | None:
    """Ranking pooled over sizes: units (size, seed)."""
    df = d.seeds(kind, metric, scheme, best)
    return rank_over(df, ["size", "seed"], lower_is_better) if df["optimizer"].nunique() > 1 else None


def _pair_text(d: StudyData, a: str, b: str, test: tuple) -> str:
    t, p = test  # a − b's paired test and its Holm-adjusted p, as Ranking.test gives them
    return f"{d.label(a)} − {d.label(b)} = {t.mean_diff:+.3g} [{t.lo:+.3g}, {t.hi:+.3g}], p_Holm={p:.2g}"


def _best_of(d: StudyData, r: Ranking | None, target: str, how: str, what: str) -> Check:
    """Is `target` significantly better than every other optimizer? The family is the k − 1 comparisons of
    `target` with the others (Holm over those), the hypotheses the claim makes; the ranks shown are the
    table's, Holm over all pairs."""
    if r is None:
        return _na(how, f"no {what} for two optimizers")
    if target not in r.rank:
        return _na(how, f"{d.label(target)} not in this study")
    others = [o for o in r.rank if o != target]
    tests = {o: r.test(target, o)[0] for o in others}
    adj = dict(zip(others, holm([tests[o].p for o in others]), strict=True))
    sign = 1.0 if r.lower_is_better else -1.0
    better = {o: adj[o] < ALPHA and sign * tests[o].mean_diff < 0 for o in others}
    worse = {o: adj[o] < ALPHA and sign * tests[o].mean_diff > 0 for o in others}
    ours = "; ".join(_pair_text(d, target, o, (tests[o], adj[o])) for o in others)
    ours += f" (n={r.n_units} size×seed units, smallest attainable p {min_p(r.n_units):.2g})"
    return Check(how, ours, verdict(all(better.values()), any(worse.values())))


def _rank_how(what: str) -> str:
    return f"{what}; paired exact sign-flip tests pooled over sizes (units size×seed), Holm, α = {ALPHA}"


# ---------------------------------------------------------------- checks
def _mmr_lr(d: StudyData) -> Check:
    how = "sign of Spearman(lr, MMR) per (optimizer, size) with ≥ 2 LRs; two-sided sign test on the count"
    df = d.rows("fp", "mmr")
    pairs = [g for _, g in df.groupby(["optimizer", "size"]) if g["lr"].nunique() >= 2]
    rs = [stats.spearmanr(g["lr"], g["value"]).statistic for g in pairs]
    rs = [x for x in rs if np.isfinite(x) and x != 0]
    if not rs:
        return _na(how, "MMR was not measured at several LRs of one optimizer and size")
    k, m = sum(x > 0 for x in rs), len(rs)
    p = stats.binomtest(k, m).pvalue
    return Check(how, f"MMR rises with LR in {k}/{m} (optimizer, size) pairs, sign test p={p:.2g}",
                 verdict(k > m / 2 and p < ALPHA, k < m / 2 and p < ALPHA))  # fmt: skip


def _ptq(d: StudyData, least: bool, target: str, task: str | None = None) -> Check:
    """Is `target` the least (most) damaged CL model under PTQ: by Δ val loss, or with an lm-eval `task` by
    the paper's own measure, the drop in zero-shot acc_norm (there a higher Δ is more robust)."""
    scheme = d.paper_scheme()
    name, metric, drop, lower = ("Δ val loss", "delta_val_loss", "", least) if task is None else \
        ("Δ acc_norm", f"delta_acc_norm/{task}", " drop", not least)
    on = "" if task is None else f" on {d.task_label(task)} (lm-eval)"
    how = _rank_how(f"{name}{on} under {scheme} of the CL models, {d.label(target)} "
                    f"{'smallest' if least else 'largest'}{drop}")  # fmt: skip
    if scheme is None:
        return _na(how, "no PTQ rows")
    return _best_of(d, _ranking(d, "cl", metric, scheme, lower_is_better=lower), target, how, f"{name} rows")


def _corr_rows(d: StudyData, size: str) -> dict | None:
    c, scheme = d.correlations, d.paper_scheme()
    if c is None or c.empty or scheme is None or "pearson_p" not in c:
        return None
    c = c[(c["scheme"] == scheme) & (c["target"] == "delta_val_loss") & (c["size"].astype(str) == size)]
    return {str(x.metric): x for x in c.itertuples()} or None


def _rl_predicts(d: StudyData) -> Check:
    how = ("within-size Pearson with Δ val loss at the largest size: R_L positive (p < 0.05) and its CI above "
           "|r| of MMR and kurtosis; contradicted if R_L's CI lies below their |r|")
    size = d.largest()
    rows = _corr_rows(d, size) if size else None
    if rows is None or not {"R_L", "mmr", "kurtosis"} <= set(rows):
        return _na(how, "no within-size correlations for mmr, kurtosis and R_L")

    def txt(m: str) -> str:
        x = rows[m]
        if not math.isfinite(x.pearson):
            return f"{m} undefined"
        return f"{m} {x.pearson:+.2f} [{x.pearson_lo:+.2f}, {x.pearson_hi:+.2f}] p={x.pearson_p:.2g}"

    rl = rows["R_L"]
    ours = f"{size}, n={int(rl.n)}: " + "; ".join(txt(m) for m in ("R_L", "mmr", "kurtosis"))
    pooled = _corr_rows(d, "pooled")
    if pooled and "R_L" in pooled:
        ours += f" · pooled (all sizes, n={int(pooled['R_L'].n)}): R_L {pooled['R_L'].pearson:+.2f}"
    if not all(math.isfinite(rows[m].pearson) for m in ("R_L", "mmr", "kurtosis")):
        return Check(how, ours, NOT_RESOLVED)
    rival = max(abs(rows["mmr"].pearson), abs(rows["kurtosis"].pearson))
    ok = rl.pearson > 0 and rl.pearson_p < ALPHA and rl.pearson_lo > rival
    bad = rl.pearson_hi < rival or (rl.pearson < 0 and rl.pearson_p < ALPHA)
    return Check(how, ours, verdict(ok, bad))


def _propagation_shares(d: StudyData) -> tuple[str, dict[str, list[float]]] | None:
    """Share of chain modules (after the first) where A ≥ max(B, |C|), per CL model at the largest size
    with propagation files under the paper's scheme, all seeds."""
    scheme = d.paper_scheme()
    if scheme is None:
        return None
    r = d.results
    for size in reversed(d.sizes):
        cl = r[(r["kind"] == "cl") & (r["size"] == size)].drop_duplicates("run_id")
        share: dict[str, list[float]] = {}
        for x in cl.itertuples():
            df = d.propagation(x.run_id, scheme)
            if df is None:
                continue
            ch = df[df["kind"] != "linear"].sort_values("index").iloc[1:]
            if len(ch):
                share.setdefault(x.optimizer, []).append(float((ch["A"] >= np.maximum(ch["B"], ch["C"].abs())).mean()))
        if share:
            return f"{size}, {scheme}", share
    return None


def _a_dominates(d: StudyData) -> Check:
    how = (f"per CL model: share of chain modules (after the first) with A ≥ max(B, |C|); supported if ≥ "
           f"{A_SHARE:.0%} in every model, contradicted if an optimizer's mean share is below 50 %")
    got = _propagation_shares(d)
    if got is None:
        return _na(how, "no propagation.parquet files")
    where, share = got
    ours = f"{where}: " + ", ".join(f"{d.label(o)} {summarize(v).text(2)}" for o, v in share.items())
    allv = [x for v in share.values() for x in v]
    return Check(how, ours, verdict(min(allv) >= A_SHARE, min(np.mean(v) for v in share.values()) < 0.5))


def _g1_one(d: StudyData) -> Check:
    scheme = d.paper_scheme()
    how = (f"mean G₁ over linear layers per CL model; supported if every optimizer's 95 % interval lies in "
           f"[{1 - G1_TOLERANCE:g}, {1 + G1_TOLERANCE:g}], contradicted if one lies outside it")
    df = d.seeds("cl", "mean_G1", scheme) if scheme else None
    if df is None or df.empty:
        return _na(how, "no mean_G1 rows")
    per = {o: summarize(g["value"]) for o, g in df.groupby("optimizer")}
    ours = f"{scheme}, all sizes: " + ", ".join(f"{d.label(o)} {s.text(3)}" for o, s in per.items())
    lo, hi = 1 - G1_TOLERANCE, 1 + G1_TOLERANCE
    inside = all(s.n > 1 and lo <= s.lo and s.hi <= hi for s in per.values())
    outside = any(s.n > 1 and (s.hi < lo or s.lo > hi) for s in per.values())
    return Check(how, ours, verdict(inside, outside))


def _gain_rank(d: StudyData, high: str, low: tuple[str, ...]) -> Check:
    """The paper's claim: optimizer `high` has the highest gain, the `low` ones the lowest."""
    scheme = d.paper_scheme()
    how = _rank_how(f"mean linear-layer gain G of the CL models: {d.label(high)} highest, "
                    f"{' and '.join(map(d.label, low))} lowest")
    r = _ranking(d, "cl", "mean_gain", scheme, lower_is_better=False) if scheme else None
    if r is None or not {high, *low} <= set(r.rank):
        return _na(how, f"needs mean_gain rows of {', '.join(map(d.label, (high, *low[:-1])))} and {d.label(low[-1])}")
    rest = [o for o in r.rank if o not in low]
    top = all(r.better(high, o) for o in r.rank if o != high)
    bottom = all(r.better(o, lo) for lo in low for o in rest)
    bad = any(r.better(o, high) for o in r.rank) or any(r.better(lo, o) for lo in low for o in rest)
    ours = ", ".join(f"{d.label(o)} rank {r.label(o)}" for o in sorted(r.rank, key=r.rank.get))
    return Check(how, ours + f" (n={r.n_units} units, higher gain ranks first)", verdict(top and bottom, bad))


def _sole_best(r: Ranking) -> str | None:
    return next((o for o in r.rank if all(r.better(o, x) for x in r.rank if x != o)), None)


def _qat_not_fp(d: StudyData) -> Check:
    how = _rank_how("the significantly best FP optimizer is significantly beaten under QAT (final val loss)")
    fp = _ranking(d, "fp", "final_val_loss", best=True)
    qat = _ranking(d, "qat", "final_val_loss", None)
    if fp is None or qat is None:
        return _na(how, "needs FP and QAT runs of two optimizers")
    best = _sole_best(fp)
    if best is None or best not in qat.rank:
        ours = "no optimizer is significantly best in FP: " + ", ".join(f"{d.label(o)} {fp.label(o)}" for o in fp.rank)
        return Check(how, ours, NOT_RESOLVED)
    beaten = [o for o in qat.rank if qat.better(o, best)]
    ours = f"FP best: {d.label(best)}; QAT: " + "; ".join(_pair_text(d, best, o, qat.test(best, o))
                                                          for o in qat.rank if o != best)
    return Check(how, ours, verdict(bool(beaten), _sole_best(qat) == best))


def _rho_rank(d: StudyData) -> Check:
    how = ("joint-fit ρ_4bit order vs the paper's, over the optimizers whose ρ is identified: supported if "
           "every adjacent pair in the paper's order has disjoint intervals in that order, contradicted if any "
           "pair has disjoint intervals in the reverse order")
    rho, unidentified = identified_rhos(d)
    rho = {o: v for o, v in rho.items() if o in RHO_RANKING}
    missing = f"; not identified: {', '.join(d.label(o) for o in unidentified)}" if unidentified else ""
    if len(rho) < 2:
        return Check(how, f"fewer than two identified ρ_4bit{missing}", NOT_RESOLVED)
    order = [o for o in RHO_RANKING if o in rho]
    ours = " > ".join(f"{d.label(o)} {rho[o][0]:.3f} [{rho[o][1]:.3f}, {rho[o][2]:.3f}]"
                      for o in sorted(rho, key=lambda o: -rho[o][0])) + missing  # fmt: skip
    above = {(a, b): rho[a][1] > rho[b][2] for a in rho for b in rho if a != b}  # a's interval above b's
    ok = all(above[(a, b)] for a, b in zip(order, order[1:], strict=False)) and not unidentified
    bad = any(above[(b, a)] for i, a in enumerate(order) for b in order[i + 1:])
    return Check(how, ours, verdict(ok, bad))


def _ptq_qat_link(d: StudyData) -> Check:
    how = "Spearman over optimizers of mean Δ val loss (PTQ, CL models, all sizes) vs ρ_4bit; expected negative"
    (rho, _), scheme = identified_rhos(d), d.paper_scheme()
    df = d.seeds("cl", "delta_val_loss", scheme) if scheme else None
    if df is None or df.empty:
        return _na(how, "no PTQ damage rows")
    mean_dl = {o: float(g["value"].mean()) for o, g in df.groupby("optimizer") if o in rho}
    if len(mean_dl) < 3:
        return _na(how, "needs PTQ damage and ρ_4bit for ≥ 3 optimizers")
    res = stats.spearmanr([mean_dl[o] for o in mean_dl], [rho[o][0] for o in mean_dl])
    ours = f"Spearman {res.statistic:+.2f}, p={res.pvalue:.2g} over {len(mean_dl)} optimizers"
    return Check(how, ours, verdict(res.statistic < 0 and res.pvalue < ALPHA, res.statistic > 0 and res.pvalue < ALPHA))


def _step_cost(d: StudyData, slow: str, fast: str, paper: str) -> Check:
    """The paper's claim: optimizer `slow` takes longer per step than `fast` (`paper`: its measured ratio)."""
    how = _rank_how(f"mean step time of the best-LR runs, {d.label(slow)} vs {d.label(fast)}")
    r = _ranking(d, "fp", "mean_step_seconds", best=True)
    if r is None or not {slow, fast} <= set(r.rank):
        return _na(how, f"needs timed {d.label(slow)} and {d.label(fast)} runs")
    t = d.cell("fp", "mean_step_seconds", best=True)
    s = [x for x in d.sizes if (x, slow) in t and (x, fast) in t][-1]
    ours = _pair_text(d, slow, fast, r.test(slow, fast)) + f"; {s}: {t[(s, slow)] / t[(s, fast)]:.2f}× (paper {paper})"
    return Check(how, ours, verdict(r.better(fast, slow), r.better(slow, fast)))


_CHECKS: dict[str, Callable[[StudyData], Check]] = {
    "fp_best": lambda d: _best_of(d, _ranking(d, "fp", "final_val_loss", best=True), "muon",
                                  _rank_how("best-LR final val loss, Muon lowest"), "best-LR runs"),
    "mmr_lr": _mmr_lr,
    "mmr_low": lambda d: _best_of(d, _ranking(d, "cl", "mmr"), "muon",
                                  _rank_how("MMR (per-token) of the CL models, Muon lowest"), "MMR rows"),
    "ptq_least": lambda d: _ptq(d, True, "shampoo"),
    "ptq_most": lambda d: _ptq(d, False, "muon"),
    "rl_predicts": _rl_predicts,
    "a_dominates": _a_dominates,
    "g1_one": _g1_one,
    "gain_rank": lambda d: _gain_rank(d, "muon", ("adamw", "shampoo")),
    "qat_least": lambda d: _best_of(d, _ranking(d, "qat", "qat_rel_degradation_pct", None), "shampoo",
                                    _rank_how("relative QAT val-loss gap, Shampoo smallest"), "QAT rows"),
    "qat_not_fp": _qat_not_fp,
    "rho_rank": _rho_rank,
    "ptq_qat_link": _ptq_qat_link,
    "shampoo_cost": lambda d: _step_cost(d, "shampoo", "adamw", "760M: 1.33×"),
}


_ACC_CHECKS = {"ptq_least": (True, "shampoo"), "ptq_most": (False, "muon")}  # judged on accuracy too


def check_claims(d: StudyData) -> dict[str, tuple[Claim, Check]]:
    """Every claim's check; with lm-eval tasks, the PTQ claims once more on the accuracy drop (their mean
    with several tasks), right after their Δ val loss versions."""
    task = next(iter(d.tasks()), None)
    out = {}
    for c in CLAIMS:
        out[c.key] = (c, _design(d, c.key, _CHECKS[c.key](d)))
        if task is not None and c.key in _ACC_CHECKS:
            acc = Claim(f"{c.key}_acc", f"{c.text} (accuracy drop, the paper's measure)", c.sources)
            out[acc.key] = (acc, _design(d, acc.key, _ptq(d, *_ACC_CHECKS[c.key], task)))
    return out


def _design(d: StudyData, key: str, check: Check) -> Check:
    """The check, with its verdict replaced by "not testable with this design: …" where the study lacks what
    the claim needs (report/design.py); its numbers are still shown."""
    why = untestable(d, key)
    return check if why is None or check.verdict.startswith("n/a") else Check(check.how, check.ours, why)


def claims_table(d: StudyData) -> Table:
    rows = tuple((c.text, c.sources, needs_text(c.key), k.how, k.ours, k.verdict)
                 for c, k in check_claims(d).values())
    caption = (
        "Paper claims from reference/paper.md §1, §6.2, §7.4–7.5, §10, each judged with its p-value or "
        f"interval: supported, contradicted, or {NOT_RESOLVED} when the data cannot tell, and "
        f"“{NOT_TESTABLE}” with the reason when the study lacks what the claim needs (the needs column: tuned "
        "= bracketed LR searches and every step size of ≥ 1 % of the parameters tuned, for every optimizer "
        "compared; depth = ≥ 2 blocks; identified ρ = ≥ 3 identified ρ_4bit; quiet timing = step times agree "
        "across seeds within 10 %). Our models are tiny and our damage measure is validation loss, so a "
        "supported claim is agreement at this scale, not a reproduction of the paper."
    )
    cols = ("paper claim", "source", "needs", "how we check", "ours", "verdict")
    return Table("claims", "Paper claims vs this study", cols, rows, caption)

"""The paper's qualitative claims next to what this study's numbers say ("ours agree?").

Each check is computed from the same files as the tables and figures (paper.md §1, §6.2, §7.4–7.5, §10).
Translation rules, stated in each row: our PTQ damage is Δ val loss (quantized − FP, lower = more robust)
where the paper uses the accuracy drop; "at most sizes" means more than half of the sizes where the named
optimizer was run. Verdicts: yes, partly, no, or n/a with the missing input named.

Left out on purpose: claims about 1.5B-only behaviour and about numbers the paper gives without a
comparable quantity here (absolute accuracies).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

from optquant.report.load import StudyData, fit_rho4
from optquant.report.paper import CLAIMS, RHO_RANKING, Claim
from optquant.report.tables import Table

G1_TOLERANCE = 0.1  # "G₁ ≈ 1" read as median |G₁ − 1| below this, per optimizer


@dataclass(frozen=True)
class Check:
    how: str
    ours: str
    agree: str  # "yes" | "partly" | "no" | "n/a: <why>"


def _winners(cells: dict, pick: Callable = min) -> dict[str, str]:
    """{size: optimizer with the min (or max) value} for sizes with at least two finite values."""
    by_size: dict[str, list[tuple[float, str]]] = {}
    for (s, o), v in cells.items():
        if np.isfinite(v):
            by_size.setdefault(s, []).append((v, o))
    return {s: pick(vs)[1] for s, vs in by_size.items() if len(vs) > 1}


def _majority(d: StudyData, winners: dict[str, str], target: str, how: str, what: str) -> Check:
    sizes = [s for s in d.sizes if s in winners]
    if not sizes:
        return Check(how, "–", f"n/a: no {what}")
    ours = "; ".join(f"{s}: {d.label(winners[s])}" for s in sizes)
    hits = sum(winners[s] == target for s in sizes)
    if target not in d.optimizers:
        return Check(how, ours, f"n/a: {d.label(target)} not in this study")
    verdict = "yes" if hits > len(sizes) / 2 else ("partly" if hits else "no")
    return Check(how, ours + f" ({hits}/{len(sizes)} sizes)", verdict)


def _by_opt(values: dict[str, float]) -> str:
    return ", ".join(f"{o} {v:.3g}" for o, v in sorted(values.items(), key=lambda x: -x[1]))


# ---------------------------------------------------------------- checks
def _fp_best(d: StudyData) -> Check:
    w = _winners(d.cell("fp", "final_val_loss", best=True))
    return _majority(d, w, "muon", "lowest best-LR final val loss per size", "best-LR runs")


def _mmr_lr(d: StudyData) -> Check:
    how = "sign of Spearman(lr, MMR) per (optimizer, size) with ≥ 2 LRs"
    for kind in ("fp", "cl"):
        df = d.rows(kind, "mmr")
        pairs = [(k, g) for k, g in df.groupby(["optimizer", "size"]) if g["lr"].nunique() >= 2]
        if pairs:
            rising = sum(stats.spearmanr(g["lr"], g["value"]).statistic > 0 for _, g in pairs)
            ours = f"MMR rises with LR in {rising}/{len(pairs)} pairs (kind={kind})"
            return Check(how, ours, "yes" if rising == len(pairs) else ("partly" if rising else "no"))
    return Check(how, "–", "n/a: MMR was not measured at several LRs of one optimizer and size")


def _mmr_low(d: StudyData) -> Check:
    w = _winners(d.cell("cl", "mmr"))
    return _majority(d, w, "muon", "lowest MMR of the CL models per size", "MMR rows")


def _ptq(d: StudyData, pick: Callable, target: str) -> Check:
    scheme = d.paper_scheme()
    how = f"{'smallest' if pick is min else 'largest'} Δ val loss under {scheme} per size"
    if scheme is None:
        return Check(how, "–", "n/a: no PTQ rows")
    return _majority(d, _winners(d.cell("cl", "delta_val_loss", scheme), pick), target, how, "Δ val loss rows")


def _corr(d: StudyData) -> tuple[dict[str, float], str] | None:
    c, scheme = d.correlations, d.paper_scheme()
    if c is None or c.empty or scheme is None:
        return None
    c = c[(c["scheme"] == scheme) & (c["target"] == "delta_val_loss")]
    for size in ("all", d.largest()):
        sub = c[c["size"].astype(str) == size]
        r = {str(m): float(v) for m, v in zip(sub["metric"], sub["pearson"], strict=True)}
        if {"mmr", "kurtosis", "R_L"} <= set(r):
            return r, f"size {size}, n={int(sub['n'].max())}"
    return None


def _rl_predicts(d: StudyData) -> Check:
    how = "|Pearson| with Δ val loss: R_L vs MMR and kurtosis; R_L should be positive (more error, more damage)"
    got = _corr(d)
    if got is None:
        return Check(how, "–", "n/a: no correlations for mmr, kurtosis and R_L")
    r, where = got
    ours = f"MMR {r['mmr']:+.2f}, kurtosis {r['kurtosis']:+.2f}, R_L {r['R_L']:+.2f} ({where})"
    if not all(math.isfinite(v) for v in r.values()):
        return Check(how, ours, "n/a: undefined correlation")
    best = abs(r["R_L"]) > max(abs(r["mmr"]), abs(r["kurtosis"]))
    return Check(how, ours, "yes" if best and r["R_L"] > 0 else ("partly" if best else "no"))


def _a_dominates(d: StudyData) -> Check:
    how = "share of chain modules (after the first) with A ≥ max(B, |C|); yes if ≥ 80 % for every optimizer"
    got = d.propagation_set()
    if got is None:
        return Check(how, "–", "n/a: no propagation.parquet files")
    size, scheme, frames = got
    share = {}
    for o, df in frames.items():
        ch = df[df["kind"] != "linear"].sort_values("index").iloc[1:]
        if len(ch):
            share[d.label(o)] = float((ch["A"] >= np.maximum(ch["B"], ch["C"].abs())).mean())
    if not share:
        return Check(how, "–", "n/a: no chain modules")
    ours = f"{size}, {scheme}: " + ", ".join(f"{o} {v:.0%}" for o, v in share.items())
    low = min(share.values())
    return Check(how, ours, "yes" if low >= 0.8 else ("partly" if low >= 0.5 else "no"))


def _linear_rows(d: StudyData) -> tuple[str, dict[str, object]] | None:
    got = d.propagation_set()
    if got is None:
        return None
    size, scheme, frames = got
    lin = {o: df[df["kind"] == "linear"] for o, df in frames.items()}
    lin = {o: df for o, df in lin.items() if len(df)}
    return (f"{size}, {scheme}", lin) if lin else None


def _g1_one(d: StudyData) -> Check:
    how = f"median |G₁ − 1| over linear layers below {G1_TOLERANCE} for every optimizer"
    got = _linear_rows(d)
    if got is None:
        return Check(how, "–", "n/a: no linear-layer rows in propagation.parquet")
    where, lin = got
    dev = {d.label(o): float(np.nanmedian(np.abs(df["G1"] - 1.0))) for o, df in lin.items()}
    dev = {o: v for o, v in dev.items() if np.isfinite(v)}
    if not dev:
        return Check(how, where, "n/a: G1 is NaN everywhere")
    ours = f"{where}: " + ", ".join(f"{o} {v:.3f}" for o, v in dev.items())
    ok = sum(v < G1_TOLERANCE for v in dev.values())
    return Check(how, ours, "yes" if ok == len(dev) else ("partly" if ok else "no"))


def _gain_rank(d: StudyData) -> Check:
    how = "mean gain G over linear layers: Muon highest, AdamW and Shampoo the two lowest"
    got = _linear_rows(d)
    if got is None:
        return Check(how, "–", "n/a: no linear-layer rows in propagation.parquet")
    where, lin = got
    g = {o: float(np.nanmean(df["G"])) for o, df in lin.items()}
    g = {o: v for o, v in g.items() if np.isfinite(v)}
    if len(g) < 3 or not {"muon", "adamw", "shampoo"} <= set(g):
        return Check(how, f"{where}: {_by_opt(g)}", "n/a: needs Muon, AdamW, Shampoo and ≥ 3 optimizers")
    order = sorted(g, key=g.get)
    top, bottom = order[-1] == "muon", set(order[:2]) == {"adamw", "shampoo"}
    verdict = "yes" if top and bottom else ("partly" if top or bottom else "no")
    return Check(how, f"{where}: " + _by_opt({d.label(o): v for o, v in g.items()}), verdict)


def _qat_least(d: StudyData) -> Check:
    w = _winners(d.cell("qat", "qat_rel_degradation_pct", scheme=None))
    return _majority(d, w, "shampoo", "smallest relative QAT val-loss gap per size", "QAT rows")


def _qat_not_fp(d: StudyData) -> Check:
    how = "per size: optimizer with the lowest FP loss vs the lowest QAT loss"
    fp = _winners(d.cell("fp", "final_val_loss", best=True))
    qat = _winners(d.cell("qat", "final_val_loss", scheme=None))
    sizes = [s for s in d.sizes if s in fp and s in qat]
    if not sizes:
        return Check(how, "–", "n/a: needs FP and QAT runs at one size")
    ours = "; ".join(f"{s}: FP {d.label(fp[s])}, QAT {d.label(qat[s])}" for s in sizes)
    differ = sum(fp[s] != qat[s] for s in sizes)
    return Check(how, ours, "yes" if differ > len(sizes) / 2 else ("partly" if differ else "no"))


def _rhos(d: StudyData) -> dict[str, float]:
    per = (d.fits or {}).get("per_optimizer") or {}
    rho = {o: fit_rho4(f.get("rho")) for o, f in per.items()}
    return {o: v for o, v in rho.items() if math.isfinite(v)}


def _rho_rank(d: StudyData) -> Check:
    how = "our ρ_4bit order vs the paper's, over the optimizers in both (Spearman)"
    rho = {o: v for o, v in _rhos(d).items() if o in RHO_RANKING}
    if len(rho) < 2:
        return Check(how, "–", "n/a: fewer than two fitted optimizers")
    ours_order = sorted(rho, key=lambda o: -rho[o])
    paper_order = [o for o in RHO_RANKING if o in rho]
    rs = stats.spearmanr([paper_order.index(o) for o in rho], [ours_order.index(o) for o in rho]).statistic
    ours = " > ".join(d.label(o) for o in ours_order) + f" (Spearman {rs:+.2f})"
    return Check(how, ours, "yes" if ours_order == paper_order else ("partly" if rs > 0 else "no"))


def _ptq_qat_link(d: StudyData) -> Check:
    how = "Spearman over optimizers of mean Δ val loss (PTQ, all sizes) vs ρ_4bit; expected negative"
    rho, scheme = _rhos(d), d.paper_scheme()
    dl = d.cell("cl", "delta_val_loss", scheme) if scheme else {}
    mean_dl = {o: float(np.mean([v for (s, p), v in dl.items() if p == o])) for o in rho if any(p == o for _, p in dl)}
    if len(mean_dl) < 3:
        return Check(how, "–", "n/a: needs PTQ damage and ρ_4bit for ≥ 3 optimizers")
    r = stats.spearmanr([mean_dl[o] for o in mean_dl], [rho[o] for o in mean_dl]).statistic
    return Check(how, f"Spearman {r:+.2f} over {len(mean_dl)} optimizers", "yes" if r < 0 else "no")


def _shampoo_cost(d: StudyData) -> Check:
    how = "Shampoo / AdamW mean step time at the largest size with both"
    t = d.cell("fp", "mean_step_seconds")
    sizes = [s for s in d.sizes if (s, "shampoo") in t and (s, "adamw") in t]
    if not sizes:
        return Check(how, "–", "n/a: needs timed Shampoo and AdamW runs")
    s = sizes[-1]
    ratio = t[(s, "shampoo")] / t[(s, "adamw")]
    return Check(how, f"{s}: {ratio:.2f}× (paper 760M: 1.33×)", "yes" if ratio > 1 else "no")


_CHECKS: dict[str, Callable[[StudyData], Check]] = {
    "fp_best": _fp_best,
    "mmr_lr": _mmr_lr,
    "mmr_low": _mmr_low,
    "ptq_least": lambda d: _ptq(d, min, "shampoo"),
    "ptq_most": lambda d: _ptq(d, max, "muon"),
    "rl_predicts": _rl_predicts,
    "a_dominates": _a_dominates,
    "g1_one": _g1_one,
    "gain_rank": _gain_rank,
    "qat_least": _qat_least,
    "qat_not_fp": _qat_not_fp,
    "rho_rank": _rho_rank,
    "ptq_qat_link": _ptq_qat_link,
    "shampoo_cost": _shampoo_cost,
}


def check_claims(d: StudyData) -> dict[str, tuple[Claim, Check]]:
    return {c.key: (c, _CHECKS[c.key](d)) for c in CLAIMS}


def claims_table(d: StudyData) -> Table:
    rows = tuple((c.text, c.sources, k.how, k.ours, k.agree) for c, k in check_claims(d).values())
    caption = (
        "Paper claims from reference/paper.md §1, §6.2, §7.4–7.5, §10. Our models are tiny and our damage "
        "measure is validation loss, so agreement here is suggestive, not a replication."
    )
    cols = ("paper claim", "source", "how we check", "ours", "ours agree?")
    return Table("claims", "Paper claims vs this study", cols, rows, caption)

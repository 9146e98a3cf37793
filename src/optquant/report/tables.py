"""The paper's tables rebuilt from a study's results: Table 2 (FP), 3 (PTQ), 4 (QAT), 10 (fits), plus cost.

A `Table` holds formatted cells, so the HTML page and the markdown summary print the same numbers. Each
table's caption names the file and the rows it was made from; a table with nothing to show carries a
`missing` reason instead of rows. Our quantity is validation loss (lower is better) where the paper's is
average zero-shot accuracy (higher is better); the paper's own numbers are separate tables built by
`paper_table` and styled apart (paper.md §10). A study that ran lm-eval tasks (`eval.tasks`) also gets
accuracy as the paper reports it: Table 3c, zero-shot acc_norm in % of the CL models before and after PTQ.

Every headline number is mean ± sd [95 % t-interval] (n seeds) and every ranking is a ranking with ties
from paired sign-flip tests (optquant.stats): per size over seeds, and pooled over sizes as blocks.

Left out on purpose: re-deriving the paper's accuracy numbers from ours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from optquant.report.load import StudyData, fit_interval, fit_rho4, fmt, fmt_bytes, fmt_ci, fmt_lr
from optquant.report.paper import LABELS, PaperGrid
from optquant.stats import ALPHA, NOT_RESOLVED, Ranking, min_p, rank_with_ties, summarize

NOT_RUN = "not run in this study"


@dataclass(frozen=True)
class Table:
    key: str
    title: str
    columns: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    caption: str = ""
    missing: str = ""  # non-empty: nothing to show, and why
    bold: frozenset[tuple[int, int]] = field(default_factory=frozenset)  # (row, column) cells to emphasize
    paper: bool = False  # the paper's reference values, not ours


def _missing(key: str, title: str, why: str) -> Table:
    return Table(key, title, missing=f"{NOT_RUN}: {why}")


@dataclass(frozen=True)
class Quantity:
    """One column group of a seed table: a metric's rows, how to show it, which way is better."""

    label: str
    kind: str
    metric: str
    scheme: str | None = "none"
    best: bool | None = None
    lower_is_better: bool = True
    digits: int = 4
    signed: bool = False
    scale: float = 1.0  # shown as value × scale (100: a fraction as %)


def _ranks(df: pd.DataFrame, q: Quantity) -> tuple[dict[str, Ranking], Ranking | None]:
    """Per-size rankings (units: seeds) and the pooled one (units: (size, seed) blocks)."""
    per = {}
    for s, g in df.groupby("size"):
        per[str(s)] = rank_with_ties({o: x.set_index("seed")["value"] for o, x in g.groupby("optimizer")},
                                     lower_is_better=q.lower_is_better)  # fmt: skip
    pooled = None
    if df["size"].nunique() > 1:
        pooled = rank_with_ties({o: x.set_index(["size", "seed"])["value"] for o, x in df.groupby("optimizer")},
                                lower_is_better=q.lower_is_better)  # fmt: skip
    return per, pooled


def _rank_note(per: dict[str, Ranking], pooled: Ranking | None) -> str:
    n = max((r.n_units for r in per.values()), default=0)
    text = (
        f" Rank = 1 + number of optimizers significantly better (paired exact sign-flip test over seeds, "
        f"two-sided, Holm-corrected over the pairs, α = {ALPHA}); equal ranks (=) are not told apart. "
        f"With {n} seed(s) per size the smallest attainable p is {min_p(n):.3g}"
    )
    if per and not any(r.resolved() for r in per.values()):
        text += f", so per-size ranks are {NOT_RESOLVED}"
    if pooled is not None:
        text += (f". Pooled: the sizes as blocks, {pooled.n_units} paired (size, seed) units, smallest p "
                 f"{min_p(pooled.n_units):.3g}")  # fmt: skip
        if not pooled.resolved():
            text += f" (with {len(pooled.pairs)} pairs under Holm, {NOT_RESOLVED})"
    return text + "."


def seed_table(d: StudyData, key: str, title: str, quantities: Sequence[Quantity], source: str) -> Table:
    """Rows (size, optimizer): per quantity 'mean ± sd [95 % t-CI] (n)' and its rank with ties within the
    size; then a 'pooled' row per optimizer with its rank over all sizes."""
    frames = {q.label: d.seeds(q.kind, q.metric, q.scheme, q.best) for q in quantities}
    if all(f.empty for f in frames.values()):
        return _missing(key, title, f"no rows for {', '.join(q.metric for q in quantities)} in results.parquet")
    ranks = {q.label: _ranks(frames[q.label], q) for q in quantities if not frames[q.label].empty}
    cols = ["size", "optimizer"]
    for q in quantities:
        cols += [f"{q.label} mean ± sd [95 % CI] (n)", f"{q.label} rank"]
    keys = sorted({(s, o) for f in frames.values() for s, o in zip(f["size"], f["optimizer"], strict=True)},
                  key=lambda k: (d.sizes.index(k[0]) if k[0] in d.sizes else 99, _order(d, k[1])))  # fmt: skip
    rows: list[tuple[str, ...]] = []
    bold: set[tuple[int, int]] = set()
    for s, o in keys:
        row = [d.size_label(s), d.label(o)]
        for j, q in enumerate(quantities):
            f = frames[q.label]
            v = f.loc[(f["size"] == s) & (f["optimizer"] == o), "value"]
            r = ranks.get(q.label, ({}, None))[0].get(s)
            row += [summarize(v * q.scale).text(q.digits, q.signed), r.label(o) if r and o in r.rank else "–"]
            if r and r.rank.get(o) == 1 and not r.tied(o):
                bold.add((len(rows), 2 + 2 * j))
        rows.append(tuple(row))
    opts = sorted({o for _, o in keys}, key=lambda o: _order(d, o))
    if any(p is not None for _, p in ranks.values()):
        for o in opts:
            row = ["pooled (all sizes)", d.label(o)]
            for q in quantities:
                pooled = ranks.get(q.label, ({}, None))[1]
                n = int(frames[q.label]["optimizer"].eq(o).sum())
                row += [f"(n={n} units)", pooled.label(o) if pooled and o in pooled.rank else "–"]
            rows.append(tuple(row))
    first = next(iter(ranks.values()), ({}, None))
    caption = f"From results.parquet: {source}. Interval: Student-t 95 % over seeds." + _rank_note(*first)
    return Table(key, title, tuple(cols), tuple(rows), caption, bold=frozenset(bold))


def _order(d: StudyData, o: str) -> int:
    return d.optimizers.index(o) if o in d.optimizers else 99


# ---------------------------------------------------------------- Table 2
def table2(d: StudyData) -> Table:
    title = "Table 2 — full-precision final validation loss at each optimizer's best LR"
    q = Quantity("val loss", "fp", "final_val_loss", best=True)
    t = seed_table(d, "table2", title, [q], "kind=fp, best_lr=True, scheme=none, metric=final_val_loss")
    if t.missing:
        return t
    df = d.rows("fp", "final_val_loss", "none", best=True)
    groups = df.groupby(["size", "optimizer"])
    lr = {(d.size_label(s), d.label(o)): fmt_lr(float(g["lr"].iloc[0])) for (s, o), g in groups}
    rows = tuple((*r[:2], lr.get((r[0], r[1]), "–"), *r[2:]) for r in t.rows)
    bold = frozenset((i, j + 1) for i, j in t.bold)
    return replace(t, columns=(*t.columns[:2], "best LR", *t.columns[2:]), rows=rows, bold=bold)


# ---------------------------------------------------------------- Table 3
def table3(d: StudyData, scheme: str) -> Table:
    title = f"Table 3 — Common-Loss models under PTQ scheme {scheme}: Δ validation loss"
    qs = [Quantity("Δ val loss", "cl", "delta_val_loss", scheme, signed=True)]
    src = f"kind=cl, scheme={scheme}, Δ = quantized − FP of each CL model (one per seed)"
    if d.has("cl", "delta_acc_norm"):
        qs.append(Quantity("Δ acc_norm", "cl", "delta_acc_norm", scheme, lower_is_better=False, signed=True))
    elif d.tasks():  # the lm-eval tasks' accuracy drop (their mean, with several), in points
        task = d.tasks()[0]
        qs.append(Quantity(f"Δ acc_norm % ({d.task_label(task)})", "cl", f"delta_acc_norm/{task}", scheme,
                           lower_is_better=False, digits=2, signed=True, scale=100))
        src += f"; Δ acc_norm: lm-eval zero-shot, metric delta_acc_norm/{task} × 100"
    return seed_table(d, f"table3-{scheme}", title, qs, src)


def task_table(d: StudyData, task: str, scheme: str) -> Table:
    """Table 3c: zero-shot accuracy (lm-eval acc_norm, %) of the CL models in FP and after PTQ `scheme`,
    and its change, as the paper reports PTQ (its Table 3 is post-PTQ accuracy)."""
    label = d.task_label(task)
    title = f"Table 3c — zero-shot accuracy on {label} (lm-eval acc_norm, %) before and after {scheme}"
    acc = {"lower_is_better": False, "digits": 2, "scale": 100.0}
    qs = [Quantity("acc_norm FP", "cl", f"acc_norm/{task}", "none", **acc),
          Quantity(f"acc_norm {scheme}", "cl", f"acc_norm/{task}", scheme, **acc),
          Quantity("Δ acc_norm", "cl", f"delta_acc_norm/{task}", scheme, signed=True, **acc)]
    parts = [t for t in d.tasks() if t != "avg"] if task == "avg" else [task]
    items = ", ".join(f"{t}: {_items(d, t)}" for t in parts)
    src = (f"kind=cl, metric acc_norm/{task} (scheme=none: the FP model; scheme={scheme}: its quantized copy) and "
           f"delta_acc_norm/{task} = quantized − FP, all × 100; lm-eval zero-shot, items per model {items}; "
           f"unnormalised accuracy: acc/{task}")
    return seed_table(d, f"table3c-{task}", title, qs, src)


def task_tables(d: StudyData, scheme: str) -> list[Table]:
    """One Table 3c per lm-eval task the study ran ("avg" first); none without tasks."""
    return [task_table(d, t, scheme) for t in d.tasks()]


def _items(d: StudyData, task: str) -> str:
    n = d.rows("cl", f"n/{task}")["value"]
    return "–" if n.empty else "/".join(f"{v:.0f}" for v in sorted(set(n)))


def table3_schemes(d: StudyData) -> Table:
    """Δ val loss of the CL models under every PTQ scheme, with ranks within each size."""
    title = "Table 3b — Δ validation loss by PTQ scheme"
    schemes = d.schemes("cl")
    if not schemes:
        return _missing("table3b", title, "no kind=cl rows with metric delta_val_loss")
    qs = [Quantity(s, "cl", "delta_val_loss", s, signed=True) for s in schemes]
    return seed_table(d, "table3b", title, qs, f"kind=cl, metric=delta_val_loss, schemes {', '.join(schemes)}")


# ---------------------------------------------------------------- Table 4
def table4(d: StudyData) -> Table:
    title = "Table 4 — QAT (QuEST W4A4): relative validation-loss gap to FP and QAT loss"
    qs = [Quantity("rel. gap (%)", "qat", "qat_rel_degradation_pct", None, digits=2, signed=True),
          Quantity("QAT loss", "qat", "final_val_loss", None)]  # fmt: skip
    src = ("kind=qat, metrics qat_rel_degradation_pct (QAT loss vs its FP best-LR twin, positive = worse) and "
           "final_val_loss. The paper reports accuracy, where worse is negative")  # fmt: skip
    return seed_table(d, "table4", title, qs, src)


# ---------------------------------------------------------------- outliers per optimizer
def outlier_table(d: StudyData) -> Table:
    """MMR (both aggregations) and R_L of the CL models per optimizer, with intervals and ranks."""
    title = "MMR and R_L of the Common-Loss models"
    scheme = d.paper_scheme()
    qs = [Quantity("MMR per-token", "cl", "mmr", digits=2)]
    if d.has("cl", "mmr_batchavg"):
        qs.append(Quantity("MMR batch-avg", "cl", "mmr_batchavg", digits=2))
    if scheme:
        qs.append(Quantity(f"R_L ({scheme})", "cl", "R_L", scheme))
    src = ("kind=cl; mmr = per-token max/median |x| averaged over tokens (paper.md §6.1), mmr_batchavg = the "
           "authors' code's batch-averaged features (scheme=none); R_L = relative output error after PTQ. "
           "Lower ranks first")  # fmt: skip
    return seed_table(d, "outliers", title, qs, src)


# ---------------------------------------------------------------- Common Loss models
def cl_table(d: StudyData) -> Table:
    """Each CL model's own fp32 validation loss next to its size's threshold, and the spread per size."""
    title = "Common-Loss models: their own validation loss and the spread within each size"
    loss = d.rows("cl", "val_loss")
    if loss.empty:
        return _missing("cl", title, "no kind=cl rows with metric val_loss")
    thr = d.rows("cl", "cl_threshold").set_index("run_id")["value"]
    step = d.rows("cl", "cl_step").set_index("run_id")["value"]
    rows = []
    for s in [x for x in d.sizes if x in set(loss["size"])]:
        g = loss[loss["size"] == s].sort_values(["optimizer", "seed"], key=lambda c: c.map(str))
        for r in g.itertuples():
            t = float(thr.get(r.run_id, math.nan))
            st = step.get(r.run_id)
            rows.append((d.size_label(s), d.label(r.optimizer), str(r.seed), fmt(r.value), fmt(t),
                         _signed(r.value - t), "–" if st is None else f"{st:.0f}"))  # fmt: skip
        v = g["value"].to_numpy(dtype=float)
        rows.append((d.size_label(s), "spread (max − min)", f"{len(v)} models", fmt(float(np.ptp(v))), "", "", ""))
    caption = (
        "From results.parquet kind=cl, scheme=none: val_loss (the fp32 evaluator that also measures PTQ "
        "damage), cl_threshold (the size's Common Loss) and cl_step (the checkpoint's step)."
    )
    cols = ("size", "optimizer", "seed", "val loss", "CL threshold", "loss − CL", "step")
    return Table("cl", title, cols, tuple(rows), caption)


# ---------------------------------------------------------------- LR search
BRACKETED = ("bracketed", "refined")


def lr_status_table(d: StudyData) -> Table:
    """The (optimizer, size) LR searches whose best LR is not bracketed by worse neighbours, with the reason."""
    title = "LR searches left unbracketed"
    if not d.best:
        return _missing("lr-status", title, "no best.json")
    rows = []
    for k, r in sorted(d.best.items()):
        status = r.get("status") or ("edge" if r.get("edge") else "bracketed")
        if status in BRACKETED:
            continue
        opt, _, size = k.partition("/")
        reason = r.get("reason") or ("best LR at the grid edge" if status == "edge" else "")
        lr = r.get("best_lr")
        rows.append((d.size_label(size), d.label(opt), fmt_lr(math.nan if lr is None else float(lr)), status, reason))
    n = len(d.best)
    if not rows:
        return Table("lr-status", title, ("size", "optimizer"), (), f"From best.json: all {n} LR searches "
                     "are bracketed (the best LR has a worse neighbour on both sides).")  # fmt: skip
    caption = (
        f"From best.json: {len(rows)} of {n} (optimizer, size) searches whose best LR lacks a worse "
        "neighbour on one side (cap: the extension limit was reached; diverged: the next point diverged). "
        "Their optimizer is compared possibly untuned."
    )
    return Table("lr-status", title, ("size", "optimizer", "best LR", "status", "reason"), tuple(rows), caption)


def _signed(v: float | None, digits: int = 4) -> str:
    return "–" if v is None or not np.isfinite(v) else f"{v:+.{digits}f}"


# ---------------------------------------------------------------- Table 10
def _not_identified(fit: dict, name: str, whole: str = "") -> str:
    """"not identified (why)" for parameter `name` of a fits.json entry, or "" if its diagnostics (when
    stored; older files have none) found nothing against it; reasons under "fit" apply to every parameter
    (given as `whole` instead, when set, so a table can state them once)."""
    reasons = (fit.get("diagnostics") or {}).get("reasons") or {}
    own = [reasons[name]] if name in reasons else []
    fit_wide = ([whole] if whole else [reasons["fit"]]) if "fit" in reasons else []
    why = "; ".join(fit_wide + own)
    return f"not identified ({why})" if why else ""


def _by_label(names) -> list[str]:
    return sorted(names, key=lambda x: (x not in LABELS, list(LABELS).index(x) if x in LABELS else 0, x))


def table10(d: StudyData) -> Table:
    title = "Table 10 — per-optimizer scaling-law fits, L(N) = A/(N·ρ)^α + E"
    per = (d.fits or {}).get("per_optimizer") or {}
    if not per:
        return _missing("table10", title, "no fits.json (or no per-optimizer fits in it)")
    rows = []
    for o in _by_label(per):
        f = per[o]
        iv = f.get("intervals") or {}
        rho = fit_rho4(f.get("rho"))
        notes = ", ".join(f.get("at_bound") or []) or ""
        rows.append(
            (
                d.label(o),
                _not_identified(f, "rho_4bit") or fmt_ci(rho, fit_interval(iv, "rho_4bit", "rho")),
                fmt_ci(float(f["E"]), fit_interval(iv, "E")),
                fmt_ci(float(f["alpha"]), fit_interval(iv, "alpha")),
                f"{float(f['A']):.4g}",
                str(f.get("n_points", "–")),
                f"at bound: {notes}" if notes else "",
            )
        )
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
        return _missing("table10b", title, "no joint fit in fits.json")
    iv = j.get("intervals") or {}
    rho_fp = j.get("rho_fp") or {}
    rows = []
    for o in sorted(j.get("rho") or {}, key=lambda x: list(LABELS).index(x) if x in LABELS else 99):
        fp = fmt_ci(float(rho_fp.get(o, 1.0)), fit_interval(iv, f"rho_fp/{o}"))
        if o == j.get("reference"):
            fp += " (reference)"
        rows.append(
            (
                d.label(o),
                _not_identified(j, f"rho_fp/{o}", "whole fit, see below") or fp,
                _not_identified(j, f"rho_4bit/{o}", "whole fit, see below")
                or fmt_ci(fit_rho4(j["rho"][o]), fit_interval(iv, f"rho_4bit/{o}", f"rho/{o}", o)),
            )
        )
    shared = f"A = {float(j['A']):.4g}, " + ", ".join(
        f"{n} = {fmt_ci(float(j[k]), fit_interval(iv, k))}" for n, k in (("α", "alpha"), ("E", "E"))
    )
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
    from optquant.scaling import FitConfig  # the thresholds optquant.study.results judges with

    cfg = FitConfig()
    title = "Table 10c — scaling-fit diagnostics"
    fits = d.fits or {}
    per = fits.get("per_optimizer") or {}
    entries = [(f"{d.label(o)} (per optimizer)", per[o], "rho_4bit") for o in _by_label(per)]
    if fits.get("joint"):
        entries.append(("joint (headline)", fits["joint"], "rho_4bit/"))
    if not entries:
        return _missing("table10c", title, "no fits in fits.json")
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
        corr = np.array([[math.nan if c is None else c for c in row] for row in g["correlation"]], dtype=float)
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
        reasons = g.get("reasons") or {}
        rows.append((
            name, str(f.get("n_points", "–")),
            f"{g['n_sizes']} over {g['size_span']:.3g}×" if g.get("size_span") else str(g["n_sizes"]),
            fmt(100 * g["residual_rms"], 2) if g.get("residual_rms") is not None else "–",
            top,
            f"{g['condition']:.3g}" if g.get("condition") is not None else "∞",
            ", ".join(f.get("at_bound") or []) or "none",
            f"{width} ({spread})",
            "not identified: " + "; ".join(reasons.values()) if reasons else "identified",
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


# ---------------------------------------------------------------- cost
def cost_table(d: StudyData) -> Table:
    title = "Cost — step time and optimizer-state memory, as ratios to AdamW"
    step = d.cell("fp", "mean_step_seconds")
    if not step:
        return _missing("cost", title, "no kind=fp rows with metric mean_step_seconds")
    mem, tps = d.cell("fp", "optimizer_state_bytes"), d.cell("fp", "tokens_per_s")
    ns = d.summary_values("fp", "mean_step_seconds", "ns_dtype")  # Muon's/Scion's Newton–Schulz dtype
    rows = []
    for s in d.sizes:
        for o in d.optimizers:
            if (s, o) not in step:
                continue
            rows.append(
                (
                    d.size_label(s),
                    d.label(o),
                    fmt(step[(s, o)], 4),
                    _ratio(step[(s, o)], step.get((s, "adamw"))),
                    f"{tps[(s, o)]:,.0f}" if (s, o) in tps else "–",
                    fmt_bytes(mem.get((s, o))),
                    _ratio(mem.get((s, o)), mem.get((s, "adamw"))),
                    ns.get((s, o), "–"),
                )
            )
    caption = (
        "From results.parquet: kind=fp, metrics mean_step_seconds, tokens_per_s, optimizer_state_bytes, "
        "averaged over all of the (optimizer, size)'s LR-sweep runs. Timings are on the study's hardware. "
        "Newton–Schulz: the dtype Muon's and Scion's orthogonalisation ran in (runs/<run_id>/summary.json "
        "ns_dtype; `auto` picks bf16 only where the hardware multiplies bf16 natively)."
    )
    cols = ("size", "optimizer", "step time (s)", "× AdamW", "tokens/s", "optimizer state", "× AdamW ",
            "Newton–Schulz")
    return Table("cost", title, cols, tuple(rows), caption)


def _ratio(v: float | None, ref: float | None) -> str:
    if v is None or ref is None or not (np.isfinite(v) and np.isfinite(ref)) or ref <= 0:
        return "–"
    return f"{v / ref:.2f}×"


# ---------------------------------------------------------------- correlations
CORR_METRICS = ("R_L", "mmr", "mmr_batchavg", "kurtosis")


def _r(x, m: str) -> str:
    r, lo, hi, p = (getattr(x, f"{m}{s}", math.nan) for s in ("", "_lo", "_hi", "_p"))
    if not np.isfinite(r):
        return "–"
    return f"{r:+.2f} [{fmt(lo, 2)}, {fmt(hi, 2)}] p={p:.2g}"


def correlation_table(d: StudyData, scheme: str | None = None, target: str = "delta_val_loss") -> Table:
    """Within-size correlations of each predictor with PTQ damage, largest size first (the headline, the
    paper's setting), then the other sizes, then the pooled one, labelled as such."""
    scheme = scheme or d.paper_scheme() or "w4a4-rtn"
    title = f"Correlation with PTQ damage ({target}, {scheme}) within each size"
    c = d.correlations
    if c is None or c.empty or "pearson_partial" not in c:
        return _missing(f"correlations-{scheme}", title, "no correlations.parquet with partial correlations")
    c = c[(c["scheme"] == scheme) & (c["target"] == target)]
    if c.empty:
        return _missing(f"correlations-{scheme}", title, f"no correlations for {scheme}/{target}")
    sizes = [s for s in reversed(d.sizes) if s in set(c["size"])] + (["pooled"] if "pooled" in set(c["size"]) else [])
    metrics = [m for m in CORR_METRICS if m in set(c["metric"])] + sorted(set(c["metric"]) - set(CORR_METRICS))
    rows = []
    for s in sizes:
        label = "pooled (all sizes)" if s == "pooled" else d.size_label(s)
        for x in c[c["size"] == s].set_index("metric").reindex(metrics).dropna(how="all").itertuples():
            n = f"{int(x.n)} ({int(x.n_cl)} CL)" if "n_cl" in c else str(int(x.n))
            rows.append((label, str(x.Index), n, _r(x, "pearson"), _r(x, "spearman"), _r(x, "pearson_partial"),
                         _r(x, "spearman_partial")))  # fmt: skip
    caption = (
        f"From correlations.parquet (scheme={scheme}, target={target}): models are every FP sweep run and "
        "Common-Loss model with PTQ rows, diverged runs left out; n per cell. Cell: r [95 % bootstrap CI] "
        "p. Partial: controlling for the model's FP validation loss (residuals of a linear regression, p "
        "from t with n − 3 dof). The first size is the headline (within one size, as in the paper); pooled "
        "mixes sizes whose damage differs and comes last. Δ = quantized − FP, so the paper's accuracy-based "
        "signs flip. mmr is per-token (paper.md §6.1), mmr_batchavg the authors' code's batch average."
    )
    cols = ("size", "metric", "n", "Pearson", "Spearman", "partial Pearson (FP loss)", "partial Spearman (FP loss)")
    return Table(f"correlations-{scheme}", title, cols, tuple(rows), caption)


# ---------------------------------------------------------------- paper side tables
def paper_table(grid: PaperGrid, key: str) -> Table:
    rows = []
    for s in grid.sizes:
        cells = []
        for o in grid.optimizers:
            v = grid.get(s, o)
            note = grid.notes.get((s, o))
            cells.append("n/a" if v is None else f"{v:.{grid.digits.get(s, 2)}f}{note or ''}")
        rows.append((s, *cells))
    caption = f"paper, {grid.sources}. Unit: {grid.unit or 'as named'}. {grid.footnote}".strip()
    cols = ("paper" if grid.unit else "quantity", *(LABELS[o] for o in grid.optimizers))
    return Table(key, f"paper — {grid.title}", cols, tuple(rows), caption, paper=True)


def paper_values_table(key: str, title: str, values: dict[str, float], sources: str, head: str) -> Table:
    rows = tuple((LABELS.get(k, k), f"{v:.2f}") for k, v in values.items())
    return Table(key, f"paper — {title}", ("paper", head), rows, f"paper, {sources}.", paper=True)


# ---------------------------------------------------------------- markdown
def to_markdown(t: Table) -> str:
    head = f"### {t.title}\n\n"
    if t.missing:
        return head + f"_{t.missing}_\n"

    def cell(i: int, j: int, v: str) -> str:
        v = v.replace("|", "\\|")
        return f"**{v}**" if (i, j) in t.bold else v

    lines = ["| " + " | ".join(c.replace("|", "\\|") for c in t.columns) + " |", "|" + "---|" * len(t.columns)]
    lines += ["| " + " | ".join(cell(i, j, v) for j, v in enumerate(r)) + " |" for i, r in enumerate(t.rows)]
    return head + "\n".join(lines) + ("\n\n" + t.caption if t.caption else "") + "\n"

"""Tables beside the paper's that show how far to trust them: the Common-Loss models, the LR searches left
unbracketed, each optimizer's step time and memory, and the correlations of outlier metrics with PTQ damage.

Same conventions as tables.py: formatted cells, a caption naming the file and rows each table was made
from, and a `missing` reason instead of rows when the study did not produce them.
"""

from __future__ import annotations

import math

import numpy as np

from optquant.report.figures import damage_frame, loo_range
from optquant.report.load import StudyData, fmt, fmt_bytes, fmt_lr
from optquant.report.tables import Table, not_run, opt_order


# ---------------------------------------------------------------- Common Loss models
def cl_table(d: StudyData) -> Table:
    """Each CL model's own fp32 validation loss next to its size's threshold, and the spread per size."""
    title = "Common-Loss models: their own validation loss and the spread within each size"
    loss = d.rows("cl", "val_loss")
    if loss.empty:
        return not_run("cl", title, "no kind=cl rows with metric val_loss")
    thr = d.rows("cl", "cl_threshold").set_index("run_id")["value"]
    step = d.rows("cl", "cl_step").set_index("run_id")["value"]
    rows = []
    for s in [x for x in d.sizes if x in set(loss["size"])]:
        g = loss[loss["size"] == s].sort_values(["optimizer", "seed"], key=lambda c: c.map(str))
        for r in g.itertuples():
            t = float(thr.get(r.run_id, math.nan))
            st = step.get(r.run_id)
            rows.append((d.size_label(s), d.label(r.optimizer), str(r.seed), fmt(r.value), fmt(t),
                         fmt(r.value - t, signed=True), "–" if st is None else f"{st:.0f}"))  # fmt: skip
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
        return not_run("lr-status", title, "no best.json")
    rows = []
    for (opt, size), r in sorted(d.best.items()):
        status = r.get("status") or ("edge" if r.get("edge") else "bracketed")
        if status in BRACKETED:
            continue
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

# ---------------------------------------------------------------- step sizes
RULES = {"searched": "searched: the LR search at each size",
         "tied": "tied: ratio × LR, the ratio searched at each size",
         "tied-fixed": "tied: a fixed ratio × LR (not searched)", "fixed": "fixed (the authors' value, not searched)"}


def tuning_table(d: StudyData) -> Table:
    """Every step size of every optimizer: the LR it used at each size, how it was chosen, and the share of
    the parameters it moves (best.json's `groups`, read off the best runs' built optimizers)."""
    title = "Tuning — every step size, how it was chosen, and the share of parameters it moves"
    if not d.best or not any(r.get("groups") for r in d.best.values()):
        return not_run("tuning", title, "no step-size groups in best.json")
    sizes = [s for s in d.sizes if any(size == s for _, size in d.best)]
    cells: dict[tuple[str, str, str], dict[str, str]] = {}
    share: dict[tuple[str, str, str], float] = {}
    for (opt, size), r in d.best.items():
        for g in r.get("groups") or []:
            key = (opt, g["group"], g["rule"])
            ratio = f" ({g['ratio']:.3g} × LR)" if g["rule"] in ("tied", "tied-fixed") else ""
            status = r.get("ratio_status", {}).get(g.get("field") or "", r.get("status", "")) or ""
            flag = "" if status in (*BRACKETED, "diverged") else f", {status}"
            cells.setdefault(key, {})[size] = fmt_lr(float(g["lr"])) + ratio + flag
            if size == sizes[-1] or key not in share:
                share[key] = float(g["share"])
    rows = tuple((d.label(o), g.replace("+", " + "), f"{share[(o, g, rule)]:.1%}", RULES.get(rule, rule),
                  *(cells[(o, g, rule)].get(s, "–") for s in sizes))
                 for o, g, rule in sorted(cells, key=lambda k: (opt_order(d, k[0]), k[1])))
    caption = (f"From best.json: each optimizer's parameter groups as built for its best run at each size (seed "
               f"{d.search_seed}), their LR (peak, before the schedule) and rule; share of parameters at the largest "
               "size. "
               "A flag after the LR names a search that ended unbracketed (cap). A fixed step size moving ≥ 1 % "
               "of the parameters leaves its optimizer untuned: claims comparing it are not testable.")
    return Table("tuning", title, ("optimizer", "parameter group", "share", "how chosen",
                                   *(d.size_label(s) for s in sizes)), rows, caption)


# ---------------------------------------------------------------- cost
def cost_table(d: StudyData) -> Table:
    title = "Cost — step time and optimizer-state memory, as ratios to AdamW"
    step = d.cell("fp", "mean_step_seconds")
    if not step:
        return not_run("cost", title, "no kind=fp rows with metric mean_step_seconds")
    mem, tps = d.cell("fp", "optimizer_state_bytes"), d.cell("fp", "tokens_per_s")
    ns = d.summary_values("fp", "mean_step_seconds", "ns_dtype")  # Muon's/Scion's Newton–Schulz dtype
    rows = [(d.size_label(s), d.label(o), fmt(step[(s, o)], 4), _ratio(step[(s, o)], step.get((s, "adamw"))),
             f"{tps[(s, o)]:,.0f}" if (s, o) in tps else "–", fmt_bytes(mem.get((s, o))),
             _ratio(mem.get((s, o)), mem.get((s, "adamw"))), ns.get((s, o), "–"))
            for s in d.sizes for o in d.optimizers if (s, o) in step]
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


def correlation_table(d: StudyData, scheme: str, target: str = "delta_val_loss") -> Table:
    """Within-size correlations of each predictor with PTQ damage, largest size first (the headline, the
    paper's setting), then the other sizes, then the pooled one, labelled as such."""
    title = f"Correlation with PTQ damage ({target}, {scheme}) within each size"
    c = d.correlations
    if c is None or c.empty or "pearson_partial" not in c:
        return not_run(f"correlations-{scheme}", title, "no correlations.parquet with partial correlations")
    c = c[(c["scheme"] == scheme) & (c["target"] == target)]
    if c.empty:
        return not_run(f"correlations-{scheme}", title, f"no correlations for {scheme}/{target}")
    sizes = [s for s in reversed(d.sizes) if s in set(c["size"])] + (["pooled"] if "pooled" in set(c["size"]) else [])
    metrics = [m for m in CORR_METRICS if m in set(c["metric"])] + sorted(set(c["metric"]) - set(CORR_METRICS))
    rows = []
    points = damage_frame(d, scheme, tuple(metrics), target)
    for s in sizes:
        label = "pooled (all sizes)" if s == "pooled" else d.size_label(s)
        pts = points if s == "pooled" else points[points["size"] == s]
        for x in c[c["size"] == s].set_index("metric").reindex(metrics).dropna(how="all").itertuples():
            n = f"{int(x.n)} ({int(x.n_cl)} CL)" if "n_cl" in c else str(int(x.n))
            lo, hi = loo_range(pts[x.Index].to_numpy(dtype=float), pts["damage"].to_numpy(dtype=float)) \
                if x.Index in pts else (math.nan, math.nan)
            loo = f"{lo:+.2f} … {hi:+.2f}" if np.isfinite(lo) else "–"
            rows.append((label, str(x.Index), n, _r(x, "pearson"), loo, _r(x, "spearman"),
                         _r(x, "pearson_partial"), _r(x, "spearman_partial")))  # fmt: skip
    caption = (
        f"From correlations.parquet (scheme={scheme}, target={target}): models are every FP sweep run and "
        "Common-Loss model with PTQ rows, diverged runs left out; n per cell. Cell: r [95 % bootstrap CI] "
        "p. LOO range: the smallest and largest Pearson r with one model left out (from results.parquet; a "
        "wide range means one or a few models carry r). Partial: controlling for the model's FP validation "
        "loss (residuals of a linear regression, p from t with n − 3 dof). The first size is the headline "
        "(within one size, as in the paper); pooled "
        "mixes sizes whose damage differs and comes last. Δ = quantized − FP, so the paper's accuracy-based "
        "signs flip. mmr is per-token (paper.md §6.1), mmr_batchavg the authors' code's batch average."
    )
    cols = ("size", "metric", "n", "Pearson", "Pearson LOO range", "Spearman", "partial Pearson (FP loss)",
            "partial Spearman (FP loss)")
    return Table(f"correlations-{scheme}", title, cols, tuple(rows), caption)


"""The paper's tables rebuilt from a study's results: Table 2 (FP), 3 (PTQ), 4 (QAT), 10 (fits), plus cost.

A `Table` holds formatted cells, so the HTML page and the markdown summary print the same numbers. Each
table's caption names the file and the rows it was made from; a table with nothing to show carries a
`missing` reason instead of rows. Our quantity is validation loss (lower is better) where the paper's is
average zero-shot accuracy (higher is better); the paper's own numbers are separate tables built by
`paper_table` and styled apart (paper.md §10).

Left out on purpose: significance tests between optimizers (single seeds), and re-deriving the paper's
accuracy numbers from ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from optquant.report.load import StudyData, fit_interval, fit_rho4, fmt, fmt_bytes, fmt_ci, fmt_lr
from optquant.report.paper import LABELS, PaperGrid

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


def _argmin(vals: list[float]) -> int | None:
    """Index of the smallest finite value, if at least two are finite (one value is not a ranking)."""
    finite = [(v, j) for j, v in enumerate(vals) if np.isfinite(v)]
    return min(finite)[1] if len(finite) > 1 else None


def _argmin_cols(vals: list[float], offset: int, row: int) -> set[tuple[int, int]]:
    j = _argmin(vals)
    return set() if j is None else {(row, j + offset)}


def _seed_note(d: StudyData, kind: str, metric: str, best: bool | None) -> str:
    df = d.rows(kind, metric, "none", best)
    k = int(df.groupby(["size", "optimizer"])["seed"].nunique().max()) if not df.empty else 1
    return f" Values are means over up to {k} seeds." if k > 1 else ""


# ---------------------------------------------------------------- Table 2
def table2(d: StudyData) -> Table:
    title = "Table 2 — full-precision final validation loss at each optimizer's best LR"
    df = d.rows("fp", "final_val_loss", "none", best=True)
    if df.empty:
        return _missing("table2", title, "no best-LR training runs (kind=fp, best_lr) in results.parquet")
    loss = d.cell("fp", "final_val_loss", best=True)
    lr = {k: float(g["lr"].iloc[0]) for k, g in df.groupby(["size", "optimizer"])}
    opts = [o for o in d.optimizers if any(k[1] == o for k in loss)]
    rows, bold = [], set()
    for i, s in enumerate(x for x in d.sizes if any(k[0] == x for k in loss)):
        vals = [loss.get((s, o), math.nan) for o in opts]
        cells = [f"{fmt(loss[(s, o)])} ({fmt_lr(lr[(s, o)])})" if (s, o) in loss else "–" for o in opts]
        rows.append((d.size_label(s), *cells))
        bold |= _argmin_cols(vals, 1, i)
    caption = (
        f"From results.parquet: kind=fp, best_lr=True, scheme=none, metric=final_val_loss ({len(df)} rows). "
        "Cell: loss (best LR). Bold: lowest loss of the size." + _seed_note(d, "fp", "final_val_loss", True)
    )
    return Table("table2", title, ("size", *(d.label(o) for o in opts)), tuple(rows), caption, bold=frozenset(bold))


# ---------------------------------------------------------------- Table 3
def table3(d: StudyData, scheme: str) -> Table:
    title = f"Table 3 — Common-Loss models under PTQ scheme {scheme}"
    fp, q = d.cell("cl", "val_loss"), d.cell("cl", "val_loss", scheme)
    if not q:
        return _missing(f"table3-{scheme}", title, f"no kind=cl rows with scheme={scheme}")
    dl = d.cell("cl", "delta_val_loss", scheme)
    acc_fp, acc_q = d.cell("cl", "mc_acc_norm"), d.cell("cl", "mc_acc_norm", scheme)
    with_acc = bool(acc_q)
    cols = ["size", "optimizer", "val loss FP", f"val loss {scheme}", "Δ val loss"]
    cols += ["acc_norm FP", f"acc_norm {scheme}", "Δ acc_norm"] if with_acc else []
    dacc = d.cell("cl", "delta_acc_norm", scheme)
    rows: list[tuple[str, ...]] = []
    bold: set[tuple[int, int]] = set()
    for s in d.sizes:
        keys = [(s, o) for o in d.optimizers if (s, o) in q]
        deltas = [dl.get(k, q[k] - fp.get(k, math.nan)) for k in keys]
        if (j := _argmin(deltas)) is not None:
            bold.add((len(rows) + j, 4))
        for k, delta in zip(keys, deltas, strict=True):
            row = [d.size_label(s), d.label(k[1]), fmt(fp.get(k)), fmt(q[k]), f"{delta:+.4f}"]
            if with_acc:
                row += [fmt(acc_fp.get(k)), fmt(acc_q.get(k)), _signed(dacc.get(k))]
            rows.append(tuple(row))
    caption = (
        f"From results.parquet: kind=cl; scheme=none (FP) and scheme={scheme}; metrics val_loss, "
        f"delta_val_loss{', mc_acc_norm, delta_acc_norm' if with_acc else ''} ({len(rows)} models). "
        "Δ = quantized − FP. Bold: smallest Δ val loss of the size."
    )
    return Table(f"table3-{scheme}", title, tuple(cols), tuple(rows), caption, bold=frozenset(bold))


def table3_schemes(d: StudyData) -> Table:
    """Δ val loss of every CL model under every PTQ scheme (rows: size × optimizer)."""
    title = "Table 3b — Δ validation loss by PTQ scheme"
    schemes = d.schemes("cl")
    cells = {s: d.cell("cl", "delta_val_loss", s) for s in schemes}
    keys = [(s, o) for s in d.sizes for o in d.optimizers if any((s, o) in c for c in cells.values())]
    if not keys:
        return _missing("table3b", title, "no kind=cl rows with metric delta_val_loss")
    rows, bold = [], set()
    for i, k in enumerate(keys):
        vals = [cells[s].get(k, math.nan) for s in schemes]
        rows.append((d.size_label(k[0]), d.label(k[1]), *(_signed(v) for v in vals)))
        bold |= _argmin_cols(vals, 2, i)
    caption = (
        f"From results.parquet: kind=cl, metric=delta_val_loss, schemes {', '.join(schemes)} "
        f"({len(keys)} models). Bold: the scheme with the smallest damage for the model."
    )
    return Table("table3b", title, ("size", "optimizer", *schemes), tuple(rows), caption, bold=frozenset(bold))


def _signed(v: float | None, digits: int = 4) -> str:
    return "–" if v is None or not np.isfinite(v) else f"{v:+.{digits}f}"


# ---------------------------------------------------------------- Table 4
def table4(d: StudyData) -> Table:
    title = "Table 4 — QAT (QuEST W4A4) final validation loss and relative degradation"
    loss = d.cell("qat", "final_val_loss", scheme=None)
    if not loss:
        return _missing("table4", title, "no QAT runs (kind=qat) in results.parquet")
    rel = d.cell("qat", "qat_rel_degradation_pct", scheme=None)
    acc = d.cell("qat", "mc_acc_norm", scheme=None)
    fp = d.cell("fp", "final_val_loss", best=True)
    cols = ["size", "optimizer", "FP loss (best LR)", "QAT loss", "rel. gap (%)"] + (["QAT acc_norm"] if acc else [])
    rows: list[tuple[str, ...]] = []
    bold: set[tuple[int, int]] = set()
    for s in d.sizes:
        keys = [(s, o) for o in d.optimizers if (s, o) in loss]
        if (j := _argmin([rel.get(k, math.nan) for k in keys])) is not None:
            bold.add((len(rows) + j, 4))
        for k in keys:
            row = [d.size_label(s), d.label(k[1]), fmt(fp.get(k)), fmt(loss[k]), _signed(rel.get(k), 2)]
            rows.append(tuple(row + ([fmt(acc.get(k), 3)] if acc else [])))
    caption = (
        "From results.parquet: kind=qat, metrics final_val_loss, qat_rel_degradation_pct"
        f"{', mc_acc_norm' if acc else ''}; FP loss from kind=fp best_lr=True ({len(rows)} QAT runs). "
        "Rel. gap: QAT loss vs its FP best-LR twin, positive = worse than FP. Bold: smallest gap of the "
        "size. The paper reports accuracy, where worse is negative."
    )
    return Table("table4", title, tuple(cols), tuple(rows), caption, bold=frozenset(bold))


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
                )
            )
    caption = (
        "From results.parquet: kind=fp, metrics mean_step_seconds, tokens_per_s, optimizer_state_bytes, "
        "averaged over all of the (optimizer, size)'s LR-sweep runs. Timings are on the study's hardware."
    )
    cols = ("size", "optimizer", "step time (s)", "× AdamW", "tokens/s", "optimizer state", "× AdamW ")
    return Table("cost", title, cols, tuple(rows), caption)


def _ratio(v: float | None, ref: float | None) -> str:
    if v is None or ref is None or not (np.isfinite(v) and np.isfinite(ref)) or ref <= 0:
        return "–"
    return f"{v / ref:.2f}×"


# ---------------------------------------------------------------- correlations
def correlation_table(d: StudyData) -> Table:
    title = "Correlation of each metric with PTQ damage"
    c = d.correlations
    if c is None or c.empty:
        return _missing("correlations", title, "no correlations.parquet")
    keep = ["all"] + [s for s in (d.largest(),) if s]
    c = c[c["size"].astype(str).isin(keep)]
    order = {s: i for i, s in enumerate(d.schemes("cl"))}
    metrics = [m for m in ("mmr", "kurtosis", "R_L") if m in set(c["metric"])]
    metrics += sorted(set(c["metric"]) - set(metrics))
    rows = []
    groups = c.groupby(["scheme", "size", "target"], sort=False)
    for (scheme, size, target), g in sorted(groups, key=lambda x: (order.get(x[0][0], 99), str(x[0]))):
        by = {r.metric: r for r in g.itertuples()}
        cells = [f"{str(scheme)}", str(size), str(target), str(int(g["n"].max()))]
        for m in metrics:
            r = by.get(m)
            cells.append(fmt_ci(r.pearson, (r.pearson_lo, r.pearson_hi), 2) if r else "–")
            cells.append(fmt(r.spearman, 2) if r else "–")
        rows.append(tuple(cells))
    caption = (
        f"From correlations.parquet, sizes {' and '.join(keep)} ({len(c)} rows): Pearson r [CI] and Spearman "
        "per metric. Targets are Δ = quantized − FP, so a positive r with delta_val_loss means the metric "
        "grows with the damage, and the paper's accuracy-based signs flip."
    )
    cols = (
        "scheme",
        "size",
        "target",
        "n",
        *(f"{m} {k}" for m in metrics for k in ("Pearson [CI]", "Spearman")),
    )
    return Table("correlations", title, cols, tuple(rows), caption)


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

    lines = ["| " + " | ".join(t.columns) + " |", "|" + "---|" * len(t.columns)]
    lines += ["| " + " | ".join(cell(i, j, v) for j, v in enumerate(r)) + " |" for i, r in enumerate(t.rows)]
    return head + "\n".join(lines) + ("\n\n" + t.caption if t.caption else "") + "\n"

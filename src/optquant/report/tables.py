"""The paper's tables rebuilt from a study's results: Table 2 (FP), 3 (PTQ), 4 (QAT) and the MMR/R_L table.

A `Table` holds formatted cells, so the HTML page and the markdown summary print the same numbers. Each
table's caption names the file and the rows it was made from; a table with nothing to show carries a
`missing` reason instead of rows. Our quantity is validation loss (lower is better) where the paper's is
average zero-shot accuracy (higher is better); the paper's own numbers are separate tables built by
`paper_table` and styled apart (paper.md §10). A study that ran lm-eval tasks (`eval.tasks`) also gets
accuracy as the paper reports it: Table 3c, zero-shot acc_norm in % of the CL models before and after PTQ.

Every headline number is mean ± sd [95 % t-interval] (n seeds) and every ranking is a ranking with ties
from paired sign-flip tests (optquant.stats): per size over seeds, and pooled over sizes as blocks.
Table 10 (the scaling fits) is in scaling.py; the CL-model, LR-search, cost and correlation tables in
protocol.py.

Left out on purpose: re-deriving the paper's accuracy numbers from ours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from optquant.report.load import StudyData, fmt_lr
from optquant.report.paper import PaperGrid, label
from optquant.stats import ALPHA, NOT_RESOLVED, Ranking, Summary, min_p, rank_with_ties, summarize

NOT_RUN = "not run in this study"


@dataclass(frozen=True)
class Table:
    """A table's formatted cells. Optimizers are named here, for every table alike: the cells of an "optimizer"
    column and the column headers go through `paper.label` (AdamW; a plugin as typed, its path shortened)."""

    key: str
    title: str
    columns: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    caption: str = ""
    missing: str = ""  # non-empty: nothing to show, and why
    bold: frozenset[tuple[int, int]] = field(default_factory=frozenset)  # (row, column) cells to emphasize
    paper: bool = False  # the paper's reference values, not ours

    def __post_init__(self) -> None:  # label() is idempotent, so a table rebuilt with `replace` is unchanged
        named = {j for j, c in enumerate(self.columns) if c == "optimizer"}
        object.__setattr__(self, "columns", tuple(map(label, self.columns)))
        object.__setattr__(self, "rows", tuple(tuple(label(v) if j in named else v for j, v in enumerate(r))
                                               for r in self.rows))


def not_run(key: str, title: str, why: str) -> Table:
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


def rank_over(df: pd.DataFrame, units: str | list[str], lower_is_better: bool = True) -> Ranking:
    """The optimizers of a `StudyData.seeds` frame ranked with ties, paired over `units`: "seed" within a size,
    ["size", "seed"] pooled over sizes as blocks."""
    return rank_with_ties({o: x.set_index(units)["value"] for o, x in df.groupby("optimizer")},
                          lower_is_better=lower_is_better)


def _ranks(df: pd.DataFrame, q: Quantity) -> tuple[dict[str, Ranking], Ranking | None]:
    """Per-size rankings (units: seeds) and the pooled one (units: (size, seed) blocks)."""
    per = {str(s): rank_over(g, "seed", q.lower_is_better) for s, g in df.groupby("size")}
    return per, rank_over(df, ["size", "seed"], q.lower_is_better) if df["size"].nunique() > 1 else None


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
        return not_run(key, title, f"no rows for {', '.join(q.metric for q in quantities)} in results.parquet")
    ranks = {q.label: _ranks(frames[q.label], q) for q in quantities if not frames[q.label].empty}
    cols = ["size", "optimizer"]
    for q in quantities:
        cols += [f"{q.label} mean ± sd [95 % CI] (n)", f"{q.label} rank"]
    keys = sorted({(s, o) for f in frames.values() for s, o in zip(f["size"], f["optimizer"], strict=True)},
                  key=lambda k: (d.sizes.index(k[0]) if k[0] in d.sizes else 99, opt_order(d, k[1])))  # fmt: skip
    rows: list[tuple[str, ...]] = []
    bold: set[tuple[int, int]] = set()
    summary = {(s, o, q.label): summarize(f.loc[(f["size"] == s) & (f["optimizer"] == o), "value"] * q.scale)
               for q in quantities for f in [frames[q.label]] for s, o in keys}
    digits = {q.label: column_digits([summary[(s, o, q.label)] for s, o in keys], q.digits) for q in quantities}
    for s, o in keys:
        row = [d.size_label(s), o]
        for j, q in enumerate(quantities):
            r = ranks.get(q.label, ({}, None))[0].get(s)
            row += [summary[(s, o, q.label)].text(digits[q.label], q.signed), r.label(o) if r and o in r.rank else "–"]
            if r and r.rank.get(o) == 1 and not r.tied(o):
                bold.add((len(rows), 2 + 2 * j))
        rows.append(tuple(row))
    opts = sorted({o for _, o in keys}, key=lambda o: opt_order(d, o))
    if any(p is not None for _, p in ranks.values()):
        for o in opts:
            row = ["pooled (all sizes)", o]
            for q in quantities:
                pooled = ranks.get(q.label, ({}, None))[1]
                n = int(frames[q.label]["optimizer"].eq(o).sum())
                row += [f"(n={n} units)", pooled.label(o) if pooled and o in pooled.rank else "–"]
            rows.append(tuple(row))
    first = next(iter(ranks.values()), ({}, None))
    caption = (f"From results.parquet: {source}. Interval: Student-t 95 % over seeds; each column's decimals are "
               "those of its median half-interval to one significant digit (two from 1.0 to 1.9)."
               + _rank_note(*first))
    return Table(key, title, tuple(cols), tuple(rows), caption, bold=frozenset(bold))


def column_digits(summaries: Sequence[Summary], most: int) -> int:
    """Decimals a column's intervals support: the median 95 % half-width over its cells to one significant
    digit, two when that digit is 1 (0.0041 → 3 decimals, 0.012 → 3, 0.02 → 2; the Particle Data Group's
    rounding); at most `most`, and `most` where no cell has an interval (one seed)."""
    half = [(x.hi - x.lo) / 2 for x in summaries if x.n > 1 and math.isfinite(x.hi - x.lo) and x.hi > x.lo]
    if not half:
        return most
    h = float(np.median(half))
    e = math.floor(math.log10(h))
    return int(min(most, max(0, (2 if h / 10**e < 2 else 1) - 1 - e)))


def opt_order(d: StudyData, o: str) -> int:
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
    if len(d.rows("cl", "delta_acc_norm", scheme=None)):
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


def _items(d: StudyData, task: str) -> str:
    n = d.rows("cl", f"n/{task}")["value"]
    return "–" if n.empty else "/".join(f"{v:.0f}" for v in sorted(set(n)))


def table3_schemes(d: StudyData) -> Table:
    """Δ val loss of the CL models under every PTQ scheme, with ranks within each size."""
    title = "Table 3b — Δ validation loss by PTQ scheme"
    schemes = d.schemes("cl")
    if not schemes:
        return not_run("table3b", title, "no kind=cl rows with metric delta_val_loss")
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
    if len(d.rows("cl", "mmr_batchavg", scheme=None)):
        qs.append(Quantity("MMR batch-avg", "cl", "mmr_batchavg", digits=2))
    if scheme:
        qs.append(Quantity(f"R_L ({scheme})", "cl", "R_L", scheme))
    src = ("kind=cl; mmr = per-token max/median |x| averaged over tokens (paper.md §6.1), mmr_batchavg = the "
           "authors' code's batch-averaged features (scheme=none); R_L = relative output error after PTQ. "
           "Lower ranks first")  # fmt: skip
    return seed_table(d, "outliers", title, qs, src)


# ---------------------------------------------------------------- paper side tables
def paper_table(grid: PaperGrid, key: str) -> Table:
    def cell(s: str, o: str, v: float | None) -> str:
        return "n/a" if v is None else f"{v:.{grid.digits.get(s, 2)}f}{grid.notes.get((s, o), '')}"

    rows = [(s, *(cell(s, o, v) for o, v in zip(grid.optimizers, grid.values[s], strict=True))) for s in grid.sizes]
    caption = f"paper, {grid.sources}. Unit: {grid.unit or 'as named'}. {grid.footnote}".strip()
    cols = ("paper" if grid.unit else "quantity", *grid.optimizers)
    return Table(key, f"paper — {grid.title}", cols, tuple(rows), caption, paper=True)


def paper_values_table(key: str, title: str, values: dict[str, float], sources: str, head: str) -> Table:
    rows = tuple((label(k), f"{v:.2f}") for k, v in values.items())
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

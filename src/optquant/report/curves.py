"""Training-side figures: scaling curves with their fits, LR sweeps, and training curves of the best runs.

Same conventions as `figures.py` (Agg canvas, captions naming their sources, `missing` instead of a
crash). The scaling curves are drawn from the fit parameters in fits.json with L = A/(N·ρ)^α + E
(paper.md §9), not refitted here, so the report shows exactly the fit the study saved.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from optquant.report.figures import Plot, grid, log_axis, missing, optimizer_legend, save
from optquant.report.load import StudyData, fit_rho4, fmt_count, fmt_lr
from optquant.scaling import LawFit, predict


def fig_scaling(d: StudyData, out: Path) -> Plot:
    title = "Scaling — final validation loss vs parameters, FP and QAT"
    fp = d.rows("fp", "final_val_loss", best=True)
    qat = d.rows("qat", "final_val_loss", scheme=None)
    if fp.empty and qat.empty:
        return missing("scaling", title, "no best-LR FP runs or QAT runs")
    per = (d.fits or {}).get("per_optimizer") or {}
    opts = [o for o in d.optimizers if o in set(fp["optimizer"]) | set(qat["optimizer"])]
    fig, axes = grid(len(opts), h=2.8)
    n_all = pd.concat([fp["n_params"], qat["n_params"]]).astype(float)
    ns = np.geomspace(n_all.min() / 1.5, n_all.max() * 1.5, 100)
    for ax, o in zip(axes, opts, strict=True):
        c = d.color(o)
        for df, mk, lab in ((fp, "o", "FP"), (qat, "x", "QAT W4A4")):
            g = df[df["optimizer"] == o].groupby("n_params")["value"].mean()
            if len(g):
                ax.scatter(g.index, g.values, color=c, marker=mk, s=36, label=lab)
        if o in per:
            f = LawFit.from_dict(per[o])
            ax.plot(ns, predict(f, ns), color=c, lw=1.2, label="fit, FP (ρ = 1)")
            rho = fit_rho4(f.rho)
            if np.isfinite(rho):
                ax.plot(ns, predict(f, ns, True), color=c, lw=1.2, ls="--", label=f"fit, QAT (ρ = {rho:.3f})")
        log_axis(ax, "x", fmt_count)
        ax.set_xlim(ns[0], ns[-1])
        ax.set_title(d.label(o), fontsize=9, color=c)
        ax.set_xlabel("parameters N")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("final val loss")
    caption = (
        "Points from results.parquet: kind=fp best_lr=True and kind=qat, metric=final_val_loss "
        f"({len(fp)} FP, "
        f"{len(qat)} QAT rows). Curves from fits.json per_optimizer "
        f"({'present' if per else 'absent: no curves'}), L = A/(N·ρ)^α + E."
    )
    return Plot("scaling", title, save(fig, out, "scaling"), caption)


def fig_lr_sweeps(d: StudyData, out: Path) -> Plot:
    title = "LR sweeps — final validation loss vs peak learning rate"
    df = d.rows("fp", "final_val_loss")
    if df.empty:
        return missing("lr_sweeps", title, "no LR-sweep runs (kind=fp)")
    diverged = d.rows("fp", "diverged")
    bad = set(diverged.loc[diverged["value"] > 0, "run_id"])
    sizes = [s for s in d.sizes if s in set(df["size"])]
    fig, axes = grid(len(sizes))
    for ax, s in zip(axes, sizes, strict=True):
        ds = df[df["size"] == s]
        ok = ds[~ds["run_id"].isin(bad) & np.isfinite(ds["value"])]
        for o, g in ok.groupby("optimizer"):
            m = g.groupby("lr")["value"].mean()
            ax.plot(m.index, m.values, marker="o", ms=4, color=d.color(o))
            best = g[g["best_lr"]]
            ax.scatter(best["lr"], best["value"], marker="*", s=140, color=d.color(o), edgecolor="black", zorder=3)
        top = ax.get_ylim()[1]
        for o, g in ds[ds["run_id"].isin(bad)].groupby("optimizer"):
            ax.scatter(g["lr"], [top] * len(g), marker="x", s=50, color=d.color(o), clip_on=False, zorder=3)
        log_axis(ax, "x", fmt_lr)
        ax.set_xlabel("peak learning rate")
        ax.set_title(d.size_label(s), fontsize=9)
    axes[0].set_ylabel("final val loss")
    optimizer_legend(fig, d, [o for o in d.optimizers if o in set(df["optimizer"])])
    caption = (
        f"From results.parquet kind=fp, metric=final_val_loss ({df['run_id'].nunique()} runs; "
        "mean over seeds per LR). "
        f"Star: the best LR. ×: diverged runs (metric diverged = 1; {len(bad)} runs), drawn at the top edge."
    )
    return Plot("lr_sweeps", title, save(fig, out, "lr_sweeps"), caption)


def _clip_start(ax, tail: pd.Series) -> None:
    """y-limits from the losses after the first 10 % of training (the early losses dwarf the rest)."""
    tail = tail[np.isfinite(tail)]
    if len(tail):
        lo, hi = float(tail.min()), float(tail.max())
        pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.1
        ax.set_ylim(lo - pad, hi + pad)
        ax.xaxis.get_major_formatter().set_powerlimits((-3, 4))


def fig_training_curves(d: StudyData, out: Path) -> Plot:
    title = "Training curves of the best-LR runs"
    curves = {
        s: {o: c for o, r in d.best_runs(s).items() if (c := d.curve(r)) is not None and "val_loss" in c}
        for s in d.sizes
    }
    curves = {s: c for s, c in curves.items() if c}
    if not curves:
        return missing("curves", title, "no runs/<run_id>/metrics.jsonl for the best-LR runs")
    fig, axes = grid(len(curves))
    n_runs = 0
    for ax, (s, by_opt) in zip(axes, curves.items(), strict=True):
        tail = []
        for o, c in by_opt.items():
            x = "tokens" if "tokens" in c else "step"
            v = c.dropna(subset=["val_loss"])
            ax.plot(v[x], v["val_loss"], color=d.color(o), lw=1.4)
            if "train_loss" in c:
                t = c.dropna(subset=["train_loss"])
                ax.plot(t[x], t["train_loss"], color=d.color(o), lw=0.6, alpha=0.35)
                tail.append(t.loc[t[x] >= 0.1 * t[x].max(), "train_loss"])
            tail.append(v.loc[v[x] >= 0.1 * v[x].max(), "val_loss"])
            n_runs += 1
        _clip_start(ax, pd.concat(tail))
        ax.set_xlabel(x)
        ax.set_title(d.size_label(s), fontsize=9)
    axes[0].set_ylabel("loss")
    optimizer_legend(fig, d, [o for o in d.optimizers if any(o in c for c in curves.values())])
    caption = (
        f"From runs/<run_id>/metrics.jsonl of the best-LR FP runs ({n_runs} runs). "
        "Thick: validation loss; thin: training loss. The y-axis shows the last 90 % of training; the "
        "first steps' much higher losses are cut off."
    )
    return Plot("curves", title, save(fig, out, "training_curves"), caption)

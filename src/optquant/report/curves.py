"""Training-side figures: scaling curves with their fits, LR sweeps, and training curves of the best runs.

Same conventions as `figures.py` (Agg canvas, captions naming their sources, `missing` instead of a
crash). The scaling curves are drawn from the fit parameters in fits.json with L = A/(N·ρ)^α + E
(paper.md §9), not refitted here, so the report shows exactly the fit the study saved.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from optquant.report.figures import Plot, grid, log_axis, missing, optimizer_legend, save
from optquant.report.load import StudyData, fit_n, fit_rho4, fmt_count, fmt_lr
from optquant.scaling import LawFit, predict
from optquant.stats import summarize


def scaling_figure(d: StudyData) -> tuple[Figure | None, str, str]:
    """(figure, count name, why not) of the scaling curves: the fits' points (best-LR FP and QAT final val
    loss) and the fits, in the N the fits used (study/results.py `fit_n`: non-embedding where the token
    budget counts it)."""
    r = d.results
    pts = r[(r["metric"] == "final_val_loss") & (((r["kind"] == "fp") & r["best_lr"]) | (r["kind"] == "qat"))]
    n, count = fit_n(pts) if len(pts) else (pts["n_params"], "total")
    pts = pts.assign(n_fit=pd.to_numeric(n, errors="coerce").astype(float))
    pts = pts[np.isfinite(pts["value"].astype(float)) & (pts["n_fit"] > 0)]
    if pts.empty:
        return None, count, "no best-LR FP runs or QAT runs"
    per = (d.fits or {}).get("per_optimizer") or {}
    count = (d.fits or {}).get("n_count") or count
    opts = [o for o in d.optimizers if o in set(pts["optimizer"])]
    fig, axes = grid(len(opts), h=2.8)
    ns = np.geomspace(pts["n_fit"].min() / 1.5, pts["n_fit"].max() * 1.5, 100)
    for ax, o in zip(axes, opts, strict=True):
        c = d.color(o)
        for kind, mk, lab in (("fp", "o", "FP"), ("qat", "x", "QAT W4A4")):
            g = pts[(pts["optimizer"] == o) & (pts["kind"] == kind)].groupby("n_fit")["value"].mean()
            if len(g):
                ax.scatter(g.index, g.values, color=c, marker=mk, s=36, label=lab, zorder=3)
        if o in per:
            f = LawFit.from_dict(per[o])
            ax.plot(ns, predict(f, ns), color=c, lw=1.2, label="fit, FP (ρ = 1)")
            rho = fit_rho4(f.rho)
            if np.isfinite(rho):
                ax.plot(ns, predict(f, ns, True), color=c, lw=1.2, ls="--", label=f"fit, QAT (ρ = {rho:.3f})")
        log_axis(ax, "x", fmt_count)
        ax.set_xlim(ns[0], ns[-1])
        ax.set_title(d.label(o), fontsize=9, color=c)
        ax.set_xlabel(f"parameters N ({count.replace('_', '-')})")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("final val loss")
    return fig, count, ""


def fig_scaling(d: StudyData, out: Path) -> Plot:
    title = "Scaling — final validation loss vs parameters, FP and QAT"
    fig, count, why = scaling_figure(d)
    if fig is None:
        return missing("scaling", title, why)
    fp, qat = d.rows("fp", "final_val_loss", best=True), d.rows("qat", "final_val_loss", scheme=None)
    per = (d.fits or {}).get("per_optimizer") or {}
    caption = (
        "Points from results.parquet: kind=fp best_lr=True and kind=qat, metric=final_val_loss, mean over "
        f"seeds ({len(fp)} FP, {len(qat)} QAT rows). Curves from fits.json per_optimizer "
        f"({'present' if per else 'absent: no curves'}), L = A/(N·ρ)^α + E. N is the count the fits used "
        f"(fits.json n_count: {count}), for points and curves alike."
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
    seed0 = int(df["seed"].min())
    fig, axes = grid(len(sizes))
    for ax, s in zip(axes, sizes, strict=True):
        ds = df[df["size"] == s]
        ok = ds[~ds["run_id"].isin(bad) & np.isfinite(ds["value"])]
        for o, g in ok.groupby("optimizer"):
            c = d.color(o)
            per = {lr: summarize(x["value"]) for lr, x in g.groupby("lr")}
            lrs = sorted(per)
            ax.plot(lrs, [per[lr].mean for lr in lrs], color=c, lw=1.2)
            one = [lr for lr in lrs if per[lr].n == 1]
            many = [lr for lr in lrs if per[lr].n > 1]
            ax.scatter(one, [per[lr].mean for lr in one], marker="o", s=22, facecolor="white", edgecolor=c, zorder=3)
            if many:
                ax.errorbar(many, [per[lr].mean for lr in many], capsize=2, fmt="o", ms=4, color=c, zorder=3,
                            yerr=np.array([[per[lr].mean - per[lr].lo, per[lr].hi - per[lr].mean] for lr in many]).T)
            best = g[g["best_lr"]]
            if len(best):
                lr = float(best["lr"].iloc[0])
                ax.scatter([lr], [per[lr].mean], marker="*", s=140, color=c, edgecolor="black", zorder=4)
                first = best.loc[best["seed"] == seed0, "value"]
                if per[lr].n > 1 and len(first):  # the value the search compared with its neighbours
                    ax.scatter([lr], [float(first.iloc[0])], marker="o", s=22, facecolor="white", edgecolor=c,
                               zorder=3)
        dv = diverged[(diverged["size"] == s) & (diverged["value"] > 0)]  # a diverged run has no final loss row
        ax.plot(pd.concat([ds["lr"], dv["lr"]]), np.full(len(ds) + len(dv), np.nan), ls="")  # x-range: all LRs
        log_axis(ax, "x", fmt_lr)
        top = ax.get_ylim()[1]
        for o, g in dv.groupby("optimizer"):
            ax.scatter(g["lr"], [top] * len(g), marker="x", s=50, color=d.color(o), clip_on=False, zorder=3)
        ax.set_ylim(top=top)
        ax.set_xlabel("peak learning rate")
        ax.set_title(d.size_label(s), fontsize=9)
    axes[0].set_ylabel("final val loss")
    optimizer_legend(fig, d, [o for o in d.optimizers if o in set(df["optimizer"])])
    caption = (
        f"From results.parquet kind=fp, metric=final_val_loss ({df['run_id'].nunique()} runs). Filled points "
        "with bars: the mean over seeds with its 95 % t-interval (the best LR, where the study ran seeds); "
        "hollow points: one seed (the LR search runs the first seed only, and picks the best LR by that "
        "seed's loss: the hollow point under a star is that value). Star: the best LR, at its seed mean. "
        f"×: diverged runs (metric diverged = 1; {len(bad)} runs), drawn at the top edge."
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

"""The paper's Figs. 1–4 from a study's files: PTQ damage vs metrics, MMR vs LR, ABC per module, gains.

Figures are drawn on matplotlib `Figure` objects with an explicit Agg canvas, never through pyplot, so
building a report changes no global backend state and leaks no open figures. Every `Plot` caption names
the files and row filters it was made from and how many points it shows; a figure without inputs is a
`Plot` with a `missing` reason and no file. Our damage axis is Δ val loss (quantized − FP), where the
paper plots post-PTQ accuracy, so our correlation signs are the paper's flipped (paper.md §6.2, §10.3).

Left out on purpose: interactive plots, and per-layer outlier profiles (ptq/<run_id>/none/outliers.parquet
is not plotted; the figures use the model-level MMR and kurtosis rows of results.parquet).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from optquant.report.load import StudyData, fmt_ci, fmt_lr
from optquant.report.tables import NOT_RUN

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


@dataclass(frozen=True)
class Plot:
    key: str
    title: str
    src: str = ""  # path relative to the report directory
    caption: str = ""
    missing: str = ""


def missing(key: str, title: str, why: str) -> Plot:
    return Plot(key, title, missing=f"{NOT_RUN}: {why}")


def grid(n: int, ncols: int = 3, w: float = 3.8, h: float = 2.9) -> tuple[Figure, list]:
    """A figure with n gridded panels on an Agg canvas; unused cells are hidden."""
    ncols = max(1, min(ncols, n))
    nrows = -(-n // ncols)
    fig = Figure(figsize=(w * ncols, h * nrows + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel())
    for ax in axes[n:]:
        ax.set_visible(False)
    for ax in axes[:n]:
        ax.grid(alpha=0.3)
    return fig, axes[:n]


def save(fig: Figure, out_dir: Path, key: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / f"{key}.png", dpi=100)
    return f"figures/{key}.png"


def optimizer_legend(fig: Figure, d: StudyData, opts: list[str], sizes: list[str] | None = None) -> None:
    handles = [Line2D([], [], color=d.color(o), marker="o", ls="-", label=d.label(o)) for o in opts]
    for i, s in enumerate(sizes or []):
        handles.append(Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], ls="", label=s))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 9), fontsize=8, frameon=False)


def log_axis(ax, which: str = "x", label: Callable[[float], str] | None = None) -> None:
    """Log scale labelled by `label` (e.g. fmt_lr), with as many ticks as fit without colliding: 1, 2, 5 ×
    10^k over a narrow range, 1 and 3, then one per decade, then every few decades (`LogLocator`'s
    numticks). Call it after plotting: it reads the data's range (limits tight to the data, no empty
    decades) and the panel's width."""
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    lo, hi = _positive_range(ax, which)
    decades = np.log10(hi / lo) if lo > 0 else 1.0
    (w, h), box = ax.figure.get_size_inches(), ax.get_position()  # the panel's share of the figure
    room = max(2, int((box.width * w if which == "x" else box.height * h * 1.6) / 0.55))  # ~0.55 in per "5e-4"
    subs = next((s for s in ((1.0, 2.0, 5.0), (1.0, 3.0), (1.0,)) if decades * len(s) <= room), (1.0,))
    narrow = lo > 0 and hi / lo < 2.5  # under 1, 2, 5's spacing: a few evenly spaced ticks instead
    axis.set_major_locator(MaxNLocator(max(2, room // 2)) if narrow else LogLocator(subs=subs, numticks=room + 1))
    axis.set_minor_locator(LogLocator(subs="auto", numticks=12))
    axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(FuncFormatter(lambda v, _: (label or (lambda x: f"{x:.3g}"))(v)))
    if lo > 0:
        pad = min((hi / lo) ** 0.05, 1.3) if hi > lo else 1.5
        (ax.set_xlim if which == "x" else ax.set_ylim)(lo / pad, hi * pad)


def _positive_range(ax, which: str) -> tuple[float, float]:
    """The smallest and largest positive finite coordinate of the panel's lines and scatters on one axis."""
    k = 0 if which == "x" else 1
    parts = [np.asarray(line.get_xydata(), dtype=float)[:, k] for line in ax.get_lines() if len(line.get_xdata())]
    parts += [np.asarray(c.get_offsets(), dtype=float).reshape(-1, 2)[:, k] for c in ax.collections]
    v = np.concatenate(parts) if parts else np.array([])
    v = v[np.isfinite(v) & (v > 0)]
    return (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)


def auto_scale(ax, which: str, values: object) -> None:
    """Log only when the positive values span more than a factor of 30; else linear."""
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v) & (v > 0)]
    if v.size and v.max() / v.min() > 30:
        log_axis(ax, which)


def positive(v: pd.Series) -> np.ndarray:
    """Values for a log axis: non-positive entries become NaN instead of being clipped."""
    a = v.to_numpy(dtype=float)
    return np.where(a > 0, a, np.nan)


# ---------------------------------------------------------------- Fig. 1
def loo_range(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The smallest and largest Pearson r with one point left out (NaN with fewer than 4 points): one
    point that carries the correlation shows as a wide range."""
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 4:
        return (np.nan, np.nan)
    rs = [np.corrcoef(np.delete(x, i), np.delete(y, i))[0, 1] for i in range(len(x))]
    rs = [r for r in rs if np.isfinite(r)]
    return (min(rs), max(rs)) if rs else (np.nan, np.nan)


PER_SCHEME = ("R_L", "sum_A", "sum_B")  # measured on the quantized model; the outlier metrics on the FP one


def damage_frame(d: StudyData, scheme: str, metrics: tuple[str, ...], target: str = "delta_val_loss") -> pd.DataFrame:
    """Per model (FP sweep runs and CL models, indexed by run_id): its PTQ damage under `scheme`, each
    metric (R_L, Σ A, Σ B under `scheme`, the outlier metrics at scheme none), size, optimizer and LR."""
    def both(metric: str, sch: str) -> pd.Series:
        rows = pd.concat([d.rows("fp", metric, sch), d.rows("cl", metric, sch)])
        return rows.drop_duplicates("run_id").set_index("run_id")["value"]

    df = both(target, scheme).rename("damage").to_frame()
    for m in metrics:
        df = df.join(both(m, scheme if m in PER_SCHEME else "none").rename(m), how="left")
    meta = d.results.drop_duplicates("run_id").set_index("run_id")[["size", "optimizer", "lr"]]
    return df.join(meta, how="left")


def _corr_text(d: StudyData, scheme: str, metric: str, df: pd.DataFrame) -> str:
    c = d.correlations
    if c is None or c.empty:
        return "no correlations.parquet"
    lines = []
    for size in (d.largest(), "pooled"):
        r = c[(c["scheme"] == scheme) & (c["metric"] == metric) & (c["target"] == "delta_val_loss")]
        r = r[r["size"].astype(str) == size]
        if len(r):
            x = r.iloc[0]
            p = fmt_ci(x["pearson"], (x["pearson_lo"], x["pearson_hi"]), 2)
            pts = df if size == "pooled" else df[df["size"] == size]
            lo, hi = loo_range(pts[metric].to_numpy(dtype=float), pts["damage"].to_numpy(dtype=float))
            loo = f", LOO {lo:+.2f}…{hi:+.2f}" if np.isfinite(lo) else ""
            lines.append(f"{size} (n={int(x['n'])}): Pearson {p}{loo}, Spearman {x['spearman']:+.2f}")
    return "\n".join(lines) or "no correlation row"


def dominant(values: pd.Series) -> tuple[object, float] | None:
    """(index, threshold) of the one value that dwarfs the rest (over 3× the next largest |value|, so the
    others share under a third of a linear axis, and over 10× the median), else None; `threshold` is where
    a symlog axis should turn linear (the others' 90th percentile)."""
    v = values[np.isfinite(values)].abs().sort_values()
    if len(v) < 5:
        return None
    top, nxt, p90 = v.iloc[-1], v.iloc[-2], float(np.quantile(v.iloc[:-1], 0.9))
    if top > 3 * nxt and top > 10 * max(float(v.median()), 1e-12):
        return v.index[-1], max(p90, nxt / 10, 1e-6)
    return None


def fig1_damage_vs_metrics(d: StudyData, out: Path) -> Plot:
    title = "Fig. 1 — PTQ damage vs MMR, kurtosis and R_L"
    scheme = d.paper_scheme()
    if scheme is None:
        return missing("fig1", title, "no PTQ rows (kind=cl with a scheme)")
    df = damage_frame(d, scheme, ("mmr", "kurtosis", "R_L"))
    present = [m for m in ("mmr", "kurtosis", "R_L") if m in df and df[m].notna().any()]
    if df.empty or not present:
        return missing("fig1", title, f"no Δ val loss with MMR/kurtosis/R_L under {scheme}")
    fig, axes = grid(len(present), w=4.6, h=3.6)
    sizes = [s for s in d.sizes if s in set(df["size"])]
    big = dominant(df["damage"])
    r = None if big is None else df.loc[big[0]]  # the model that dominates the damage
    for ax, m in zip(axes, present, strict=True):
        for (o, s), gs in df.groupby(["optimizer", "size"]):
            mk = MARKERS[sizes.index(s) % len(MARKERS)]
            ax.scatter(gs[m], gs["damage"], color=d.color(o), marker=mk, s=28, alpha=0.85)
        ax.set_xlabel(m)
        auto_scale(ax, "x", df[m])
        if big is not None:
            ax.set_yscale("symlog", linthresh=big[1], linscale=2)
            lo, hi = float(df["damage"].min()), float(df["damage"].max())
            ax.set_ylim(min(lo, 0.0) * 1.5 - 0.2 * big[1], hi * 2.5 if hi > 0 else hi + big[1])
            if np.isfinite(r[m]):
                ax.annotate(f"{d.label(r['optimizer'])} {r['size']}, LR {fmt_lr(r['lr'])}", (r[m], r["damage"]),
                            xytext=(0.5, 0.93), textcoords="axes fraction", ha="center", fontsize=7,
                            arrowprops={"arrowstyle": "->", "color": "0.4", "lw": 0.7})
        ax.set_title(f"{m}\n{_corr_text(d, scheme, m, df)}", fontsize=7)
    axes[0].set_ylabel(f"Δ val loss ({scheme})" + (", symlog" if big is not None else ""))
    optimizer_legend(fig, d, [o for o in d.optimizers if o in set(df["optimizer"])], sizes)
    note = "" if big is None else (
        f" One model dominates the damage ({d.label(r['optimizer'])} at {r['size']}, LR {fmt_lr(r['lr'])}: "
        f"Δ = {r['damage']:.3g}; run {big[0]}, the arrow), so the damage axis is symlog, linear below "
        f"{big[1]:.2g}, so that the other points can be read.")
    caption = (
        f"From results.parquet kind=fp and kind=cl: delta_val_loss and R_L at scheme={scheme}, mmr and kurtosis "
        f"at scheme=none; {len(df)} models, FP sweep runs and CL models (colour: optimizer, marker: size).{note} "
        "Titles: correlations.parquet rows with target=delta_val_loss (the largest size, then pooled over "
        "sizes): Pearson r [95 % bootstrap CI], its leave-one-out range (LOO: the smallest and largest r with "
        "one of the plotted models left out; a wide range means a few points carry r) and the rank (Spearman) "
        "correlation. The paper correlates with "
        "post-PTQ accuracy at 760M (MMR 0.62, kurtosis 0.70, R_L −0.89), so its signs are the reverse "
        "of ours."
    )
    return Plot("fig1", title, save(fig, out, "fig1_damage_vs_metrics"), caption)


# ---------------------------------------------------------------- Fig. 2
def fig2_mmr_vs_lr(d: StudyData, out: Path) -> Plot:
    title = "Fig. 2 — MMR vs learning rate"
    fp = d.rows("fp", "mmr")
    sweep = not fp.empty and int(fp.groupby(["optimizer", "size"])["lr"].nunique().max()) >= 2
    src = fp if sweep else d.rows("cl", "mmr")
    if src.empty:
        return missing("fig2", title, "no MMR rows (metric=mmr) for fp or cl models")
    sizes = [s for s in d.sizes if s in set(src["size"])]
    fig, axes = grid(len(sizes))
    for ax, s in zip(axes, sizes, strict=True):
        for o, g in src[src["size"] == s].groupby("optimizer"):
            m = g.groupby("lr")["value"].mean()
            ax.plot(m.index, m.values, marker="o", color=d.color(o), label=d.label(o))
        log_axis(ax, "x", fmt_lr)
        ax.set_xlabel("peak learning rate")
        ax.set_title(d.size_label(s), fontsize=9)
    axes[0].set_ylabel("MMR (model level)")
    optimizer_legend(fig, d, [o for o in d.optimizers if o in set(src["optimizer"])])
    kind = "fp" if sweep else "cl"
    caption = f"From results.parquet kind={kind}, scheme=none, metric=mmr ({len(src)} rows, mean over seeds). "
    if not sweep:
        caption += (
            "MMR was measured only on the Common-Loss models (one LR per optimizer and size), so this shows "
            "one point per optimizer and size; the paper's LR trend needs MMR on the LR-sweep runs."
        )
    return Plot("fig2", title, save(fig, out, "fig2_mmr_vs_lr"), caption)


# ---------------------------------------------------------------- Fig. 3
ABC_TERMS = (("R", "black", "-", 2.0, "R"), ("A", "#1f77b4", "-", 1.2, "A (propagated)"),
             ("B", "#ff7f0e", "-", 1.2, "B (local)"), ("C", "#2ca02c", ":", 1.4, "|C| (interaction)"))


def fig3_abc(d: StudyData, out: Path) -> Plot:
    title = "Fig. 3 — per-module relative error R = A + B + C"
    got = d.propagation_set()
    if got is None:
        return missing("fig3", title, "no runs/<run_id>/ptq/cl/<scheme>/propagation.parquet for the CL models")
    size, scheme, frames = got
    fig, axes = grid(len(frames), h=2.8)
    n_mod, below = 0, []
    for ax, (o, df) in zip(axes, frames.items(), strict=True):
        ch = df[df["kind"] != "linear"].sort_values("index")
        n_mod += len(ch)
        x = np.arange(len(ch))
        for term, color, ls, lw, _ in ABC_TERMS:
            ax.plot(x, positive(ch[term].abs() if term == "C" else ch[term]), color=color, ls=ls, lw=lw, marker=".",
                    ms=5)  # a marker: a value between two zeros has no line segment to show it
        log_axis(ax, "y")
        main = np.concatenate([positive(ch[t]) for t in "RAB"])
        c = positive(ch["C"].abs())
        floor = np.nanmin(main) / 300 if np.isfinite(main).any() else np.nan
        if np.isfinite(floor) and np.nanmin(np.append(c, np.inf)) < floor:  # a tiny |C| would add empty decades
            ax.set_ylim(bottom=floor)
            below.append(d.label(o))
            ax.text(0.02, 0.03, f"|C| min {np.nanmin(c):.1g}: below the axis", transform=ax.transAxes, fontsize=7,
                    color="#2ca02c")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(d.label(o), fontsize=9, color=d.color(o))
        ax.set_xlabel("module (forward order)")
    axes[0].set_ylabel("relative error")
    handles = [Line2D([], [], color=c, ls=ls, lw=lw, marker=".", label=lab) for _, c, ls, lw, lab in ABC_TERMS]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    cut = (f" Where |C| falls 300× below the smallest R, A or B ({', '.join(below)}) the axis stops there."
           if below else "")
    caption = (
        f"From runs/<run_id>/ptq/cl/{scheme}/propagation.parquet (per-token norm) of the "
        f"{len(frames)} CL models at size {size}: rows "
        f"with kind ≠ linear in forward order ({n_mod} modules in all). |C| is drawn because C can be "
        f"negative; a log axis hides zeros (A at the first module, and C where it is exactly 0).{cut}"
    )
    return Plot("fig3", title, save(fig, out, "fig3_abc"), caption)


# ---------------------------------------------------------------- Fig. 4
def fig4_gains(d: StudyData, out: Path) -> Plot:
    title = "Fig. 4 — linear-layer gain G = G₁·G₂"
    got = d.propagation_set()
    lin = {} if got is None else {o: df[df["kind"] == "linear"].sort_values("index") for o, df in got[2].items()}
    lin = {o: df for o, df in lin.items() if len(df)}
    if got is None or not lin:
        return missing("fig4", title, "no linear-layer rows in propagation.parquet")
    size, scheme, _ = got
    fig, axes = grid(3, w=4.3, h=3.1)
    n_layers = max(len(df) for df in lin.values())
    for ax, q, name in zip(axes, ("G", "G1", "G2"), ("gain G", "spectral ratio G₁", "alignment ratio G₂"), strict=True):
        for o, df in lin.items():
            ax.plot(np.arange(len(df)), positive(df[q]), color=d.color(o), lw=1.2, marker=".", ms=3)
        ax.axhline(1.0, color="0.4", lw=0.8, ls="--")
        auto_scale(ax, "y", np.concatenate([df[q].to_numpy(dtype=float) for df in lin.values()]))
        ax.set_xlim(-0.5, n_layers - 0.5)  # the same layers on every panel, also where G or G₂ is undefined
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("linear layer (forward order)")
    optimizer_legend(fig, d, list(lin))
    n = sum(len(df) for df in lin.values())
    undefined = sorted({i for df in lin.values() for i, v in enumerate(df["G"]) if not np.isfinite(v) or v <= 0})
    gap = (f" G and G₂ are undefined at layer(s) {', '.join(map(str, undefined))}, whose input carries no "
           "quantization error yet (G = A / R_in with R_in = 0), so those panels start later." if undefined else "")
    caption = (
        f"From runs/<run_id>/ptq/cl/{scheme}/propagation.parquet at size {size}: rows with kind=linear, "
        "columns G (per-token norm), "
        f"G1, G2 (whole-tensor norm, the only one they exist in; {n} layer rows over {len(lin)} optimizers).{gap} "
        "Dashed: 1. The paper finds G₁ ≈ 1, Muon "
        "with the highest gain and AdamW/Shampoo the lowest."
    )
    return Plot("fig4", title, save(fig, out, "fig4_gains"), caption)

"""The Robustness section (issue 23), from robust.parquet (study/robust.py): does a robust method cut PTQ damage?

Per optimizer × robust arm, units are the (size, seed) pairs where both the arm's run and the plain run
have the number; each cell is the paired mean difference arm − plain with its bootstrap 95 % interval and
the exact sign-flip p (optquant.stats), Holm-corrected over every cell of its column. Damage is Δ val loss
(quantized − FP) at the Common Loss, so the FP loss is equal by construction (both models are the first
to reach the size's threshold) where the model moves between evaluations: a weight average that moves only at
evaluations (lawa) crosses late and below, so the CL models' FP-loss difference is tested too and a cell counts
only where it is not significant; the FP cost shows as the final model's FP val loss and the CL step. The
training cost is the ratio of mean step times: CPU seconds of the study's workers where both runs recorded
them (load from other processes leaves them alone), else wall clock (it does not: benchmarks/robust.py
measures the wall clock side by side). The verdict: an arm cuts damage significantly at no significant FP cost for
an optimizer when its damage p_Holm < α with a negative mean and its final-FP-loss difference is not
significantly positive; the goal is met by an arm that does so with a cut ≥ 30 % at ≤ 1.3× the step time for
at least four optimizers, else the verdict names the closest cell (the smallest p_Holm of a cut). The figure is
the Pareto view: final-model damage against final FP loss.

The decay table (issue 32's `decay:FRACTION` entries) asks whether the LR decay is where the damage comes from:
per optimizer and decay length, the final model's damage and FP loss, paired with the shortest decay that ran
(`decay:0`: no decay, the end of the stable phase at the same budget), the plain run being its own
train.decay_frac (study.json's settings, else TrainConfig's default).
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from optquant.config import TrainConfig
from optquant.files import read_parquet
from optquant.quant.robust_config import RECOMMENDED_ARM
from optquant.report.figures import Plot, grid, missing, save
from optquant.report.html import Section
from optquant.report.load import StudyData, fmt
from optquant.report.paper import label
from optquant.report.tables import Table, not_run
from optquant.runs import StudyDir
from optquant.stats import ALPHA, holm, min_p, paired_test, rank_with_ties, summarize
from optquant.study_spec import StudySpec, setting

ROBUST_FILE = StudyDir(Path()).robust.name  # the captions name it

STEP_TIMES = ("mean_step_cpu_seconds", "mean_step_seconds")  # the cost ratio's measures, the first one both have
GOAL = (-30.0, 1.3)  # the aim: ≥ 30 % less damage at ≤ 1.3× the training cost,
GOAL_OPTIMIZERS = 4  # significant after Holm for at least four of the six optimizers (issue 32)
_fmt = partial(fmt, signed=True)
POWER = 0.8  # the power calculation's target: a 30 % cut is found in 80 % of repeats


def seeds_needed(sd_diff: float, plain_mean: float, cells: int, cut: float = -GOAL[0] / 100) -> int:
    """Paired units n for which a `cut` × plain_mean damage cut, with this sd of the paired differences, is
    significant at Holm's strictest level α/cells with probability POWER: the normal approximation
    n = ((z_{1−α/(2·cells)} + z_POWER) · sd / (cut · mean))², and at least the n whose smallest sign-flip p
    2/2ⁿ is below α/cells."""
    if not (sd_diff > 0 and plain_mean > 0):
        return 0
    z = stats.norm.ppf(1 - ALPHA / (2 * cells)) + stats.norm.ppf(POWER)
    return max(math.ceil((z * sd_diff / (cut * plain_mean)) ** 2), math.floor(math.log2(2 * cells / ALPHA)) + 1)


def seed_plan(results: pd.DataFrame, scheme: str, cells: int, sizes: int = 2) -> list[dict]:
    """The power calculation before an arm runs, from the plain runs alone (results.parquet): per optimizer,
    the Common-Loss damage under `scheme` at the `sizes` largest sizes, its sd over seeds pooled within size,
    and the (size, seed) units seeds_needed gives for a 30 % cut over `cells` Holm cells, with the sd of a
    paired difference taken as √2·sd: an arm's run as noisy as a fresh seed and sharing none of its noise
    with the plain run of its seed (an upper bound for ema, lawa and decay, which share the trajectory)."""
    d = results[(results["kind"] == "cl") & (results["scheme"] == scheme) & (results["metric"] == "delta_val_loss")]
    largest = d.groupby("size")["n_params"].max().sort_values().index[-sizes:]
    out = []
    for opt, g in d[d["size"].isin(largest)].groupby("optimizer"):
        by = g.groupby("size")["value"]
        dof = int((by.count() - 1).clip(lower=0).sum())
        sd = math.sqrt(float(((by.count() - 1) * by.var(ddof=1).fillna(0)).sum()) / dof) if dof else math.nan
        mean = float(g["value"].mean())
        out.append({"opt": opt, "mean": mean, "sd": sd, "units": int(by.count().sum()), "sizes": len(by),
                    "needed": seeds_needed(math.sqrt(2) * sd, mean, cells)})
    return out


def seed_table(results: pd.DataFrame, scheme: str, entries: tuple[str, ...]) -> Table:
    n_opt = results["optimizer"].nunique()
    plan = seed_plan(results, scheme, n_opt * len(entries))
    rows = tuple((label(c["opt"]), f"{c['mean']:.4f}", f"{c['sd']:.4f}", f"{c['sd'] / c['mean']:.2f}",
                  f"{math.sqrt(2) * c['sd']:.4f}", str(c["units"]), str(c["needed"] or "–"),
                  str(math.ceil(c["needed"] / c["sizes"])) if c["needed"] else "–") for c in plan)
    caption = (f"{StudyDir(Path()).results.name}: the plain best-LR runs' Δ val loss under {scheme} at the Common "
               f"Loss, at the {plan[0]['sizes'] if plan else 0} largest sizes; seed sd pooled within size. n for "
               "−30 %: seeds_needed with the sd of a paired difference taken as √2 · seed sd (no noise shared with "
               f"the plain run of the seed; an upper bound where the arm shares its trajectory), Holm over {n_opt} "
               f"optimizers × {len(entries)} entries ({', '.join(entries)}), power {POWER}; seeds = n / sizes.")
    return Table("robust-seeds", f"Seeds to resolve a 30 % damage cut after Holm ({scheme})",
                 ("optimizer", "plain damage", "seed sd", "CV", "paired sd (√2·sd)", "units now", "n for −30 %",
                  "seeds per size"), rows, caption)


def _series(df: pd.DataFrame, arm: str, weights: str, scheme: str, metric: str, opt: str) -> pd.Series:
    m = df[(df["arm"] == arm) & (df["weights"] == weights) & (df["scheme"] == scheme) & (df["metric"] == metric)
           & (df["optimizer"] == opt)]
    return pd.Series(m["value"].to_numpy(float), index=pd.MultiIndex.from_arrays([m["size"], m["seed"]]))


def _cells(df: pd.DataFrame, scheme: str) -> list[dict]:
    """One dict per (optimizer, arm) with the paired tests and ratios of its row."""
    out = []
    for opt in sorted(df["optimizer"].unique()):
        get = partial(_series, df, opt=opt)  # (arm, weights, scheme, metric) → that optimizer's series
        for arm in sorted(a for a in df["arm"].unique() if a != "none"):
            dmg, base = get(arm, "cl", scheme, "delta_val_loss"), get("none", "cl", scheme, "delta_val_loss")
            both = base.index.intersection(dmg.index)
            fp = paired_test(get(arm, "final", scheme, "val_loss_fp"), get("none", "final", scheme, "val_loss_fp"))
            at_cl = paired_test(get(arm, "cl", scheme, "val_loss_fp"), get("none", "cl", scheme, "val_loss_fp"))
            steps = pd.concat([get(arm, "train", "none", m) / get("none", "train", "none", m) for m in STEP_TIMES],
                              axis=1).bfill(axis=1).iloc[:, 0]  # per unit: CPU where both runs recorded it
            rl = get(arm, "cl", scheme, "R_L") / get("none", "cl", scheme, "R_L")
            plain_mean = float(base[both].mean()) if len(both) else math.nan
            out.append({"opt": opt, "arm": arm, "test": paired_test(dmg, base), "fp": fp, "at_cl": at_cl,
                        "change": 100 * (float(dmg[both].mean()) / plain_mean - 1) if plain_mean > 0 else math.nan,
                        "cost": float(steps.dropna().mean()), "rl": 100 * (float(rl.dropna().mean()) - 1),
                        "reached": f"{len(dmg)}/{len(get(arm, 'train', 'none', 'mean_step_seconds'))}",
                        "sd": float((dmg[both] - base[both]).std(ddof=1)) if len(both) > 1 else math.nan,
                        "plain": plain_mean})
    for c in out:
        c["needed"] = seeds_needed(c["sd"], c["plain"], len(out))
    for key in ("test", "fp", "at_cl"):
        for c, p in zip(out, holm([c[key].p for c in out]) if out else [], strict=True):
            c[f"{key}_holm"] = float(p)
    return out


def _pct(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:+.1f} %"


def robustness_table(df: pd.DataFrame, scheme: str) -> tuple[Table, list[dict]]:
    cells = _cells(df, scheme)
    cols = ("optimizer", "method", "n", "Δ damage (arm − plain) [95 % CI]", "change", "p", "p_Holm",
            "Δ FP loss at the CL [95 % CI]", "Δ final FP loss [95 % CI]", "p_Holm FP", "step time ×", "R_L change",
            "CL reached", "n for −30 %")
    rows = tuple((c["opt"], c["arm"], str(c["test"].n), _ci(c["test"]), _pct(c['change']), f"{c['test'].p:.3g}",
                  f"{c['test_holm']:.3g}", _ci(c["at_cl"]), _ci(c["fp"]), f"{c['fp_holm']:.3g}",
                  f"{fmt(c['cost'], 2)}×", _pct(c['rl']), c["reached"], str(c["needed"] or "–")) for c in cells)
    caption = (f"{ROBUST_FILE}: Δ val loss under {scheme} at the Common Loss, paired over (size, seed) with the same "
               f"optimizer's plain best-LR run; exact sign-flip p, Holm over the {len(cells)} cells of each column "
               "(α = 0.05); the smallest attainable p is 2/2ⁿ. Δ FP loss at the CL: the two models compared are at "
               "equal FP loss only where it is near 0 (an average that moves only at evaluations, as lawa's, crosses "
               "the threshold late and below it). Step time ×: mean ratio of mean step seconds, CPU where both runs "
               "recorded it, else wall clock. n for −30 %: the (size, seed) units at which a 30 % cut is significant "
               f"after Holm with power {POWER} (seeds_needed: normal approximation with the cell's measured sd of "
               f"paired differences, at α/cells). Verdict: {verdict(cells)}")
    return Table("robust", f"Robustness: change in PTQ damage ({scheme})", cols, rows, caption), cells


def _ci(t) -> str:
    return f"{_fmt(t.mean_diff)} [{_fmt(t.lo)}, {_fmt(t.hi)}]"


def verdict(cells: list[dict]) -> str:
    """The module docstring's verdict; the goal is also judged at the Common Loss alone, without the final model's
    FP cost, and the arms whose CL models are not at equal FP loss are named."""
    if not cells:
        return "no robust arm ran"
    good, goal, at_cl_goal, unequal = ({c["arm"]: [] for c in cells} for _ in range(4))
    for c in cells:
        cut = c["test_holm"] < ALPHA and c["test"].mean_diff < 0
        fp_ok = not (c["fp_holm"] < ALPHA and c["fp"].mean_diff > 0)
        equal = c["at_cl_holm"] >= ALPHA
        size_ok = cut and equal and c["change"] <= GOAL[0] and c["cost"] <= GOAL[1]
        for names, ok in ((unequal, not equal), (at_cl_goal, size_ok), (good, cut and equal and fp_ok),
                          (goal, size_ok and fp_ok)):
            if ok:
                names[c["arm"]].append(label(c["opt"]))
    n_opt = len({c["opt"] for c in cells})
    parts = [f"{arm}: {'every optimizer' if len(o) == n_opt else ', '.join(o) if o else 'no optimizer'}"
             for arm, o in good.items()]
    met = [f"{arm} ({', '.join(o)})" for arm, o in goal.items() if len(o) >= GOAL_OPTIMIZERS]
    met_at_cl = [f"{arm} ({', '.join(o)})" for arm, o in at_cl_goal.items() if len(o) >= GOAL_OPTIMIZERS]
    off = [f"{arm} ({', '.join(o)})" for arm, o in unequal.items() if o]
    cuts = [c for c in cells if c["test"].mean_diff < 0 and math.isfinite(c["change"]) and c["at_cl_holm"] >= ALPHA]
    near = min(cuts, key=lambda c: (c["test_holm"], c["change"], c["test"].p)) if cuts else None
    closest = "" if met or near is None else (
        f"; closest: {label(near['opt'])} with {near['arm']}, {_pct(near['change'])} "
        f"[{_pct(100 * near['test'].lo / near['plain'])}, {_pct(100 * near['test'].hi / near['plain'])}], "
        f"p {near['test'].p:.3g}, p_Holm {near['test_holm']:.3g}; Δ final FP loss {_fmt(near['fp'].mean_diff)}, "
        f"p_Holm {near['fp_holm']:.3g}")
    return ("Significant damage cut at no significant FP cost — " + "; ".join(parts) + ". Goal (≥ 30 % less damage, "
            f"significant after Holm, at ≤ 1.3× cost for ≥ {GOAL_OPTIMIZERS} optimizers; this study has {n_opt}): "
            f"{'met by ' + ', '.join(met) if met else 'not met'}{closest}. At the Common Loss alone (the final "
            f"model's FP cost left out): {'met by ' + ', '.join(met_at_cl) if met_at_cl else 'not met'}."
            + (f" Not at equal FP loss at the Common Loss (p_Holm < {ALPHA:g}): {'; '.join(off)}." if off else ""))


def scheme_table(df: pd.DataFrame, schemes: list[str]) -> Table:
    per = {s: {(c["opt"], c["arm"]): c for c in _cells(df, s)} for s in schemes}
    keys = list(per[schemes[0]])
    def cell(c: dict | None) -> str:
        return "–" if c is None else f"{_pct(c['change'])} (p_Holm {c['test_holm']:.2g})"

    rows = tuple((label(opt), arm, *(cell(per[s].get((opt, arm))) for s in schemes)) for opt, arm in keys)
    return Table("robust-schemes", "Robustness per PTQ scheme: change in damage at the Common Loss",
                 ("optimizer", "method", *schemes), rows, "Holm within each scheme's column.")


def ranking_table(df: pd.DataFrame, scheme: str) -> Table:
    """The paper's ranking under each method (issue 32): the optimizers ranked by CL damage with ties, per arm."""
    opts = sorted(df["optimizer"].unique())
    arms = ["none", *sorted(a for a in df["arm"].unique() if a != "none")]
    ranks = {arm: rank_with_ties({o: _series(df, arm, "cl", scheme, "delta_val_loss", o) for o in opts})
             for arm in arms}
    def same(r) -> str:  # on the optimizers both rank (an optimizer without units has no rank)
        both = r.rank.keys() & ranks["none"].rank.keys()
        return "same" if {o: r.rank[o] for o in both} == {o: ranks["none"].rank[o] for o in both} else "changed"

    rows = tuple((arm, *(r.label(o) for o in opts), "–" if arm == "none" else same(r)) for arm, r in ranks.items())
    n = max(r.n_units for r in ranks.values())
    caption = (f"{ROBUST_FILE}: Δ val loss under {scheme} at the Common Loss; rank = 1 + number of optimizers "
               "significantly less damaged (paired exact sign-flip test over (size, seed) units, Holm over the "
               f"pairs of each row, α = {ALPHA}); equal ranks (=) are not told apart. Up to {n} units per pair, "
               f"smallest attainable p {min_p(n):.3g}. Last column: is the row's ranking the plain runs'?")
    return Table("robust-ranking", f"PTQ damage ranking of the optimizers under each method ({scheme})",
                 ("method", *opts, "vs none"), rows, caption)


def plain_decay(spec: StudySpec | None, opt: str) -> float:
    """The plain runs' train.decay_frac: the optimizer's setting, else the study's `run`, else the default."""
    return setting(spec, opt, "train.decay_frac", TrainConfig.decay_frac) if spec else TrainConfig.decay_frac


def decay_table(df: pd.DataFrame, scheme: str, spec: StudySpec | None) -> Table | None:
    """Stable vs decayed: each optimizer's final-model damage per decay length, paired with its shortest."""
    decays = {a: float(a.split(":", 1)[1]) for a in df["arm"].unique() if a.startswith("decay:")}
    if not decays:
        return None
    rows, paired = [], []  # paired: (row, damage test, FP-loss test, % change) of each non-reference row
    for opt in sorted(df["optimizer"].unique()):
        frac = {**decays, "none": plain_decay(spec, opt)}
        arms = sorted(frac, key=lambda a: (frac[a], a != "none"))
        dmg = {a: _series(df, a, "final", scheme, "delta_val_loss", opt) for a in arms}
        fp = {a: _series(df, a, "final", scheme, "val_loss_fp", opt) for a in arms}
        for a in arms:
            s = summarize(dmg[a])
            name = f"{frac[a]:g}" + (" (plain)" if a == "none" else " (stable end)" if frac[a] == 0 else "")
            rows.append([label(opt), name, str(s.n), f"{_fmt(s.mean)} [{_fmt(s.lo)}, {_fmt(s.hi)}]", "ref.",
                         *["–"] * 4])
            if a != arms[0]:
                t, base = paired_test(dmg[a], dmg[arms[0]]), float(dmg[arms[0]].mean())
                paired.append((rows[-1], t, paired_test(fp[a], fp[arms[0]]),
                               100 * t.mean_diff / base if base > 0 else math.nan))
    ps = holm([t.p for _, t, _, _ in paired]) if paired else []
    for (row, t, f, change), p in zip(paired, ps, strict=True):
        row[4:] = [_ci(t), _pct(change), f"{t.p:.3g}", f"{p:.3g}", _ci(f)]
    up = sum(p < ALPHA and t.mean_diff > 0 for (_, t, _, _), p in zip(paired, ps, strict=True))
    cols = ("optimizer", "decay (fraction of steps)", "n", "final damage [95 % CI]", "Δ damage vs ref. [95 % CI]",
            "change", "p", "p_Holm", "Δ final FP loss vs ref. [95 % CI]")
    caption = (f"{ROBUST_FILE}: Δ val loss under {scheme} of the final models, per length of the WSD schedule's "
               "LR decay (t-interval of the mean over (size, seed)). ref. = the optimizer's shortest decay; decay 0 "
               "is the end of the stable phase at the same budget. Every other length is paired with it over "
               "(size, seed): mean difference with its bootstrap 95 % interval, exact sign-flip p, Holm over the "
               f"{len(paired)} paired rows; the decay raises damage significantly (p_Holm < {ALPHA}, positive) in "
               f"{up} of them. The last column is the FP loss the decay buys (negative = lower loss).")
    return Table("robust-decay", f"Stable vs decayed: is the LR decay where the PTQ damage comes from? ({scheme})",
                 cols, tuple(tuple(r) for r in rows), caption)


def fig_pareto(df: pd.DataFrame, scheme: str, out: Path) -> Plot:
    title = "Robustness — PTQ damage against FP loss (final models)"
    fin = df[(df["weights"] == "final") & (df["scheme"] == scheme)]
    if fin.empty:
        return missing("robust-pareto", title, "no final-model rows in robust.parquet")
    wide = fin.pivot_table(index=["optimizer", "arm", "size", "seed"], columns="metric", values="value").reset_index()
    opts, arms = sorted(wide["optimizer"].unique()), sorted(wide["arm"].unique())
    fig, axes = grid(len(opts), w=3.6, h=2.9)
    markers = dict(zip(arms, "o^sDvP*X", strict=False))
    for ax, opt in zip(axes, opts, strict=False):
        for i, arm in enumerate(arms):
            g = wide[(wide["optimizer"] == opt) & (wide["arm"] == arm)]
            ax.scatter(g["val_loss_fp"], g["delta_val_loss"], s=14, marker=markers[arm], color=f"C{i}", label=arm)
        ax.set_title(label(opt), fontsize=9)
        ax.set_xlabel("final FP val loss")
        ax.set_ylabel(f"Δ val loss ({scheme})")
    axes[0].legend(fontsize=7)
    caption = (f"{ROBUST_FILE}: each point a final model (size, seed); lower-left is better. The plain runs are arm "
               f"'none'. {int(np.isfinite(wide.get('delta_val_loss', pd.Series(dtype=float))).sum())} models.")
    return Plot("robust-pareto", title, save(fig, out, "robust_pareto"), caption)


def robust_section(d: StudyData, fig_dir: Path) -> Section:
    intro = ("Each optimizer's best-LR runs again with a quantization-robust training method on "
             "(quant/robust.py), measured like the plain runs at the Common Loss. A late-QAT run is the plain "
             "run until its switch step, so where it reaches the Common Loss before the switch its CL model is "
             "the plain one (a difference of exactly 0); its final model shows what QAT changed.")
    df = read_parquet(d.dir.robust) if d.dir.robust.is_file() else None
    schemes = [] if df is None else list(dict.fromkeys(df.loc[df["weights"] == "cl", "scheme"]))
    scheme = damage_scheme(d.spec, schemes, d.results) if d.dir.results.is_file() else None
    plan = () if scheme is None else (seed_table(d.results, scheme, (d.spec and d.spec.robust) or RECOMMENDED_ARM),)
    if df is None:
        return Section("robust", "Robust training", intro,
                       (not_run("robust", "Robustness", "the study has no robust arm (robust=...)"), *plan))
    if not schemes:
        return Section("robust", "Robust training", intro, (not_run("robust", "Robustness", "no CL rows"),))
    return Section("robust", "Robust training", intro,
                   (robustness_table(df, schemes[0])[0], *filter(None, [decay_table(df, schemes[0], d.spec)]),
                    scheme_table(df, schemes), ranking_table(df, schemes[0]), *plan,
                    fig_pareto(df, schemes[0], fig_dir)))


def damage_scheme(spec: StudySpec | None, schemes: list[str], results: pd.DataFrame) -> str | None:
    """The scheme the robust arm is judged on: the Robustness table's (robust.parquet's first CL scheme), before
    the arm has run the study's first PTQ scheme (study/robust.py's), else the plain runs' first CL scheme."""
    cl = list(dict.fromkeys(results.loc[results["kind"] == "cl", "scheme"]))
    return next(iter([*schemes, *(spec.ptq_schemes[:1] if spec else ()), *cl[:1]]), None)


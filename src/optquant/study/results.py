"""Results of a study, gathered from run files: results.parquet, correlations.parquet, fits.json.

results.parquet is long: one row per run × scheme × metric, with the run's size, optimizer, lr, seed,
kind ("fp" LR-sweep run, "cl" Common-Loss model, "qat") and whether it is its (optimizer, size)'s best
LR. Timing metrics (step time, tokens/s) vary between machines and reruns; everything else is
deterministic and equal between an interrupted-and-resumed study and an uninterrupted one.

N in the scaling fits is the N the token budget multiplies: each row carries the run's total and
non-embedding parameter counts and its `train.budget_params`, and `fits` uses the non-embedding count
when the budget does (the `cpu` preset: Kaplan's N, since a 1024-word embedding would otherwise dominate
the small models) and the total otherwise. fits.json names it ("n_count") and names the joint fit (shared
α and E) as the headline ρ ("headline": "joint"); every fit carries its diagnostics and its
identified / not-identified verdict (optquant.scaling).

A study with lm-eval tasks (`eval.tasks`) adds, per Common-Loss model, `acc/<task>`, `acc_norm/<task>` and
`n/<task>` (items) of the FP model (scheme "none") and `acc/<task>`, `acc_norm/<task>`, `delta_acc/<task>`,
`delta_acc_norm/<task>` per PTQ scheme; with several tasks also their mean as task "avg" (the paper's
number: acc_norm averaged over PIQA, HellaSwag and ARC-Easy).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from optquant.config import TrainConfig
from optquant.errors import OptquantError
from optquant.files import atomic_write_json, check_numeric_columns, read_json, read_parquet, write_parquet
from optquant.metrics.outliers import OUTLIER_METRICS
from optquant.ptq_stage import AnalysisConfig, read_result
from optquant.runs import RunDir, StudyDir, read_summary
from optquant.scaling import FitConfig, ScalingPoint, fit_joint, fit_laws, judge
from optquant.study.correlate import correlate
from optquant.study.tuning import LRSearch
from optquant.study_spec import setting

log = logging.getLogger(__name__)
TIMING = ("mean_step_seconds", "tokens_per_s")
FP_METRICS = ("final_val_loss", "best_val_loss", "mean_step_seconds", "optimizer_state_bytes", "tokens_per_s")
PTQ_METRICS = ("val_loss", "mc_acc", "mc_acc_norm", "delta_val_loss", "delta_acc_norm", "R_L", "sum_A",
               "sum_B", "sum_C", "mean_gain", "mean_G1", "mean_G2")
DAMAGE = ("delta_val_loss", "delta_acc_norm")
PREDICTORS = ("mmr", "mmr_batchavg", "kurtosis", "kurt_rms", "R_L", "sum_A", "sum_B")


def metric_rows(base: dict[str, Any], scheme: str, values: dict[str, Any], names) -> list[dict[str, Any]]:
    """`base` with each named value of `values` that is a number (not a bool) as one row."""
    return [{**base, "scheme": scheme, "metric": name, "value": float(v)} for name in names
            if isinstance(v := values.get(name), int | float) and not isinstance(v, bool)]


def gather(study, found: dict[tuple[str, str], LRSearch], thresholds: dict, cl_paths: dict, qat: dict) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []

    def base(run: Path, summary: dict, kind: str, key: tuple[str, str], lr: float, seed: int, best: bool) -> dict:
        """A run's identifying columns, carried from the search (its LR and seed) and the spec."""
        budget = setting(study.spec, key[0], "train.budget_params", TrainConfig.budget_params, found[key].sweeps)
        return {"size": key[1], "n_params": summary.get("n_params"), "optimizer": key[0], "lr": lr, "seed": seed,
                "kind": kind, "best_lr": best, "run_id": run.name,
                "n_params_non_embedding": summary.get("n_params_non_embedding"), "budget_params": budget}

    for key, search in found.items():
        for lr, seed, s in search.runs():
            run = study.runs / s["run_id"]
            row = base(run, s, "fp", key, lr, seed, lr == search.best)
            flags = {"diverged": float(s["status"] == "diverged"), "best_lr_at_edge": float(search.status == "cap"),
                     "lr_bracketed": float(search.status == "bracketed")}
            rows += metric_rows(row, "none", {**s, **flags}, (*FP_METRICS, *flags))
            rows += _ptq_rows(run, row, "final", study.spec.sweep_ptq_schemes, OUTLIER_METRICS)
            if not study.spec.sweep_ptq_schemes and (outliers := RunDir(run).outliers("final")).exists():
                rows += metric_rows(row, "none", read_json(outliers), OUTLIER_METRICS)
    for (opt, size, seed), run in cl_paths.items():
        s = read_summary(run)
        row = base(run, s, "cl", (opt, size), found[(opt, size)].best, seed, True)
        rows += metric_rows(row, "none", {"cl_threshold": thresholds[size], "cl_step": s["cl_step"]},
                            ("cl_threshold", "cl_step"))
        rows += _ptq_rows(run, row, "cl", study.spec.ptq_schemes, ("val_loss", "mc_acc", "mc_acc_norm",
                                                                   *OUTLIER_METRICS))
    for run_id, (key, lr, seed, bits, s) in qat.items():
        row = {**base(study.runs / run_id, s, "qat", key, lr, seed, True), "bits": bits}
        rows += metric_rows(row, f"quest-w{bits}a{bits}", s, ("final_val_loss", "qat_rel_degradation_pct", *TIMING))
    df = pd.DataFrame(rows)
    return df.sort_values(["kind", "size", "optimizer", "lr", "seed", "scheme", "metric"], kind="stable",
                          ignore_index=True) if len(df) else df


def task_scores(damage: dict, side: str) -> dict[str, float]:
    """A PTQ summary's lm-eval scores of one side ("fp" or "q") as flat metrics (see the module docstring);
    a metric a task does not report is left out, and out of the average."""
    tasks = damage.get("tasks") or {}
    out: dict[str, float] = {}
    names = ("acc", "acc_norm", *(("delta_acc", "delta_acc_norm") if side == "q" else ()))
    for task, r in tasks.items():
        fp, own = r.get("fp") or {}, r.get(side) or {}
        for m in ("acc", "acc_norm"):
            if own.get(m) is not None:
                out[f"{m}/{task}"] = float(own[m])
                if side == "q" and fp.get(m) is not None:
                    out[f"delta_{m}/{task}"] = float(own[m]) - float(fp[m])
        if side == "fp" and own.get("n") is not None:
            out[f"n/{task}"] = float(own["n"])
    for m in names if len(tasks) > 1 else ():
        values = [out.get(f"{m}/{t}") for t in tasks]
        if all(v is not None for v in values):
            out[f"{m}/avg"] = float(np.mean(values))
    return out


def _side(damage: dict, metrics: dict, tag: str) -> dict:
    """One side ("fp" or "q") of a PTQ summary under the plain metric names, with the analysis metrics
    (and, quantized, the damage itself: delta_val_loss, ...)."""
    plain = {m: damage.get(f"{m}_{tag}") for m in ("val_loss", "mc_acc", "mc_acc_norm")}
    return plain | (damage if tag == "q" else {}) | metrics


def _ptq_rows(run: Path, base: dict, weights: str, schemes, fp: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each scheme's damage, ABC terms and lm-eval scores on a run's `weights` (the CL model's, or an FP run's final
    model's), and once, from the first scheme's files, the FP model's `fp` metrics and scores."""
    rows, acfg = [], AnalysisConfig(weights=weights)
    for i, scheme in enumerate(schemes):
        damage = read_result(run, acfg, scheme, "damage") or {}
        metrics = read_result(run, acfg, scheme, "analysis") or {}
        tasks_fp, tasks_q = task_scores(damage, "fp"), task_scores(damage, "q")
        if i == 0:  # task scores are named "<metric>/<task>": no metric name clashes with one
            rows += metric_rows(base, "none", _side(damage, metrics, "fp") | tasks_fp, (*fp, *tasks_fp))
        rows += metric_rows(base, scheme, _side(damage, metrics, "q") | tasks_q, (*PTQ_METRICS, *tasks_q))
    return rows


def correlations(df: pd.DataFrame, n_boot: int = 500) -> pd.DataFrame:
    """Each predictor vs PTQ damage, within each size and pooled over sizes, per PTQ scheme.

    The models are every run with PTQ rows for the scheme: FP sweep runs (kind=fp) and Common-Loss models
    (kind=cl), diverged runs left out. Predictors are the run's FP outlier metrics (scheme "none": per-token
    `mmr` as paper.md §6.1 defines it, the authors' batch-averaged `mmr_batchavg`, kurtosis, ...) and the
    scheme's ABC terms. Beside Pearson and Spearman, partial correlations control for the model's FP
    validation loss (`fp_loss` = quantized val loss − Δ val loss of the same evaluation; else the run's
    val_loss or final_val_loss), since damage grows as loss falls. One row per (size, scheme, metric,
    target): size is the preset or "pooled"; n is the number of models in the cell; columns <method>,
    <method>_lo, <method>_hi, <method>_p for pearson, spearman, pearson_partial, spearman_partial.
    """
    runs = df[df.kind.isin(("fp", "cl"))]
    if runs.empty:
        return pd.DataFrame()
    keys = ["run_id", "size", "optimizer", "kind"]
    none = runs[runs.scheme == "none"].pivot_table(index=keys, columns="metric", values="value")
    diverged = set(none.index.get_level_values("run_id")[none["diverged"] > 0]) if "diverged" in none else set()
    fp_own = none.get("val_loss", pd.Series(math.nan, index=none.index))
    if "final_val_loss" in none:
        fp_own = fp_own.fillna(none["final_val_loss"])
    outliers = none[[m for m in OUTLIER_METRICS if m in none]].assign(fp_own=fp_own)
    out = []
    for scheme, g in runs[(runs.scheme != "none") & ~runs.run_id.isin(diverged)].groupby("scheme"):
        wide = g.pivot_table(index=keys, columns="metric", values="value").join(outliers, how="left")
        if "delta_val_loss" not in wide:
            continue
        from_ptq = wide["val_loss"] - wide["delta_val_loss"] if "val_loss" in wide else math.nan
        wide["fp_loss"] = pd.Series(from_ptq, index=wide.index).fillna(wide["fp_own"])
        wide = wide[np.isfinite(wide["delta_val_loss"])].reset_index()
        metrics = [m for m in PREDICTORS if m in wide]
        targets = [t for t in DAMAGE if t in wide]
        for group, part in [*wide.groupby("size"), ("pooled", wide)]:
            tidy = correlate(part, metrics, targets, control="fp_loss", n_boot=n_boot)
            tidy["size"], tidy["scheme"] = group, scheme
            tidy["n_cl"] = int((part["kind"] == "cl").sum())
            out.append(tidy)
    if not out:
        return pd.DataFrame()
    tidy = pd.concat(out, ignore_index=True)
    index = ["size", "scheme", "metric", "target"]
    n = tidy.groupby(index, sort=False)[["n", "n_cl"]].max()
    # unstack (not pivot_table): only the (size, scheme, metric, target) combinations that exist
    wide = tidy.set_index([*index, "method"])[["r", "ci_low", "ci_high", "p"]].unstack("method")
    suffix = {"r": "", "ci_low": "_lo", "ci_high": "_hi", "p": "_p"}
    wide.columns = [method + suffix[value] for value, method in wide.columns]
    return n.join(wide).reset_index()


def fits(df: pd.DataFrame, interval: str = "bootstrap", map_fn: Callable = map) -> dict[str, Any]:
    """Each optimizer's law and the joint fit. They are independent (each bootstrap seeds its own
    generator), so `map_fn` may run them in parallel (a study passes its worker pool's map), joint first:
    it is the longest."""
    rows = df[(df.kind.isin(["fp", "qat"])) & (df.metric == "final_val_loss") & ((df.kind == "qat") | df.best_lr)]
    if (rows.kind == "qat").any() and "bits" not in rows:
        raise OptquantError("results.parquet has QAT rows without a bits column (written before optquant "
                            "recorded it): rerun optquant study in that directory to rewrite it")
    from optquant.report.load import fit_n  # the report draws the fits in the same N

    n, n_count = fit_n(rows)
    points = [ScalingPoint(r.optimizer, float(r.n_fit), float(r.value), quantized=r.kind == "qat",
                           bits=int(r.bits) if r.kind == "qat" else 4,
                           seed=None if pd.isna(r.seed) else int(r.seed))
              for r in rows.assign(n_fit=n).itertuples() if math.isfinite(r.value)]
    out: dict[str, Any] = {"per_optimizer": {}, "joint": None, "errors": {}, "headline": "joint",
                           "n_count": n_count}
    cfg = FitConfig(n_boot=100, interval=interval)
    opts = sorted({p.optimizer for p in points})
    tasks = [("joint", points, cfg)] if points else []
    tasks += [(opt, [p for p in points if p.optimizer == opt], cfg) for opt in opts]
    laws = {}
    for name, fit in map_fn(fit_task, tasks):
        if isinstance(fit, str):
            out["errors"][name] = fit
        elif name == "joint":
            out["joint"] = fit.to_dict()
        else:
            laws.update(fit)
    out["per_optimizer"] = {k: v.to_dict() for k, v in judge(laws, cfg).items()}
    out["errors"] = {k: out["errors"][k] for k in [*opts, "joint"] if k in out["errors"]}  # a fixed order
    return out


def fit_task(task: tuple[str, list[ScalingPoint], FitConfig]) -> tuple[str, Any]:
    """(name, the joint fit or {optimizer: law}) of one `fits` task, or (name, why it cannot be fitted)."""
    name, points, cfg = task
    try:
        return name, fit_joint(points, cfg) if name == "joint" else fit_laws(points, cfg)
    except OptquantError as e:
        return name, str(e)


def write_results(study, found: dict[tuple[str, str], LRSearch], thresholds: dict, cl_paths: dict,
                  qat: dict) -> pd.DataFrame:
    df = gather(study, found, thresholds, cl_paths, qat)
    write_parquet(study.dir.results, df)
    corr = correlations(df)
    write_parquet(study.dir.correlations, corr)
    local = study.pool is not None and study.spec.executor == "local" and study.spec.workers > 1
    map_fn = study.pool.get().map if local else map  # the fits on the study's workers, in parallel
    atomic_write_json(study.dir.fits, fits(df, study.spec.fit_interval, map_fn))
    atomic_write_json(study.dir.best,  # a list: an optimizer's name may be a path (a "/" in a key)
                      [{"optimizer": o, "size": s, **best_record(r)} for (o, s), r in found.items()])
    log.info("results: %d rows, %d correlations", len(df), len(corr))
    return df


def best_record(r: LRSearch) -> dict[str, Any]:
    """best.json's entry of one (optimizer, size)."""
    return {"best_lr": r.best, "status": r.status, "reason": r.reason, "loss": r.best_loss if r.converged else None,
            "seeds": len(r.best_runs()), "ratios": r.ratios, "ratio_status": r.ratio_status,
            "ratio_search": {f: {repr(x): (v if math.isfinite(v) else None) for x, v in sorted(xs.items())}
                             for f, xs in r.ratio_search.items()},
            "groups": r.groups}


def refit(study_dir: Path, interval: str = "bootstrap") -> dict[str, Any]:
    """Recompute correlations.parquet and fits.json from a study's results.parquet (no training)."""
    files = StudyDir(study_dir)
    path = files.results
    if not path.exists():
        raise OptquantError(f"{study_dir}: no {path.name} (run optquant study first)")
    df = read_parquet(path)
    check_numeric_columns(df, path, ("value", "lr", "seed", "n_params"))
    write_parquet(files.correlations, correlations(df))
    out = fits(df, interval)
    atomic_write_json(files.fits, out)
    return out


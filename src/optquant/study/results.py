"""Results of a study, gathered from run files: results.parquet, correlations.parquet, fits.json.

results.parquet is long: one row per run × scheme × metric, with the run's size, optimizer, lr, seed,
kind ("fp" LR-sweep run, "cl" Common-Loss model, "qat") and whether it is its (optimizer, size)'s best
LR. Timing metrics (step time, tokens/s) vary between machines and reruns; everything else is
deterministic and equal between an interrupted-and-resumed study and an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pandas as pd

from optquant.analysis import AnalysisConfig, read_result, write_parquet
from optquant.checkpoint import atomic_write_json
from optquant.errors import OptquantError
from optquant.files import read_parquet
from optquant.metrics.correlate import correlate
from optquant.runs import read_config, read_summary
from optquant.scaling import FitConfig, ScalingPoint, fit_joint, fit_laws

log = logging.getLogger(__name__)
TIMING = ("mean_step_seconds", "tokens_per_s")
FP_METRICS = ("final_val_loss", "best_val_loss", "mean_step_seconds", "optimizer_state_bytes", "tokens_per_s")
OUTLIER_METRICS = ("mmr", "mmr_mean", "kurtosis", "kurt_rms")
PTQ_METRICS = ("val_loss", "mc_acc", "mc_acc_norm", "delta_val_loss", "delta_acc_norm", "R_L", "sum_A",
               "sum_B", "sum_C", "mean_gain", "mean_G1", "mean_G2")
DAMAGE = ("delta_val_loss", "delta_acc_norm")
PREDICTORS = ("mmr", "kurtosis", "kurt_rms", "R_L", "sum_A", "sum_B")


def _rows(base: dict[str, Any], scheme: str, values: dict[str, Any], names) -> list[dict[str, Any]]:
    out = []
    for name in names:
        v = values.get(name)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out.append({**base, "scheme": scheme, "metric": name, "value": float(v)})
    return out


def _base(run: Path, summary: dict, kind: str, size: str, best: bool) -> dict[str, Any]:
    cfg = read_config(run)
    return {"size": size, "n_params": summary.get("n_params"), "optimizer": cfg.optim.name,
            "lr": cfg.optim.lr, "seed": cfg.seed, "kind": kind, "best_lr": best, "run_id": run.name}


def gather(study, table: dict, thresholds: dict, cl_paths: dict, qat: dict) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    for (_, size), row in table.items():
        for lr, summaries in row["lrs"].items():
            for s in summaries:
                run = study.runs / s["run_id"]
                base = _base(run, s, "fp", size, lr == row["best"])
                rows += _rows(base, "none", {**s, "diverged": float(s["status"] == "diverged")},
                              (*FP_METRICS, "diverged"))
                rows += [{**base, "scheme": "none", "metric": "best_lr_at_edge", "value": float(row["edge"])}]
                outliers = run / "ptq" / "final" / "outliers.json"
                if outliers.exists():
                    rows += _rows(base, "none", pd.read_json(outliers, typ="series").to_dict(), OUTLIER_METRICS)
    acfg = AnalysisConfig(weights="cl")
    for (_, size, seed), run in cl_paths.items():
        s = read_summary(run)
        base = _base(run, s, "cl", size, True)
        rows += _rows(base, "none", {"cl_threshold": thresholds[(size, seed)], "cl_step": s["cl_step"]},
                      ("cl_threshold", "cl_step"))
        for scheme in study.spec.ptq_schemes:
            damage = read_result(run, acfg, scheme, "summary.json") or {}
            metrics = read_result(run, acfg, scheme, "analysis.json") or {}
            if scheme == study.spec.ptq_schemes[0]:  # FP numbers of the CL model, once
                fp = {"val_loss": damage.get("val_loss_fp"), "mc_acc": damage.get("mc_acc_fp"),
                      "mc_acc_norm": damage.get("mc_acc_norm_fp"), **metrics}
                rows += _rows(base, "none", fp, ("val_loss", "mc_acc", "mc_acc_norm", *OUTLIER_METRICS))
            q = {"val_loss": damage.get("val_loss_q"), "mc_acc": damage.get("mc_acc_q"),
                 "mc_acc_norm": damage.get("mc_acc_norm_q"), **damage, **metrics}
            rows += _rows(base, scheme, q, PTQ_METRICS)
    for run_id, s in qat.items():
        run = study.runs / run_id
        cfg = read_config(run)
        size = cfg.name.rsplit("-", 1)[-1] if "-" in cfg.name else cfg.name
        base = _base(run, s, "qat", size, True)
        scheme = f"{cfg.qat.method}-w{cfg.qat.w_bits}a{cfg.qat.a_bits}"
        rows += _rows(base, scheme, s, ("final_val_loss", "qat_rel_degradation_pct", *TIMING))
    df = pd.DataFrame(rows)
    return df.sort_values(["kind", "size", "optimizer", "lr", "seed", "scheme", "metric"], kind="stable",
                          ignore_index=True) if len(df) else df


def correlations(df: pd.DataFrame) -> pd.DataFrame:
    """Across CL models: each predictor (FP outliers; the scheme's ABC terms) vs PTQ damage."""
    cl = df[df.kind == "cl"]
    if cl.empty:
        return pd.DataFrame()
    outliers = cl[(cl.scheme == "none") & cl.metric.isin(OUTLIER_METRICS)].pivot_table(
        index=["run_id", "size", "optimizer"], columns="metric", values="value")
    out = []
    for scheme, g in cl[cl.scheme != "none"].groupby("scheme"):
        wide = g.pivot_table(index=["run_id", "size", "optimizer"], columns="metric", values="value")
        wide = wide.join(outliers, how="left").reset_index()
        metrics = [m for m in PREDICTORS if m in wide]
        targets = [t for t in DAMAGE if t in wide]
        for group, part in [("all", wide), *wide.groupby("size")]:
            tidy = correlate(part, metrics, targets, n_boot=500)
            tidy["size"], tidy["scheme"] = group, scheme
            out.append(tidy)
    tidy = pd.concat(out, ignore_index=True)
    # unstack (not pivot_table): only the (size, scheme, metric, target) combinations that exist
    wide = tidy.set_index(["size", "scheme", "metric", "target", "n", "method"])[["r", "ci_low", "ci_high"]]
    wide = wide.unstack("method").reset_index()
    wide.columns = [_col(a, b) for a, b in wide.columns]
    return wide


def _col(value: str, method: str) -> str:
    if not method:
        return value
    return {"r": method, "ci_low": f"{method}_lo", "ci_high": f"{method}_hi"}[value]


def fits(df: pd.DataFrame, interval: str = "bootstrap") -> dict[str, Any]:
    fp = df[(df.kind == "fp") & df.best_lr & (df.metric == "final_val_loss")]
    qat = df[(df.kind == "qat") & (df.metric == "final_val_loss")]
    points = [ScalingPoint(r.optimizer, int(r.n_params), float(r.value)) for r in fp.itertuples()
              if math.isfinite(r.value)]
    points += [ScalingPoint(r.optimizer, int(r.n_params), float(r.value), quantized=True,
                            bits=int(r.scheme.split("w")[1].split("a")[0])) for r in qat.itertuples()
               if math.isfinite(r.value)]
    out: dict[str, Any] = {"per_optimizer": {}, "joint": None, "errors": {}}
    cfg = FitConfig(n_boot=100, interval=interval)
    for opt in sorted({p.optimizer for p in points}):
        try:
            out["per_optimizer"].update({k: v.to_dict() for k, v in
                                         fit_laws([p for p in points if p.optimizer == opt], cfg).items()})
        except OptquantError as e:
            out["errors"][opt] = str(e)
    try:
        out["joint"] = fit_joint(points, cfg).to_dict() if points else None
    except OptquantError as e:
        out["errors"]["joint"] = str(e)
    return out


def write_results(study, table: dict, thresholds: dict, cl_paths: dict, qat: dict) -> pd.DataFrame:
    df = gather(study, table, thresholds, cl_paths, qat)
    write_parquet(study.root / "results.parquet", df)
    corr = correlations(df)
    write_parquet(study.root / "correlations.parquet", corr)
    atomic_write_json(study.root / "fits.json", fits(df, study.spec.fit_interval))
    atomic_write_json(study.root / "best.json", {f"{o}/{s}": {"best_lr": r["best"], "edge": r["edge"],
                                                             "loss": r["best_loss"]}
                                                 for (o, s), r in table.items()})
    log.info("results: %d rows, %d correlations", len(df), len(corr))
    return df


def refit(study_dir: Path, interval: str = "bootstrap") -> dict[str, Any]:
    """Recompute correlations.parquet and fits.json from a study's results.parquet (no training)."""
    path = Path(study_dir) / "results.parquet"
    if not path.exists():
        raise OptquantError(f"{study_dir}: no results.parquet (run optquant study first)")
    df = read_parquet(path)
    write_parquet(Path(study_dir) / "correlations.parquet", correlations(df))
    out = fits(df, interval)
    atomic_write_json(Path(study_dir) / "fits.json", out)
    return out


"""The study's two kinds of job, each idempotent: train one run; quantize and analyse one model.

A run directory is locked (runs.locked: fcntl, released when the process dies) while a job works in it,
as `optquant train/ptq/analyze` lock it, so no two processes ever write the same run at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optquant.analysis import AnalysisConfig, analyze, fp_outliers, out_dir, ptq_eval, read_result
from optquant.config import from_dict
from optquant.quant.ptq import PTQConfig
from optquant.runs import locked
from optquant.train import train


def train_job(config: dict[str, Any], run_dir: str) -> dict[str, Any]:
    with locked(Path(run_dir)):
        return train(from_dict(config), Path(run_dir))


def ptq_job(run_dir: str, ptq: dict[str, Any], weights: str, mc_items: int) -> dict[str, Any]:
    """PTQ damage + outliers + ABC for one (model, scheme); reuses what an earlier attempt wrote."""
    qcfg, acfg = PTQConfig(**ptq), AnalysisConfig(weights=weights, mc_items=mc_items)
    path = Path(run_dir)
    with locked(out_dir(path, acfg, qcfg.name)):
        damage = read_result(path, acfg, qcfg.name, "summary.json") or ptq_eval(path, qcfg, acfg)
        metrics = read_result(path, acfg, qcfg.name, "analysis.json") or analyze(path, qcfg, acfg)
    return {**damage, **metrics}


def outliers_job(run_dir: str) -> dict[str, Any]:
    with locked(Path(run_dir) / "ptq"):
        return fp_outliers(Path(run_dir))

"""The study's two kinds of job, each idempotent: train one run; quantize and analyse one model.

A run directory is locked (runs.locked: fcntl, released when the process dies) while a job works in it,
as `optquant train/ptq/analyze` lock it, so no two processes ever write the same run at once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from optquant.config import from_dict
from optquant.harness import HarnessConfig
from optquant.ptq_stage import (
    AnalysisConfig,
    LoadedRun,
    covers,
    fp_outliers,
    out_dir,
    ptq_analysis,
    ptq_damage,
    read_result,
)
from optquant.quant.ptq import PTQConfig
from optquant.runs import locked
from optquant.train import train

TIMING_KEY = "_seconds_by_part"


def train_job(config: dict[str, Any], run_dir: str) -> dict[str, Any]:
    with locked(Path(run_dir)):
        return train(from_dict(config), Path(run_dir))


def analysis_config(weights: str, mc_items: int, harness: dict[str, Any] | None = None) -> AnalysisConfig:
    """A PTQ job's AnalysisConfig from its (picklable) arguments."""
    h = HarnessConfig(**{**(harness or {}), "tasks": tuple((harness or {}).get("tasks", ()))})
    return AnalysisConfig(weights=weights, mc_items=mc_items, harness=h)


def ptq_job(run_dir: str, ptq: dict[str, Any], weights: str, mc_items: int,
            harness: dict[str, Any] | None = None) -> dict[str, Any]:
    """PTQ damage + outliers + ABC for one (model, scheme); reuses what an earlier attempt wrote (if it
    covers the evaluations asked for). `harness`: lm-eval tasks (HarnessConfig as a dict) to score on.
    The model, its tokens and the quantized copy are loaded/built once for both parts. The result's
    `TIMING_KEY` entry (seconds of each part) is for the executor's cost log, which removes it."""
    qcfg, acfg = PTQConfig(**ptq), analysis_config(weights, mc_items, harness)
    path = Path(run_dir)
    run: LoadedRun | None = None
    parts = {}
    with locked(out_dir(path, acfg, qcfg.name)):
        t = time.perf_counter()
        damage = read_result(path, acfg, qcfg.name, "summary.json")
        if not covers(damage, acfg):
            run = LoadedRun(path, acfg.weights)
            damage = ptq_damage(path, qcfg, acfg, run)
        parts["ptq"] = time.perf_counter() - t
        t = time.perf_counter()
        metrics = read_result(path, acfg, qcfg.name, "analysis.json")
        if metrics is None:
            metrics = ptq_analysis(path, qcfg, acfg, run or LoadedRun(path, acfg.weights))
        parts["analysis"] = time.perf_counter() - t
    return {**damage, **metrics, TIMING_KEY: parts}


def outliers_job(run_dir: str) -> dict[str, Any]:
    with locked(Path(run_dir) / "ptq"):
        return fp_outliers(Path(run_dir))

"""Study tests: the whole pipeline at smoke scale, its resumability, and the executors.

The kill test runs the study CLI in a subprocess, SIGKILLs its process group once a few runs are
done (mid-stage, with workers busy), reruns it, and compares results.parquet with an uninterrupted
study: every deterministic metric must be equal (timings are excluded: they are measurements).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from optquant.runs import read_metrics
from optquant.study.executor import Job, execute
from optquant.study.plan import run_study
from optquant.study.results import TIMING, refit
from optquant.study.spec import StudySpec, apply_study_overrides, lr_grid, study_preset

CL_TOLERANCE = 0.05  # relative; smoke runs are 30 steps, where one early step moves the loss by up to ~4 %


def small_spec(corpus, **kw) -> StudySpec:
    spec = study_preset("smoke")
    spec = apply_study_overrides(spec, [f"run=data.source={corpus}", "run=model.vocab_size=320",
                                        "optimizers=adamw,muon", "ptq_schemes=w4a4-rtn,w4a4-gptq-had",
                                        "lrs.adamw=0.001,0.003"])
    return apply_study_overrides(spec, [f"{k}={v}" for k, v in kw.items()])


def test_lr_grid_and_overrides():
    spec = StudySpec(lr_points=3, lr_step=3.0)
    assert lr_grid(spec, "adamw") == (1e-3, 3e-3, 9e-3)
    spec = apply_study_overrides(spec, ["lrs.muon=0.01,0.02", "sizes=nano", "sweeps.muon.optim.momentum=0.9,0.95"])
    assert lr_grid(spec, "muon") == (0.01, 0.02) and spec.sizes == ("nano",)
    assert spec.sweeps == {"muon": {"optim.momentum": ("0.9", "0.95")}}


def test_bad_study_overrides():
    from optquant.errors import OptquantError

    with pytest.raises(OptquantError, match="unknown optimizer"):
        apply_study_overrides(StudySpec(), ["optimizers=adamw,sgd"])
    with pytest.raises(OptquantError, match="unknown field"):
        apply_study_overrides(StudySpec(), ["sizez=nano"])
    with pytest.raises(OptquantError, match=r"eval.include_path=.*/nowhere: no such directory"):
        apply_study_overrides(StudySpec(), ["eval.tasks=mytask", "eval.include_path=/nowhere"])
    with pytest.raises(OptquantError, match="eval.tasks is empty"):
        apply_study_overrides(StudySpec(), [f"eval.include_path={Path(__file__).parent}"])
    with pytest.raises(OptquantError, match="eval.limit=-1"):
        apply_study_overrides(StudySpec(), ["eval.limit=-1"])


def test_study_end_to_end_with_sweep(corpus, tmp_path):
    spec = small_spec(corpus, workers=1)
    spec = apply_study_overrides(spec, ["sweeps.muon.optim.momentum=0.9,0.95"])
    report = run_study(spec, tmp_path / "study")
    df = pd.read_parquet(tmp_path / "study" / "results.parquet")
    assert set(df.kind) == {"fp", "cl", "qat"}
    cl = df[(df.kind == "cl") & (df.metric == "delta_val_loss")]
    assert len(cl) == 2 * 2 * 2 * 2  # optimizers × sizes × seeds × schemes
    fp_best = df[(df.kind == "fp") & df.best_lr & (df.metric == "final_val_loss")]
    assert len(fp_best) == 2 * 2 * 2 and set(fp_best.optimizer) == {"adamw", "muon"}  # × seeds
    # each CL model's fp32 val loss sits at or just below its size's common loss (every evaluation from the
    # last one above it is fine-grained): within CL_TOLERANCE of it, so PTQ damage compares equals
    cl = df[(df.kind == "cl") & (df.scheme == "none")].pivot_table(
        index=["size", "optimizer", "seed"], columns="metric", values="value")
    assert len(cl) == 2 * 2 * 2
    gap = cl.val_loss / cl.cl_threshold - 1
    assert (gap <= 1e-4 + 1e-9).all() and (gap >= -CL_TOLERANCE).all(), gap
    for run in (tmp_path / "study" / "runs").iterdir():  # found to the step: the step before was above CL
        summary = json.loads((run / "summary.json").read_text())
        if summary.get("cl_step"):
            *_, before, at = read_metrics(run)
            assert at["step"] == summary["cl_step"] and before["step"] == at["step"] - 1
            assert at["val_loss"] <= summary["cl_threshold"] < before["val_loss"]
    qat = df[(df.kind == "qat") & (df.metric == "qat_rel_degradation_pct")]
    assert len(qat) == 2 * 2 * 2 and qat.value.notna().all()
    assert set(qat.bits) == {4} and set(qat["size"]) == set(spec.sizes)  # carried as data, not parsed from names
    # every LR search ends with a status; only bracketed ones are unflagged
    best = json.loads((tmp_path / "study" / "best.json").read_text())
    assert {b["status"] for b in best.values()} <= {"bracketed", "diverged", "cap", "no-converged-lr"}
    assert all(b["seeds"] == 2 for b in best.values())
    # PTQ of every finished sweep run's final model (for within-size correlations)
    sweep = df[(df.kind == "fp") & (df.scheme == "w4a4-rtn") & (df.metric == "delta_val_loss")]
    assert len(sweep) == len(df[(df.kind == "fp") & (df.metric == "final_val_loss")])
    assert not list((tmp_path / "study" / "runs").glob("*/history"))  # pruned after the CL stage
    assert (tmp_path / "study" / "fits.json").exists() and report.exists()
    # correlations within each size over every model with PTQ rows (sweep runs + CL models), then pooled
    corr = pd.read_parquet(tmp_path / "study" / "correlations.parquet")
    assert set(corr["size"]) == {"pooled", *spec.sizes}
    rtn = df[(df.scheme == "w4a4-rtn") & (df.metric == "delta_val_loss") & df.kind.isin(["fp", "cl"])]
    pooled = corr[(corr["size"] == "pooled") & (corr["scheme"] == "w4a4-rtn") & (corr["metric"] == "R_L")
                  & (corr["target"] == "delta_val_loss")]  # fmt: skip
    assert list(pooled["n"]) == [rtn["value"].notna().sum()] and "pearson_partial" in corr
    # the sweep fixed muon's momentum for every size: its runs carry the chosen value
    runs = [p for p in (tmp_path / "study" / "runs").iterdir() if "-muon-" in p.name]
    assert any('"momentum": 0.9' in (p / "config.json").read_text() for p in runs)


def _deterministic(df: pd.DataFrame) -> pd.DataFrame:
    return df[~df.metric.isin(TIMING)].reset_index(drop=True)


def _study_cmd(corpus, out: Path) -> list[str]:
    return [sys.executable, "-m", "optquant.cli", "study", "--preset", "smoke", "--out", str(out), "--quiet",
            "--set", f"run=data.source={corpus}", "--set", "run=model.vocab_size=320", "--set", "sizes=femto",
            "--set", "optimizers=adamw,muon", "--set", "ptq_schemes=w4a4-gptq-had",
            "--set", "lrs.adamw=0.001,0.003", "--set", "workers=2", "--set", "seeds=0", "--set", "lr_extensions=0"]


def test_killed_study_resumes_to_the_same_results(corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = tmp_path / "straight"
    subprocess.run(_study_cmd(corpus, straight), check=True, env=env, timeout=600)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_study_cmd(corpus, killed), env=env, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(killed.glob("runs/*/summary.json"))) < 3:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "results.parquet").exists()
    subprocess.run(_study_cmd(corpus, killed), check=True, env=env, timeout=600)
    a = _deterministic(pd.read_parquet(straight / "results.parquet"))
    b = _deterministic(pd.read_parquet(killed / "results.parquet"))
    pd.testing.assert_frame_equal(a, b)


def test_submitit_local_executor_runs_train_jobs(nano_cfg, tmp_path):
    from optquant.config import apply_overrides, to_dict

    jobs = [Job("train", f"r{i}", {"config": to_dict(apply_overrides(nano_cfg, [f"seed={i}", "train.steps=10"])),
                                   "run_dir": str(tmp_path / f"r{i}")}) for i in range(2)]
    results = execute(jobs, "submitit-local", 1, tmp_path / "submitit")
    assert {k: v["status"] for k, v in results.items()} == {"r0": "done", "r1": "done"}
    assert results["r0"]["final_val_loss"] != results["r1"]["final_val_loss"]


def test_fit_command_rebuilds_fits_from_results(smoke_study, tmp_path, capsys):
    import shutil

    from optquant.cli import main

    shutil.copytree(smoke_study, tmp_path / "study")  # conftest's real smoke study, shared with test_report
    (tmp_path / "study" / "fits.json").unlink()
    assert main(["fit", str(tmp_path / "study"), "--interval", "none"]) == 0
    assert (tmp_path / "study" / "fits.json").exists()
    assert "written:" in capsys.readouterr().out
    assert main(["fit", str(tmp_path / "nothing")]) == 2
    # the fit counts N as the token budget does: total here (smoke), non-embedding when the runs say so
    study = tmp_path / "study"
    sizes = json.loads((study / "study.json").read_text())["sizes"]
    fits = json.loads((study / "fits.json").read_text())
    assert fits["n_count"] == "total" and fits["headline"] == "joint"
    used = {r["n_params"] for f in fits["per_optimizer"].values() for r in f["diagnostics"]["residuals"]}
    assert used == {s["n_params"] for s in sizes.values()}
    df = pd.read_parquet(study / "results.parquet")
    df.assign(budget_params="non_embedding").to_parquet(study / "results.parquet")
    fits = refit(study, "none")
    assert fits["n_count"] == "non_embedding"
    used = {r["n_params"] for f in fits["per_optimizer"].values() for r in f["diagnostics"]["residuals"]}
    assert used == {s["n_params_non_embedding"] for s in sizes.values()} and used.isdisjoint(
        {s["n_params"] for s in sizes.values()})

"""Study tests: the whole pipeline at smoke scale, its resumability, and the executors.

The pipeline test reads conftest's session `smoke_study` (the smoke preset on 2 optimizers × 2 sizes, with a
sweep of Muon's momentum), which test_report shares. The kill test runs the study CLI in a subprocess,
SIGKILLs its process group in the middle of a training job, reruns the same command, and compares
results.parquet with an uninterrupted study: every deterministic metric must be equal (timings are excluded:
they are measurements). By default the study runs its jobs in its own process (workers=1), so the kill lands
mid-run and leaves a checkpoint and partial metrics behind; the same test with 2 spawned workers busy at the
kill is `slow` (each stage's pool costs two worker start-ups, ~80 s in all); test_reliability checks that such
workers die with the study.
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
from optquant.study.executor import execute
from optquant.study.jobs import TrainJob
from optquant.study.plan import run_study
from optquant.study.results import TIMING, refit
from optquant.study_spec import StudySpec, apply_study_overrides, lr_grid, study_preset

# relative; smoke runs are 30 steps, where one early step moves the loss by up to ~16 % with the tuned (tied) group
# step sizes: the check below that the step before each CL model was above CL is what shows the crossing is found
CL_TOLERANCE = 0.2


def test_lr_grid_and_overrides():
    spec = StudySpec(lr_points=3, lr_step=3.0)
    assert lr_grid(spec, "adamw") == (1e-3, 3e-3, 9e-3)
    spec = apply_study_overrides(spec, ["lrs.muon=0.01,0.02", "sizes=nano", "sweeps.muon.optim.momentum=0.9,0.95"])
    assert lr_grid(spec, "muon") == (0.01, 0.02) and spec.sizes == ("nano",)
    assert spec.sweeps == {"muon": {"optim.momentum": (0.9, 0.95)}}  # parsed once, by the field's type


def test_study_json_round_trips_through_the_typed_spec_and_old_files_still_load():
    """study.json is written by spec_to_dict and read by spec_from_dict, for every preset; a study.json written
    before the typed spec (tests/data/study-cpu.json: `run`, `per_optimizer` and sweep values as `field=value`
    strings) loads with its settings parsed by their fields' types, the same as the preset's."""
    from optquant.study_spec import STUDY_PRESETS, cpu, run_config, spec_from_dict, spec_to_dict

    for name in STUDY_PRESETS:
        spec = study_preset(name)
        assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))) == spec, name
    old = json.loads((Path(__file__).parent / "data" / "study-cpu.json").read_text())["spec"]
    assert "train.precision=fp32" in old["run"] and old["per_optimizer"]["muon"] == ["optim.ns_dtype=fp32"]
    loaded = spec_from_dict({**old, "sweeps": {"muon": {"optim.momentum": ["0.9", "0.95"]}}})
    assert loaded.run == cpu().run and loaded.run["train.tokens_per_param"] == 20.0
    assert loaded.sweeps == {"muon": {"optim.momentum": (0.9, 0.95)}}
    for opt in cpu().optimizers:  # its per_optimizer has fields' old names (LEGACY_NAMES): the same runs
        assert run_config(loaded, "zepto", opt, 1e-3) == run_config(cpu(), "zepto", opt, 1e-3), opt


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


def test_study_end_to_end_with_sweep(smoke_study):
    root = smoke_study  # run_study on the smoke preset, with sweeps.muon.optim.momentum=0.9,0.95 (conftest)
    sizes = tuple(json.loads((root / "study.json").read_text())["spec"]["sizes"])
    assert len(sizes) == 2
    df = pd.read_parquet(root / "results.parquet")
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
    for run in (root / "runs").iterdir():  # found to the step: the step before was above CL
        summary = json.loads((run / "summary.json").read_text())
        if summary.get("cl_step"):
            *_, before, at = read_metrics(run)
            assert at["step"] == summary["cl_step"] and before["step"] == at["step"] - 1
            assert at["val_loss"] <= summary["cl_threshold"] < before["val_loss"]
    qat = df[(df.kind == "qat") & (df.metric == "qat_rel_degradation_pct")]
    assert len(qat) == 2 * 2 * 2 and qat.value.notna().all()
    assert set(qat.bits) == {4} and set(qat["size"]) == set(sizes)  # carried as data, not parsed from names
    # every LR search ends with a status; only bracketed ones are unflagged
    best = json.loads((root / "best.json").read_text())
    assert {b["status"] for b in best} <= {"bracketed", "diverged", "cap", "no-converged-lr"}
    assert all(b["seeds"] == 2 for b in best)
    assert sorted((b["optimizer"], b["size"]) for b in best) == [(o, s) for o in ("adamw", "muon") for s in sizes]
    # PTQ of every finished sweep run's final model (for within-size correlations)
    sweep = df[(df.kind == "fp") & (df.scheme == "w4a4-rtn") & (df.metric == "delta_val_loss")]
    assert len(sweep) == len(df[(df.kind == "fp") & (df.metric == "final_val_loss")])
    assert not list((root / "runs").glob("*/history"))  # pruned after the CL stage
    assert (root / "fits.json").exists() and (root / "report" / "index.html").exists()
    # correlations within each size over every model with PTQ rows (sweep runs + CL models), then pooled
    corr = pd.read_parquet(root / "correlations.parquet")
    assert set(corr["size"]) == {"pooled", *sizes}
    rtn = df[(df.scheme == "w4a4-rtn") & (df.metric == "delta_val_loss") & df.kind.isin(["fp", "cl"])]
    pooled = corr[(corr["size"] == "pooled") & (corr["scheme"] == "w4a4-rtn") & (corr["metric"] == "R_L")
                  & (corr["target"] == "delta_val_loss")]  # fmt: skip
    assert list(pooled["n"]) == [rtn["value"].notna().sum()] and "pearson_partial" in corr
    # the sweep fixed muon's momentum for every size: its runs carry the chosen value
    runs = [p for p in (root / "runs").iterdir() if "-muon-" in p.name]
    assert any('"momentum": 0.9' in (p / "config.json").read_text() for p in runs)


def _deterministic(df: pd.DataFrame) -> pd.DataFrame:
    return df[~df.metric.isin(TIMING)].reset_index(drop=True)


def _kill_sets(corpus, workers: int) -> list[str]:
    return [f"run=data.source={corpus}", "run=model.vocab_size=320", "sizes=femto", "optimizers=adamw,muon",
            "ptq_schemes=w4a4-gptq-had", "lrs.adamw=0.001,0.003", f"workers={workers}", "seeds=0",
            "lr_extensions=0"]


def _mid_run(root: Path) -> bool:
    """A run with a checkpoint and an evaluation written, and no summary yet: a job in the middle of training."""
    return any((p.parent / "metrics.jsonl").exists() and not (p.parent / "summary.json").exists()
               for p in root.glob("runs/*/checkpoint.safetensors"))


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_killed_study_resumes_to_the_same_results(corpus, tmp_path, monkeypatch, workers):
    """Straight and resumed studies run in this process (same threads as the CLI's: one), the killed one
    in a subprocess of its own session so that SIGKILL reaches the study and every worker at once. They
    skip the report (the last step, of files already compared here; test_report tests it)."""
    import optquant.report
    from optquant.cli import main

    monkeypatch.setattr(optquant.report, "render_report", lambda root: Path(root) / "report" / "index.html")
    sets = _kill_sets(corpus, workers)
    straight = tmp_path / "straight"
    run_study(apply_study_overrides(study_preset("smoke"), sets), straight)
    killed = tmp_path / "killed"
    args = ["study", "--preset", "smoke", "--out", str(killed), "--quiet", *(x for s in sets for x in ("--set", s))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "optquant.cli", *args], env=env, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (len(list(killed.glob("runs/*/summary.json"))) >= 3 and _mid_run(killed)):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "results.parquet").exists() and _mid_run(killed)
    assert main(args) == 0
    a = _deterministic(pd.read_parquet(straight / "results.parquet"))
    b = _deterministic(pd.read_parquet(killed / "results.parquet"))
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("cluster", ["debug", pytest.param("local", marks=pytest.mark.slow)])
def test_submitit_local_executor_runs_train_jobs(nano_cfg, tmp_path, monkeypatch, cluster):
    """The submitit route of `execute` (the Slurm path). By default submitit's debug cluster runs each job in
    this process through the same submit/result calls; `slow` runs them as submitit's local processes (each
    imports torch and optquant: ~15 s). Job pickling across processes is covered by test_reliability's
    worker pool."""
    import submitit

    from optquant.config import apply_overrides

    real = submitit.AutoExecutor

    def auto_executor(folder, cluster=None, **kw):
        assert cluster == "local"  # what execute asks for with submitit-local
        return real(folder=folder, cluster=chosen, **kw)

    chosen = cluster
    monkeypatch.setattr(submitit, "AutoExecutor", auto_executor)
    jobs = [TrainJob(apply_overrides(nano_cfg, [f"seed={i}", "train.steps=10"]), tmp_path / f"r{i}") for i in range(2)]
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

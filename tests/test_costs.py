"""A study that wastes nothing: one load per PTQ job, finished jobs never rerun, longest first, and the
cost log (costs.jsonl) with the report's cost section built from what the executor really wrote."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from optquant.config import apply_overrides
from optquant.harness import HarnessConfig
from optquant.ptq_stage import AnalysisConfig, ptq_analysis, ptq_damage, scheme_config
from optquant.report.timings import read_timings, timing_section, utilisation
from optquant.study import executor
from optquant.study.executor import estimate_cost, execute, longest_first
from optquant.study.jobs import PTQJob, TrainJob
from optquant.train import train


def _train_job(cfg, root, name: str, *extra: str) -> TrainJob:
    return TrainJob(apply_overrides(cfg, list(extra)), root / "runs" / name)


@dataclass(frozen=True)
class Pinned(TrainJob):
    def cost(self) -> float:
        return 1e30


def test_longest_first_by_estimated_training_cost(nano_cfg, tmp_path):
    short = _train_job(nano_cfg, tmp_path, "short", "train.steps=5")
    long = _train_job(nano_cfg, tmp_path, "long", "train.steps=50")
    wide = _train_job(nano_cfg, tmp_path, "wide", "train.steps=50", "model.d_model=96")
    assert estimate_cost(wide) > estimate_cost(long) > estimate_cost(short) > 0
    assert [j.key for j in longest_first([short, long, wide])] == ["wide", "long", "short"]
    pinned = Pinned(short.cfg, tmp_path / "runs" / "pinned")  # a job's own cost is what counts
    assert longest_first([short, long, pinned])[0].key == "pinned"


def test_costs_logged_and_finished_jobs_not_rerun(nano_cfg, tmp_path, monkeypatch):
    # named like a study's run: the size comes from the config's preset field, not from the name
    jobs = [_train_job(nano_cfg, tmp_path, f"r{i}", "train.steps=6", f"seed={i}", "name=study-x") for i in range(2)]
    qat = _train_job(nano_cfg, tmp_path, "q", "train.steps=6", "qat.method=quest")
    results = execute([*jobs, qat], "local", 1, tmp_path / "submitit")
    records = read_timings(tmp_path)
    assert sorted(r["key"] for r in records) == ["q", "r0", "r1"]
    by_key = {r["key"]: r for r in records}
    assert by_key["r0"]["stage"] == "fp" and by_key["q"]["stage"] == "qat"
    assert by_key["r0"]["optimizer"] == "adamw" and by_key["r0"]["size"] == "nano" == nano_cfg.preset
    assert all(r["end"] >= r["start"] and r["seconds"] > 0 for r in records)
    assert set(by_key["q"]["parts"]) == {"qat"} and set(by_key["r0"]["parts"]) == {"training"}
    # a second submission of finished runs is answered from their files: no worker, no new cost line
    monkeypatch.setattr(executor, "timed_job", lambda job: pytest.fail(f"{job.key} was rerun"))
    again = execute([*jobs, qat], "local", 1, tmp_path / "submitit")
    assert again == results and len(read_timings(tmp_path)) == 3


def test_a_robust_arms_model_option_run_is_logged_as_robust(nano_cfg, tmp_path):
    """A robust entry that changes only the model (model.attn_gate=true) leaves the method plain with the CL
    threshold set, so its config reads as a Common-Loss run's: the study says its kind (plan.robust_stage), or
    the ETA would price it, and the cost section count it, as a short CL re-run."""
    cfg = apply_overrides(nano_cfg, ["train.steps=6", "model.attn_gate=true", "train.cl_threshold=1.0"])
    assert TrainJob(cfg, tmp_path / "runs" / "a").stage == "cl"
    execute([TrainJob(cfg, tmp_path / "runs" / "a", "robust")], "local", 1, tmp_path / "submitit")
    assert [r["stage"] for r in read_timings(tmp_path)] == ["robust"]


def test_ptq_job_loads_once_and_matches_separate_calls(nano_cfg, tmp_path, monkeypatch):
    import optquant.ptq_stage as analysis

    cfg = apply_overrides(nano_cfg, ["train.steps=10"])
    run = tmp_path / "run"
    train(cfg, run)
    scheme = scheme_config("w4a4-gptq")
    loads = []
    real = analysis.load_run_model
    monkeypatch.setattr(analysis, "load_run_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    out, parts = PTQJob(run, scheme, AnalysisConfig(weights="final", mc_items=20)).run()
    assert len(loads) == 1
    assert set(parts) == {"ptq", "analysis"}
    # the same numbers as the two parts called on their own (each loading the model itself)
    other = tmp_path / "other"
    other.mkdir()
    for f in ("config.json", "model.safetensors", "summary.json"):
        (other / f).write_bytes((run / f).read_bytes())
    acfg = AnalysisConfig(weights="final", mc_items=20)
    separate = {**ptq_damage(other, scheme, acfg), **ptq_analysis(other, scheme, acfg)}
    assert json.dumps(out, sort_keys=True) == json.dumps(separate, sort_keys=True)


def test_a_finished_ptq_job_is_answered_from_files_only_when_they_cover_it(nano_cfg, tmp_path):
    """A PTQ result written without the built-in task or lm-eval tasks is not the answer to a job that asks
    for them: the executor redoes it (the study's rerun after eval.* changed)."""
    run = tmp_path / "run"
    train(apply_overrides(nano_cfg, ["train.steps=6"]), run)
    scheme = scheme_config("w4a4-rtn")

    def job(**kw) -> PTQJob:
        return PTQJob(run, scheme, AnalysisConfig(weights="final", **kw))

    job(mc_items=0).run()
    assert job(mc_items=0).done() is not None
    assert job(mc_items=20).done() is None
    assert job(mc_items=0, harness=HarnessConfig(tasks=("some_task",))).done() is None


def test_timing_section_from_the_executor_log(nano_cfg, tmp_path):
    jobs = [_train_job(nano_cfg, tmp_path, f"r{i}", "train.steps=4", f"seed={i}") for i in range(2)]
    execute(jobs, "local", 1, tmp_path / "submitit")
    records = read_timings(tmp_path)
    assert 0 < utilisation(records) <= 1.0 + 1e-9
    section = timing_section(tmp_path)
    stages, (per_opt, shares) = section.blocks
    assert stages.rows[0][0] == "fp" and stages.rows[0][1] == "2" and stages.rows[-1][0] == "all"
    assert per_opt.rows[0][0] == "AdamW" and shares.rows[0][0] == "training" and shares.rows[0][2] == "100.0 %"
    (tmp_path / "costs.jsonl").write_text("")
    assert "no cost log" in timing_section(tmp_path).blocks[0].missing


def test_a_studys_batches_share_one_pool_of_workers(nano_cfg, tmp_path):
    """The workers a study starts serve all its stages (spawned and importing torch once, not per stage);
    a batch without the study's pool gets workers of its own."""
    batches = [[_train_job(nano_cfg, tmp_path, f"{b}{i}", "train.steps=2", f"seed={10 * b + i}") for i in range(2)]
               for b in range(3)]
    with executor.WorkerPool(2) as pool:
        for jobs in batches[:2]:
            execute(jobs, "local", 2, tmp_path / "submitit", pool=pool)
    shared = {r["worker"] for r in read_timings(tmp_path)}
    assert len(read_timings(tmp_path)) == 4 and len(shared) <= 2
    execute(batches[2], "local", 2, tmp_path / "submitit")
    assert not {r["worker"] for r in read_timings(tmp_path)[4:]} & shared

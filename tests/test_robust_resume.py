"""Every robust-arm entry resumes bitwise, built and trained the way the study's robust stage does it.

Strategy. Each entry kind (the R_L penalty, the gain cap, late QAT, EMA, LAWA, the decay lengths, the
Outlier Protected block and gated attention) is turned into a run by study_spec.run_config with
robust_settings(entry) and the Common-Loss settings plan.cl_settings derives from the plain run of the
same seed (a threshold the plain run crosses between its evaluations at 30 and 40, so fine evaluations
run from step 30 on), and trained by the study's own job, TrainJob.run. One copy runs straight; another
is killed at the start of step 35 (after the checkpoint at 30 and four fine evaluations past it, whose
metrics lines the resume must drop) and run again by a fresh TrainJob. Both must agree bitwise: the
summary but for its timings, metrics.jsonl, the final weights and, where the run crossed, the CL weights.
A second test rebuilds the default study's recorded run ids (docs/results, which the study wrote) with
robust.method=none and the model options at their defaults spelled out: none may move.
"""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

import optquant.train as train_module
from optquant.config import run_id
from optquant.quant.robust_config import ROBUST_METHODS
from optquant.runs import RunDir, read_metrics, run_dir
from optquant.study.jobs import TrainJob
from optquant.study.plan import cl_settings
from optquant.study_spec import StudySpec, robust_settings, run_config, spec_from_dict

RESULTS = Path(__file__).parents[1] / "docs" / "results"
ENTRIES = ("penalty:0.5:3", "gain:2:3", "late-qat:0.3", "ema:0.9:3", "lawa:2", "lawa-live:2", "decay:0", "decay:0.4",
           "model.block=op", "model.attn_gate=true")
TIMINGS = ("mean_step_seconds", "mean_step_cpu_seconds", "tokens_per_s")  # the only numbers a resume may change


class Killed(Exception):
    pass


def _spec(corpus) -> StudySpec:
    return StudySpec(name="resume", run={
        "data.source": str(corpus), "model.vocab_size": 320, "model.seq_len": 32, "train.batch_size": 8,
        "train.steps": 40, "train.eval_every": 10, "train.eval_batches": 2, "train.precision": "fp32"})


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory):
    """The plain run of seed 0 (the robust runs' source) and the threshold it crosses between 30 and 40."""
    spec = _spec(corpus)
    cfg = run_config(spec, "nano", "adamw", None, 0, {"train.keep_history": True})
    path = run_dir(tmp_path_factory.mktemp("plain"), cfg)
    TrainJob(cfg, path).run()
    val = {r["step"]: r["val_loss"] for r in read_metrics(path)}
    assert val[40] < val[30]
    return spec, path, (val[30] + val[40]) / 2


def _outcome(path: Path) -> dict:
    summary = json.loads(RunDir(path).summary.read_text())
    cl = RunDir(path).weights("cl")
    return {"summary": {k: v for k, v in summary.items() if k not in TIMINGS}, "metrics": read_metrics(path),
            "final": load_file(RunDir(path).weights("final")), "cl": load_file(cl) if cl.exists() else None}


def _same_tensors(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_robust_entry_resumes_bitwise_through_the_study_job(plain, tmp_path, monkeypatch, entry):
    spec, source, threshold = plain
    settings = cl_settings(spec, threshold, source)
    assert settings["train.cl_eval_from"] == 30  # fine evaluations from the checkpoint before the kill
    cfg = run_config(spec, "nano", "adamw", None, 0, settings, robust_settings(entry))
    assert run_id(cfg) != source.name  # the entry changes the run, so it is not the plain run again
    straight = _outcome(_train(cfg, tmp_path / "straight"))
    killed = tmp_path / "killed" / run_id(cfg)
    schedule = train_module.lr_multiplier

    def kill_at_35(step, total, tc):
        if step == 35:
            raise Killed
        return schedule(step, total, tc)

    monkeypatch.setattr(train_module, "lr_multiplier", kill_at_35)
    with pytest.raises(Killed):
        TrainJob(cfg, killed).run()
    monkeypatch.setattr(train_module, "lr_multiplier", schedule)
    assert RunDir(killed).checkpoint.exists() and not RunDir(killed).summary.exists()
    assert max(r["step"] for r in read_metrics(killed)) > 30  # fine evaluations past the checkpoint
    resumed = _outcome(_train(cfg, killed.parent))
    assert resumed["summary"] == straight["summary"] and resumed["metrics"] == straight["metrics"]
    assert _same_tensors(resumed["final"], straight["final"]) and _same_tensors(resumed["cl"], straight["cl"])
    method = entry.split(":")[0]  # decay:f and model.* entries are plain runs (no robust.method)
    expected = ":".join(entry.split(":")[:2]) if method in ROBUST_METHODS[1:] else None
    assert straight["summary"].get("robust") == expected


def _train(cfg, root: Path) -> Path:
    path = root / run_id(cfg)
    TrainJob(cfg, path).run()
    return path


def test_method_none_keeps_the_default_studys_recorded_run_ids():
    """Every FP run of the optimizers without a searched group ratio in the default study's record, rebuilt
    from its study.json as fp_config builds it, with `robust.method=none` and every model option at its
    default written out, has the id the study gave it."""
    spec = spec_from_dict(json.loads((RESULTS / "study.json").read_text())["spec"])
    df = pd.read_parquet(RESULTS / "results.parquet", columns=["size", "optimizer", "lr", "seed", "kind", "run_id"])
    runs = df[(df["kind"] == "fp") & df["optimizer"].isin(["adamw", "psgd", "shampoo", "soap"])].drop_duplicates()
    assert len(runs) >= 100  # every LR point of four optimizers at four sizes, and the best LR's seeds
    defaults = {"robust.method": "none", "model.norm": "rms", "model.embed_proj": False, "model.block": "standard",
                "model.attn_gate": False}
    for r in runs.itertuples():
        cfg = run_config(spec, r.size, r.optimizer, r.lr, int(r.seed), {"train.keep_history": True, **defaults})
        assert run_id(cfg) == r.run_id, (r.size, r.optimizer, r.lr, r.seed)

"""The robust arm with issue 32's entries, end to end: a study run_study really writes, and its report.

Strategy. One small study (the smoke preset at one size, two optimizers, two seeds, one LR each, W4A4 RTN)
runs the arm with every new kind of entry: EMA, LAWA, two decay lengths and the two architecture options.
robust.parquet must hold every entry for every (optimizer, seed), each arm's run must be the run its entry
describes (read back from its config.json), its plain rows must be results.parquet's bit for bit, and the
report's Robustness section must carry every entry: the Robustness table (its Δ damage recomputed here from
robust.parquet by hand), the decay table (plain, stable end, longer decay), the ranking table and the
verdict with the goal as issue 32 states it.
"""

import json

import pandas as pd
import pytest

from optquant.report.load import load_study
from optquant.report.paper import label
from optquant.report.robust import robust_section
from optquant.report.tables import Table
from optquant.report.timings import read_timings
from optquant.runs import RunDir, StudyDir, read_summary
from optquant.study.plan import run_study
from optquant.study_spec import apply_study_overrides, study_preset

ENTRIES = ("ema:0.9", "lawa:2", "decay:0", "decay:0.4", "model.block=op", "model.attn_gate=true")


@pytest.fixture(scope="module")
def study(corpus, tmp_path_factory):
    spec = apply_study_overrides(study_preset("smoke"), [
        f"run=data.source={corpus}", "run=model.vocab_size=320", "optimizers=adamw,soap", "sizes=femto",
        "seeds=0,1", "lrs.adamw=0.003", "lrs.soap=0.003", "lr_extensions=0", "lr_refine=false",
        "ptq_schemes=w4a4-rtn", "qat_bits=", "workers=1", f"robust={','.join(ENTRIES)}"])
    root = tmp_path_factory.mktemp("robust") / "study"
    run_study(spec, root)
    return root


@pytest.mark.slow  # a whole study: 4 plain, 4 CL and 24 robust runs with their PTQ (~1-2 min on one core)
def test_the_arm_writes_every_new_entry_and_the_report_carries_it(study, tmp_path):
    df = pd.read_parquet(StudyDir(study).robust)
    assert set(df["arm"]) == {"none", *ENTRIES}
    trained = df[(df["weights"] == "train") & (df["metric"] == "mean_step_seconds")]
    assert trained.groupby("arm").size().to_dict() == {a: 4 for a in ("none", *ENTRIES)}  # 2 optimizers × 2 seeds
    configs = {p.parent.name: c.get("config", c) for p in (study / "runs").glob("*/config.json")
               for c in [json.loads(p.read_text())]}
    options = {run: c for run, c in configs.items() if c["model"].get("block") == "op" or c["model"].get("attn_gate")}
    full = [c["model"] for c in options.values() if not c["train"].get("stop_at_cl")]
    assert sum(m.get("block") == "op" for m in full) == 4 and sum(bool(m.get("attn_gate")) for m in full) == 4
    stages = {r["key"]: r["stage"] for r in read_timings(study)}  # model-option entries are logged as robust too
    assert {stages[run] for run in options} == {"robust"}
    # a robust run that crossed before its fine evaluations began is run again to its crossing
    # (plan.early_crossings): that run's model is the one quantized, its cl_step the one recorded
    again = [run for run, c in configs.items() if c["train"].get("stop_at_cl")
             and (run in options or c.get("robust", {}).get("method", "none") != "none")]
    assert again and all(RunDir(study / "runs" / run).ptq("cl", "w4a4-rtn").is_dir() for run in again)
    steps = df[(df["arm"] != "none") & (df["metric"] == "cl_step")]["value"].tolist()
    assert all(read_summary(study / "runs" / run)["cl_step"] in steps for run in again)

    plain = pd.read_parquet(StudyDir(study).results)  # arm "none" is the plain runs' own PTQ, bit for bit
    plain = plain[(plain["kind"] == "cl") & (plain["scheme"] == "w4a4-rtn") & (plain["metric"] == "delta_val_loss")]
    none = df[(df["arm"] == "none") & (df["weights"] == "cl") & (df["scheme"] == "w4a4-rtn")
              & (df["metric"] == "delta_val_loss")]
    key = ["optimizer", "size", "seed"]
    assert len(none) == 4 and none.set_index(key)["value"].sort_index().equals(
        plain.set_index(key)["value"].sort_index())

    section = robust_section(load_study(study), tmp_path)
    tables = {b.key: b for b in section.blocks if isinstance(b, Table)}
    rob = tables["robust"]
    named = {label(o): o for o in ("adamw", "soap")}  # the table names optimizers as every table does
    assert sorted((r[0], r[1]) for r in rob.rows) == sorted((n, e) for n in named for e in ENTRIES)
    cl = df[(df["weights"] == "cl") & (df["scheme"] == "w4a4-rtn") & (df["metric"] == "delta_val_loss")]
    wide = cl.pivot_table(index=["optimizer", "size", "seed"], columns="arm", values="value")
    for row in rob.rows:  # the table's Δ damage is the paired mean over the (size, seed) units both have
        pair = wide[[row[1], "none"]].loc[named[row[0]]].dropna()
        assert row[2] == str(len(pair))
        if len(pair):
            assert row[3].split(" ")[0] == f"{(pair[row[1]] - pair['none']).mean():+.4f}"
    assert "for ≥ 4 optimizers; this study has 2" in rob.caption
    assert "Goal (≥ 30 % less damage, significant" in rob.caption

    decay = tables["robust-decay"]
    assert [r[1] for r in decay.rows] == ["0 (stable end)", "0.2 (plain)", "0.4"] * 2
    ranking = tables["robust-ranking"]
    assert [r[0] for r in ranking.rows] == ["none", *sorted(ENTRIES)]

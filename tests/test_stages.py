"""The table of stages (study/plan.py `STEPS`) drives the dry run, the ETA and the study alike: a stage added
to it shows up in all three, and a stage's label is only a label (renaming one leaves the ETA's plan as it was).
"""

from dataclasses import replace

import optquant.study.plan as plan
from optquant.study.dryrun import study_lines
from optquant.study.eta import plan_cells
from optquant.study_spec import apply_study_overrides, study_preset

SPEC = apply_study_overrides(study_preset("smoke"), ["optimizers=adamw,muon", "sizes=femto"])
EXTRA = plan.Stage("qat", "extra stage (two per pair)", lambda spec, c: {(o, s): 2 for o in spec.optimizers
                                                                          for s in spec.sizes})


def test_a_stage_added_to_the_table_shows_in_the_dry_run_the_eta_and_the_study(monkeypatch, tmp_path):
    before = plan_cells(SPEC)
    ran: list = []

    def extra(study, state):
        ran.append("extra")
        study.run("extra stage", [])

    steps = tuple(replace(s, run=lambda study, state, i=i: ran.append(i)) for i, s in enumerate(plan.STEPS))
    monkeypatch.setattr(plan, "STEPS", (*steps, plan.Step(extra, (EXTRA,))))

    line = next(ln for ln in study_lines(SPEC) if "extra stage (two per pair)" in ln)
    assert line.split()[5:7] == ["4", "jobs"]  # 2 per (optimizer, size), 2 optimizers × 1 size
    after = plan_cells(SPEC)
    for o in SPEC.optimizers:
        assert after[("qat", o, "femto")].planned == before[("qat", o, "femto")].planned + 2
    assert {k: c.planned for k, c in after.items() if k[0] != "qat"} == {k: c.planned for k, c in before.items()
                                                                          if k[0] != "qat"}

    events: list = []
    monkeypatch.setattr("optquant.report.render_report", lambda root: root / "report.html")
    plan.run_study(SPEC, tmp_path / "study", events.append)
    assert ran == [*range(len(steps)), "extra"]  # every step, in the table's order
    assert {"event": "stage", "stage": "extra stage", "jobs": 0} in events


def test_a_label_is_only_a_label(monkeypatch):
    spec = study_preset("cpu")
    before = {k: (c.planned, c.prior) for k, c in plan_cells(spec).items()}
    renamed = tuple(replace(s, stages=tuple(replace(st, label=f"stage {i}") for i, st in enumerate(s.stages)))
                    for s in plan.STEPS)
    monkeypatch.setattr(plan, "STEPS", renamed)
    assert {k: (c.planned, c.prior) for k, c in plan_cells(spec).items()} == before

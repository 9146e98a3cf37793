"""The study's ETA (optquant.study.eta) replayed on recorded studies, and the CLI's progress display.

tests/data/costs-<name>.jsonl is a real study's costs.jsonl (the replay's fields only; benchmarks/eta.py
--fixture writes it) with its study.json spec beside it as study-<name>.json. Replaying it in order of
completion, the cost-model ETA at 10, 50 and 90 % of the study's wall time, and at 10, 50 and 90 % of its
jobs, is within ±30 % of the true remaining time (to the last job's end). benchmarks/eta.py prints the same
checkpoints beside tqdm's old job-count ETA.
"""

import io
import json
import sys
from pathlib import Path

import pytest

from optquant.cost import DEFAULT_GPU
from optquant.study.dryrun import run_costs
from optquant.study.eta import CostETA, _step_prior, plan_cells, probe_scale, replay
from optquant.study_spec import spec_from_dict, study_preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from eta import checkpoints, load, ratios, scaled, scaled_probe  # noqa: E402  (benchmarks/eta.py: what it prints)

DATA = Path(__file__).parent / "data"
# costs-cpu.jsonl is the redesigned default study (issue 20) of 2026-12-01 recorded on the idle 2-core machine:
# 827 jobs, 962 s from the first job to the last. (A recording of the same study on a machine shared with other
# work, 2490 s, missed ±30 %: its FP runs were slowed by up to 2×, which no estimate built from costs.jsonl sees.)
RECORDED = sorted(DATA.glob("costs-*.jsonl"))

@pytest.mark.parametrize("costs", RECORDED, ids=lambda p: p.stem)
def test_eta_on_a_recorded_study_is_within_30_percent(costs):
    study, records = load(costs)
    assert len(records) > 100 and {r["stage"] for r in records} >= {"fp", "cl", "ptq", "qat"}
    for c in checkpoints(study, records):
        assert abs(c["eta"] - c["true"]) <= 0.3 * c["true"], c


def test_plan_prices_every_stage_from_the_spec():
    spec = study_preset("smoke")
    cells = plan_cells(spec)
    assert {k[0] for k in cells} == {"fp", "cl", "ptq", "qat"}
    assert all(c.planned > 0 and c.prior > 0 for c in cells.values())
    big, small = (cells[("fp", "adamw", s)].prior for s in ("nano", "femto"))
    assert big > small  # FLOPs grow with the size
    assert spec_from_dict(json.loads(json.dumps(__import__("dataclasses").asdict(spec)))) == spec


def test_measurements_replace_priors_and_a_later_stage_ends_the_earlier():
    spec = study_preset("smoke")
    est = CostETA(spec, start=0.0)
    before = est.remaining_work()
    rec = {"stage": "fp", "optimizer": "adamw", "size": "nano", "seconds": 10.0}
    est.record({**rec, "start": 0.0, "end": 10.0})
    assert est.per_job(("fp", "adamw", "nano")) == 10.0
    assert est.per_job(("qat", "adamw", "nano")) == pytest.approx(10.0 * 1.3)  # its FP twin × the prior ratio
    assert est.remaining_work() != before
    fp_planned = est.cells[("fp", "muon", "femto")].planned
    assert fp_planned > 0
    est.record({"stage": "cl", "optimizer": "adamw", "size": "nano", "seconds": 1.0, "start": 10.0, "end": 11.0})
    assert est.cells[("fp", "muon", "femto")].planned == 0  # the FP phase is over: its unrun jobs never come
    assert est.eta(now=11.0) > est.eta(now=20.0) >= 0  # counts down between completions


def test_replay_reports_old_and_new_eta_per_job():
    spec = study_preset("smoke")
    records = [{"stage": "fp", "optimizer": "adamw", "size": "femto", "start": i, "end": i + 1.0, "seconds": 1.0}
               for i in range(5)]
    rows = replay(spec, records)
    assert [r["jobs"] for r in rows] == [0, 1, 2, 3, 4, 5]  # the start, then each job
    assert rows[-1]["true"] == 0 and rows[0]["true"] == 5.0 and rows[1]["true"] == 4.0
    assert all(r["eta"] >= 0 for r in rows)


def test_progress_without_a_terminal_prints_plain_timed_lines(tmp_path, monkeypatch):
    from optquant.cli.study import Progress

    monkeypatch.chdir(tmp_path)  # no costs.jsonl anywhere: the display reads the events, not the file
    out = io.StringIO()  # not a tty: no bar, plain lines
    p = Progress(study_preset("smoke"), quiet=False, stream=out)
    try:
        assert p.bar is None and p.plain
        p.on_event({"event": "probe", "probe": None})
        p.on_event({"event": "stage", "stage": "fp sweep", "jobs": 24})
        p.on_event({"event": "warning", "message": "psgd at femto: not bracketed"})
        timing = {"key": "r1", "stage": "fp", "optimizer": "adamw", "size": "femto", "start": p.eta.start,
                  "end": p.eta.start + 1, "seconds": 1.0}
        p.on_event({"event": "job", "stage": "fp sweep", "key": "r1", "job_stage": "fp",
                    "result": {"final_val_loss": 5.5}, "timing": timing})
        p.on_event({"event": "job", "stage": "fp sweep", "key": "r2", "job_stage": "fp",
                    "result": {"final_val_loss": 5.4}, "timing": None})
    finally:
        p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[") and "fp sweep: 24 jobs" in lines[0] and "ETA" in lines[0]
    assert lines[1] == "optquant: warning: psgd at femto: not bracketed"
    assert "r1 done (val loss 5.5000)" in lines[2] and "r2 done" in lines[3]
    assert p.eta.jobs == 2 and p.eta.cells[("fp", "adamw", "femto")].done == 1  # r2 came from its files


def _probe_at(spec, x: float) -> dict:
    """A probe whose every step takes x times the prior's."""
    budgets = run_costs(spec, DEFAULT_GPU)
    return {"step": {o: {s: x * _step_prior(budgets[(o, s)]) for s in (spec.sizes[0], spec.sizes[-1])}
                     for o in spec.optimizers}, "forward": {}}


def test_a_probe_scales_every_prior_and_its_absence_keeps_them():
    spec = study_preset("smoke")
    budgets = run_costs(spec, DEFAULT_GPU)
    assert probe_scale(budgets, None) == 1.0 and probe_scale(budgets, {}) == 1.0  # an old study.json
    slow = _probe_at(spec, 2.5)
    slow["step"]["adamw"][spec.sizes[0]] = 1e3  # one outlier (a probe step interrupted): the median ignores it
    assert probe_scale(budgets, slow) == pytest.approx(2.5)
    base, probed = plan_cells(spec), plan_cells(spec, slow)
    assert base.keys() == probed.keys()
    assert all(probed[k].prior == pytest.approx(2.5 * c.prior) for k, c in base.items())
    assert CostETA(spec, 0.0, probe=slow).eta(0.0) == pytest.approx(2.5 * CostETA(spec, 0.0).eta(0.0))


def test_a_replay_uses_the_recordings_probe():
    study, records = load(DATA / "costs-cpu.jsonl")
    assert "probe" not in study  # recorded before the probe: the replay keeps the prior
    spec = spec_from_dict(study["spec"])
    rows = {x: replay(spec, records[:1], probe=_probe_at(spec, x)) for x in (1.0, 3.0)}
    assert rows[1.0][0]["eta"] == replay(spec, records[:1])[0]["eta"]  # no probe: the prior's own level
    assert rows[3.0][0]["eta"] == pytest.approx(3 * rows[1.0][0]["eta"])  # before the first job: the probe's
    # after it: the measured job's cell is its measurement; a size no job has measured keeps the probe's level
    # (one size's measured/prior ratio does not carry to another's, whose fixed costs differ)
    ests = {x: CostETA(spec, records[0]["start"], probe=_probe_at(spec, x)) for x in (1.0, 3.0)}
    for e in ests.values():
        e.record(records[0])
    first = (records[0]["stage"], records[0]["optimizer"], records[0]["size"])
    other = next(k for k in ests[1.0].cells if k[0] == first[0] and k[2] != first[2])
    assert ests[3.0].per_job(first) == ests[1.0].per_job(first) == records[0]["seconds"]
    assert ests[3.0].per_job(other) == pytest.approx(3 * ests[1.0].per_job(other))


def test_probe_measures_each_optimizer_at_the_smallest_and_largest_size():
    from optquant.study.plan import _probe
    from optquant.study.probe import probe

    spec = study_preset("smoke")
    p = probe(spec, threads=1)
    ends = {spec.sizes[0], spec.sizes[-1]}
    assert set(p["step"]) == set(spec.optimizers) and all(set(r) == ends for r in p["step"].values())
    assert set(p["forward"]) == ends and all(t > 0 for r in p["step"].values() for t in r.values())
    assert p["threads"] == 1 and p["seconds"] > 0 and json.loads(json.dumps(p)) == p  # study.json can hold it
    assert _probe(__import__("dataclasses").replace(spec, executor="slurm")) is None  # Slurm runs elsewhere


GOAL = (0.7, 1.3)  # issue 30: ETA ÷ true remaining from 5 % of the run's time on


@pytest.mark.parametrize("slower", [1.0, 1.6, 1 / 1.6])
@pytest.mark.parametrize("name", ["cpu", "cpu-probed"])
def test_eta_goal_on_the_default_study_at_any_machine_speed(name, slower):
    """Two recordings of the default study on the idle 2-core machine: costs-cpu (2026-12-01, no probe: the
    prior's constants were fitted to it) and costs-cpu-probed (2026-12-04, a fresh study with its probe, which the
    constants never saw), each also as a machine 1.6× slower or faster would have made it (benchmarks/eta.py
    --scale: every time, the probe's too): the ETA is within GOAL of the truth from 5 % on."""
    study, records = load(DATA / f"costs-{name}.jsonl")
    got = ratios(scaled_probe(study, slower), scaled(records, slower))
    assert all(GOAL[0] <= r <= GOAL[1] for f, r in got.items() if f >= 0.05), got


@pytest.mark.parametrize("slower", [1.3, 1 / 1.3])
def test_eta_goal_holds_when_the_probe_misjudges_the_machine_by_30_percent(slower):
    """The probed recording replayed 1.3× slower or faster while its probe stays as measured (the load changed
    after the probe): each size's first jobs correct its prior, and the goal holds from 5 % on. (Off by 1.6×,
    it does not: 1.36 at 5 %, docs/benchmarks.md.)"""
    study, records = load(DATA / "costs-cpu-probed.jsonl")
    got = ratios(study, scaled(records, slower))
    assert all(GOAL[0] <= r <= GOAL[1] for f, r in got.items() if f >= 0.05), got

"""The dry run's and the ETA's job counts for the step-size search (study/plan.py STEPS) against the jobs the search
really starts (study/tuning.py `tune`), on a loss surface built to reach the bounds: a fake runner trains nothing,
returns a loss from the run's LR and ratio, and counts a config once, as the executor skips a finished run.

A ratio's 3-point grid is centred on the best LR's run, and the LR's grid again on the last ratio search's best
run: each centre is a finished run, not a job. The bounds once counted it (3 + extensions + refinement per ratio,
lr_points + ... for the sweep again), over-expecting the ETA's group jobs by one per ratio and cell.
"""

from __future__ import annotations

import math
from dataclasses import replace

from optquant.config import config_hash
from optquant.study.plan import planned
from optquant.study.tuning import initial_ratios, ratio_settings, tune
from optquant.study_spec import lr_grid, round_lr, run_config, smoke


def test_the_group_search_bounds_are_the_jobs_it_can_start():
    spec = replace(smoke(), optimizers=("muon",), sizes=("femto",), lr_points=3, lr_extensions=1)
    grid, (ratio0,) = lr_grid(spec, "muon"), initial_ratios(spec, "muon").values()
    step = spec.lr_step
    # the optimum one step below each grid's lower edge, then met by one extension: bracketed, so refined too
    best_lr, best_ratio = min(grid), round_lr(ratio0 / step)
    seen, stages = set(), []

    def run(stage, cfgs):
        out = {}
        for tag, cfg in cfgs.items():
            if (h := config_hash(cfg)) not in seen:
                seen.add(h)
                stages.append(stage)
            loss = math.log(cfg.optim.lr / best_lr) ** 2 + math.log(cfg.optim.adam_lr_ratio / best_ratio) ** 2
            out[tag] = {"status": "done", "final_val_loss": 3 + loss}
        return out

    found = tune(run, spec, lambda k, lr, ratios: run_config(spec, k[1], k[0], lr, 0, ratio_settings(ratios)))
    assert found[("muon", "femto")].ratios == {"adam_lr_ratio": best_ratio}  # the ratio moved: the LR again
    first_group = stages.index("group lr")
    again = next(i for i in range(first_group, len(stages)) if stages[i].startswith("fp sweep"))
    ran = {"lr": first_group, "group": again - first_group, "again": len(stages) - again}
    bound = {stage.label: sum(jobs.values()) for stage, jobs in planned(spec) if stage.kind == "fp"}
    assert ran["lr"] == len(grid) + 1 + 1 == bound["fp sweep (first seed)"] + bound[
        "fp extensions (≤ {spec.lr_extensions} rounds)"] + bound["fp refinement (≤ 1)"]
    assert ran["group"] == 2 + 1 + 1 == bound["group lr searches (tied ratios, ≤ bound)"]  # the old bound: 5
    assert ran["again"] == 2 + 1 <= bound["fp sweep again where a ratio moved (≤ bound)"] == 4  # the old: 5

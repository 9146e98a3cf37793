"""The robust arm's Common-Loss crossing, located again for a run that crossed before its fine evaluations began.

Strategy: a robust run (EMA) with the CL threshold between its evaluations at steps 20 and 30 and fine
evaluations only from step 30 (where, in a study, the plain run of the seed began its own search) is caught at
the regular evaluation 30. plan.early_crossings must send it again with fine evaluations from 20, stopping at the
crossing: the replay must be the robust run up to there, and its CL model the first fine evaluation at or below
the threshold. A run whose fine evaluations already bracket its crossing is left alone.
"""

from optquant.config import apply_overrides
from optquant.runs import read_metrics, run_dir
from optquant.study.plan import early_crossings
from optquant.train import train


def test_a_robust_run_that_crossed_before_its_fine_evaluations_is_located_again(nano_cfg, tmp_path):
    cfg = apply_overrides(nano_cfg, ["robust.method=ema", "robust.strength=0.5"])
    train(cfg, run_dir(tmp_path, cfg))
    vals = {m["step"]: m["val_loss"] for m in read_metrics(run_dir(tmp_path, cfg)) if m.get("val_loss") is not None}
    assert vals[10] > vals[20] > vals[30]
    threshold = (vals[20] + vals[30]) / 2

    def robust(start: int):
        c = apply_overrides(cfg, [f"train.cl_threshold={threshold!r}", "train.cl_eval_every=1",
                                  f"train.cl_eval_from={start}"])
        return c, train(c, run_dir(tmp_path, c))

    early, summary = robust(30)
    assert summary["cl_step"] == 30 and summary["steps"] == 40  # caught at the regular evaluation, full budget
    again = early_crossings(tmp_path, {"k": early}, {"k": summary})["k"]
    assert (again.train.cl_eval_from, again.train.stop_at_cl) == (20, True)
    located = train(again, run_dir(tmp_path, again))
    assert 20 < located["cl_step"] < 30 and located["steps"] == located["cl_step"]
    fine = {m["step"]: m["val_loss"] for m in read_metrics(run_dir(tmp_path, again)) if m.get("val_loss") is not None}
    assert fine[located["cl_step"]] <= threshold < fine[located["cl_step"] - 1]
    assert fine[10] == vals[10] and fine[20] == vals[20]  # the replay is the robust run up to its fine evaluations

    late, summary = robust(20)  # fine evaluations from 20 on already find the crossing
    assert summary["cl_step"] == located["cl_step"]
    assert early_crossings(tmp_path, {"k": late}, {"k": summary}) == {}

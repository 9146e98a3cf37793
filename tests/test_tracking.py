"""Experiment tracking: with log.to=tensorboard the event file read back holds exactly metrics.jsonl's
evaluations, a loss for every step, the summary, PTQ results and the config; without it nothing is
written and the run id does not change."""

import json

import pytest

from optquant.config import apply_overrides, run_id
from optquant.runs import run_dir
from optquant.train import train


def test_log_to_is_not_part_of_the_run_identity(nano_cfg, tmp_path):
    tb = apply_overrides(nano_cfg, ["log.to=tensorboard"])
    assert run_id(tb) == run_id(nano_cfg)
    path = run_dir(tmp_path, apply_overrides(nano_cfg, ["train.steps=10"]))
    train(apply_overrides(nano_cfg, ["train.steps=10"]), path)
    assert not (path / "tensorboard").exists()


def test_tensorboard_events_equal_metrics_jsonl(nano_cfg, tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install 'optquant[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from optquant.analysis import AnalysisConfig, ptq_eval
    from optquant.quant.ptq import PTQConfig

    cfg = apply_overrides(nano_cfg, ["log.to=tensorboard"])
    path = run_dir(tmp_path, cfg)
    summary = train(cfg, path)
    ptq = ptq_eval(path, PTQConfig(), AnalysisConfig(mc_items=0))
    acc = EventAccumulator(str(path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    scalars = set(acc.Tags()["scalars"])
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for key in ("train_loss", "val_loss", "lr", "tokens"):
        events = acc.Scalars(f"eval/{key}")
        assert [e.step for e in events] == [r["step"] for r in records]
        assert [e.value for e in events] == pytest.approx([r[key] for r in records], rel=1e-6)  # fp32 in the file
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, cfg.train.steps + 1))
    assert acc.Scalars("summary/final_val_loss")[0].value == pytest.approx(summary["final_val_loss"], rel=1e-6)
    assert acc.Scalars("ptq/final/w4a4-rtn/delta_val_loss")[0].value == pytest.approx(ptq["delta_val_loss"],
                                                                                        rel=1e-6, abs=1e-7)
    assert "summary/n_params" in scalars
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"to": "tensorboard"' in text and f'"steps": {cfg.train.steps}' in text

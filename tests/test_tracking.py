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

    from optquant.ptq_stage import AnalysisConfig, ptq_damage
    from optquant.quant.ptq import PTQConfig

    cfg = apply_overrides(nano_cfg, ["log.to=tensorboard"])
    path = run_dir(tmp_path, cfg)
    summary = train(cfg, path)
    ptq = ptq_damage(path, PTQConfig(), AnalysisConfig(mc_items=0))
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


def wandb_records(path):
    """Records of a W&B offline .wandb file (a LevelDB-style log: 7-byte header, 32 KiB blocks, each record
    crc32 (4) + length (2) + type (1: full, 2: first, 3: middle, 4: last) + protobuf bytes)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, block = path.read_bytes(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos: pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        buf += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def test_wandb_offline_run_equals_metrics_jsonl(nano_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs the wandb extra: pip install 'optquant[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = apply_overrides(nano_cfg, ["log.to=wandb", "train.steps=20"])
    path = run_dir(tmp_path, cfg)
    summary = train(cfg, path)
    (run_file,) = path.glob("wandb/offline-run-*/run-*.wandb")
    history, final, config = {}, {}, {}
    for rec in wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind in ("run", "config"):
            config.update({i.key: json.loads(i.value_json) for i in (rec.run.config if kind == "run" else
                                                                     rec.config).update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history[row["_step"]] = row
        elif kind == "summary":
            final.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        for key in ("train_loss", "val_loss", "lr", "tokens"):
            assert history[r["step"]][f"eval/{key}"] == r[key]  # JSON in both: exact
    assert sorted(s for s, row in history.items() if "train/loss" in row) == list(range(1, 21))
    assert final["summary/final_val_loss"] == summary["final_val_loss"]
    assert config["train"]["steps"] == 20 and config["log"] == {"to": "wandb"}

"""Training loop tests on a nano model and a synthetic corpus.

Exact resume is shown bitwise (a run interrupted after a checkpoint and resumed ends with the same
losses as one that ran straight through); divergence, the Common Loss checkpoint and the skip of
finished runs are checked through the files a run leaves behind. Runs that are only read (the straight
runs) come from conftest's `runs_cache`, trained once per session.
"""

import json
import math

import pytest
import torch

from optquant.checkpoint import load_weights
from optquant.config import TrainConfig, apply_overrides
from optquant.errors import OptquantError
from optquant.model import LM
from optquant.runs import read_metrics, run_dir
from optquant.train import lr_multiplier, train


class Interrupt(Exception):
    pass


def test_loss_falls_far_below_uniform(nano_cfg, runs_cache):
    path = run_dir(runs_cache, nano_cfg)
    summary = train(nano_cfg, path)
    assert summary["status"] == "done"
    assert summary["final_val_loss"] < 0.6 * math.log(nano_cfg.model.vocab_size)
    assert (path / "model.safetensors").exists()
    record = json.loads((path / "config.json").read_text())
    assert record["config"]["optim"]["name"] == "adamw" and "optquant_version" in record
    assert len(read_metrics(path)) == 4


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_killed_run_resumes_bitwise(nano_cfg, runs_cache, tmp_path, name):
    cfg = apply_overrides(nano_cfg, [f"optim.name={name}"])
    straight = train(cfg, run_dir(runs_cache, cfg))

    def kill_at_25(info):
        if info["step"] == 25:
            raise Interrupt

    with pytest.raises(Interrupt):
        train(cfg, tmp_path / "killed", on_step=kill_at_25)
    assert not (tmp_path / "killed" / "summary.json").exists()
    resumed = train(cfg, tmp_path / "killed")
    assert resumed["final_val_loss"] == straight["final_val_loss"]  # bitwise
    assert read_metrics(tmp_path / "killed") == read_metrics(run_dir(runs_cache, cfg))


def test_diverged_run_is_recorded(nano_cfg, tmp_path):
    cfg = apply_overrides(nano_cfg, ["optim.lr=1e30"])
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "diverged"
    assert summary["diverged_step"] is not None and summary["final_val_loss"] is None
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "diverged"


def test_common_loss_checkpoint_is_first_crossing(nano_cfg, runs_cache, tmp_path):
    train(nano_cfg, run_dir(runs_cache, nano_cfg))
    vals = [m["val_loss"] for m in read_metrics(run_dir(runs_cache, nano_cfg))]
    threshold = (vals[0] + vals[1]) / 2  # crossed first at the second evaluation
    cfg = apply_overrides(nano_cfg, [f"train.cl_threshold={threshold}"])
    summary = train(cfg, tmp_path / "cl")
    assert summary["cl_step"] == 20
    model = load_weights(tmp_path / "cl" / "cl_model.safetensors", LM(cfg.model))
    assert model.lm_head.weight is model.embed.weight


def test_finished_run_is_skipped(nano_cfg, runs_cache):
    first = train(nano_cfg, run_dir(runs_cache, nano_cfg))
    calls = []
    again = train(nano_cfg, run_dir(runs_cache, nano_cfg), on_step=calls.append)
    assert again == first and calls == []


def test_truncated_checkpoint_is_a_clear_error(nano_cfg, tmp_path):
    path = tmp_path / "run"
    with pytest.raises(Interrupt):
        train(nano_cfg, path, on_step=lambda i: (_ for _ in ()).throw(Interrupt) if i["step"] == 15 else None)
    ckpt = path / "checkpoint.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    with pytest.raises(OptquantError, match="truncated or corrupt"):
        train(nano_cfg, path)
    assert ckpt.exists()  # nothing is deleted


def test_too_few_tokens_for_a_batch(nano_cfg, tmp_path):
    cfg = apply_overrides(nano_cfg, ["train.batch_size=4096"])
    with pytest.raises(OptquantError, match="tokens"):
        train(cfg, tmp_path / "run")


def test_wsd_schedule_shape():
    cfg = TrainConfig()
    total = 100
    m = [lr_multiplier(s, total, cfg) for s in range(total)]
    assert m[0] == pytest.approx(0.001)
    assert m[4] < 1.0 and m[5] == 1.0 and m[79] == 1.0  # 5 % warm-up, then constant
    assert m[80] == 1.0 and m[99] == pytest.approx(0.05)  # last 20 %: linear decay to 0
    assert all(a >= b for a, b in zip(m[80:], m[81:], strict=False))
    cos = [lr_multiplier(s, total, TrainConfig(schedule="cosine")) for s in range(total)]
    assert cos[5] == 1.0 and cos[99] < 0.01


def test_run_dir_is_keyed_by_config(nano_cfg, tmp_path):
    a = run_dir(tmp_path, nano_cfg)
    b = run_dir(tmp_path, apply_overrides(nano_cfg, ["optim.lr=1e-3"]))
    assert a != b and a == run_dir(tmp_path, nano_cfg)


def test_bf16_autocast_trains(nano_cfg, tmp_path):
    cfg = apply_overrides(nano_cfg, ["train.precision=bf16", "train.steps=20"])
    summary = train(cfg, tmp_path / "run")
    assert summary["bf16"] and math.isfinite(summary["final_val_loss"])
    torch.set_autocast_enabled("cpu", False)


@pytest.mark.parametrize("name", ["adamw", "shampoo"])
def test_common_loss_from_kept_checkpoint_equals_a_replay(nano_cfg, tmp_path, name):
    """The study's CL stage starts each CL run from the source run's kept checkpoint of the last
    evaluation before the crossing; that must be exactly what a replay from scratch gives, and the fine
    evaluations must find the crossing to the step."""
    from safetensors.torch import load_file

    from optquant.study.plan import last_eval_before, seed_from_history

    source_cfg = apply_overrides(nano_cfg, [f"optim.name={name}", "train.keep_history=true"])
    source = tmp_path / "source"
    train(source_cfg, source)
    records = read_metrics(source)
    assert sorted(p.name for p in (source / "history").iterdir())[0] == "step00000000.safetensors"
    threshold = (records[1]["val_loss"] + records[2]["val_loss"]) / 2  # between the evals at steps 20 and 30
    start = last_eval_before(records, threshold)
    assert start == 20
    cfg = apply_overrides(nano_cfg, [f"optim.name={name}", f"train.cl_threshold={threshold!r}",
                                     "train.stop_at_cl=true", "train.cl_eval_every=1", f"train.cl_eval_from={start}"])
    replay = train(cfg, tmp_path / "replay")
    seed_from_history(source, start, tmp_path / "resumed")
    assert (tmp_path / "resumed" / "checkpoint.safetensors").exists()
    resumed = train(cfg, tmp_path / "resumed")
    assert 20 < replay["cl_step"] <= 30 and resumed["cl_step"] == replay["cl_step"]
    a, b = (load_file(p / "cl_model.safetensors") for p in (tmp_path / "replay", tmp_path / "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_metrics(tmp_path / "replay") == read_metrics(tmp_path / "resumed")
    fine = [r for r in read_metrics(tmp_path / "replay") if r["step"] > start]
    assert [r["step"] for r in fine] == list(range(start + 1, replay["cl_step"] + 1))
    assert fine[-1]["val_loss"] <= threshold and all(r["val_loss"] > threshold for r in fine[:-1])

"""train.compile: the setting, run ids that ignore it, and checkpoints loadable compiled or not."""

from __future__ import annotations

import pytest
import torch

from optquant.checkpoint import load_checkpoint, load_weights, save_checkpoint, save_weights
from optquant.compiled import use_compile
from optquant.config import apply_overrides, run_id, run_preset
from optquant.errors import OptquantError
from optquant.model import LM, model_config


def test_auto_is_on_for_cuda_only_and_bad_values_fail():
    assert use_compile("auto", torch.device("cuda")) and not use_compile("auto", torch.device("cpu"))
    assert use_compile("on", torch.device("cpu")) and not use_compile("off", torch.device("cuda"))
    with pytest.raises(OptquantError, match="train.compile"):
        use_compile("maybe", torch.device("cpu"))
    with pytest.raises(OptquantError, match="choose one of auto, on, off"):
        apply_overrides(run_preset("nano"), ["train.compile=maybe"])


def test_run_id_does_not_depend_on_compile():
    cfg = run_preset("nano")
    ids = {run_id(apply_overrides(cfg, [f"train.compile={c}"])) for c in ("auto", "on", "off")}
    assert len(ids) == 1 and run_id(apply_overrides(cfg, ["train.steps=7"])) not in ids


@pytest.mark.parametrize("save_compiled", [False, True])
def test_weights_and_checkpoints_load_both_ways(tmp_path, save_compiled):
    torch.manual_seed(0)
    src = LM(model_config("femto", vocab_size=64))
    saved = torch.compile(src) if save_compiled else src  # the wrapper's state dict has `_orig_mod.` keys
    assert any(k.startswith("_orig_mod.") for k in torch.compile(src).state_dict())
    save_weights(tmp_path / "w.safetensors", saved)
    save_checkpoint(tmp_path / "c.safetensors", saved, {"step": 3})
    for load_compiled in (False, True):
        torch.manual_seed(1)
        dst = LM(model_config("femto", vocab_size=64))
        target = torch.compile(dst) if load_compiled else dst
        load_weights(tmp_path / "w.safetensors", target)
        assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(),
                                                      strict=True))
        dst.embed.weight.data.zero_()
        assert load_checkpoint(tmp_path / "c.safetensors", target)["step"] == 3
        assert torch.equal(dst.embed.weight, src.embed.weight)


@pytest.mark.slow
def test_compiled_training_matches_eager(nano_cfg, tmp_path):
    """A compiled femto run trains to the eager run's loss (not bitwise: fused kernels round differently)."""
    from optquant.train import train

    cfg = apply_overrides(nano_cfg, ["train.steps=10", "train.eval_every=5"])
    eager = train(apply_overrides(cfg, ["train.compile=off"]), tmp_path / "eager")
    comp = train(apply_overrides(cfg, ["train.compile=on"]), tmp_path / "compiled")
    assert comp["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=1e-3)
    load_weights(tmp_path / "compiled" / "model.safetensors", LM(cfg.model))

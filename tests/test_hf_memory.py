"""The memory bound of `optquant analyze --hf` and `ptq --hf` (issue 33): peak RSS within 1.5× the weights in their
stored dtype, plus the activation buffer the settings bound, on a random Qwen2-shaped checkpoint whose vocabulary
makes the full logits of its windows larger than the weights (what the code before issue 33 materialised).

Strategy: each command runs as its own process; its peak RSS (the kernel's high-water mark, os.wait4) less that of
a process that imports the same modules and loads nothing is what the command added. Slow (two model loads and a
few passes over 8 windows), so `-m slow`; benchmarks/hf_scale.py measures the same at real sizes."""

import os
import subprocess
import sys

import numpy as np
import pytest

from optquant.evaluate import LOGITS_BYTES

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'optquant[hf]'")

# the activation buffer: one chunk of fp32 logits and cross-entropy's two temporaries of its size (evaluate.py), plus
# the walk's streams and stacked calls on 8 windows × 128 tokens at width 384 (a few MB) and GPTQ's Hessians (4 MB)
BUFFER_MB = 3 * LOGITS_BYTES / 2**20 + 32


def _peak_mb(args: list[str], env: dict) -> float:
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode()[-2000:]
    return usage.ru_maxrss / 1024


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_analyze_and_ptq_peak_within_one_and_a_half_times_the_weights(tmp_path, dtype):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=96_000, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(tmp_path / "m")
    weights_mb = sum(f.stat().st_size for f in (tmp_path / "m").glob("*.safetensors")) / 2**20
    np.save(tmp_path / "t.npy", np.random.default_rng(0).integers(0, 96_000, 8 * 8 * 129))
    env = dict(os.environ, OMP_NUM_THREADS="2")
    base = _peak_mb(["-c", "import optquant.cli, optquant.hf.ptq_stage, transformers; "
                     "transformers.AutoModelForCausalLM"], env)
    hf = ["-m", "optquant.cli", "--hf", str(tmp_path / "m"), "--tokens", str(tmp_path / "t.npy"), "--out",
          str(tmp_path / "out"), "--mc-items", "0"]
    for command in (["analyze"], ["ptq", "--method", "gptq", "--a-bits", "16", "--group-size", "128"]):
        added = _peak_mb([*hf[:2], *command, *hf[2:]], env) - base
        # the logits of one 8 × 128 batch alone would be 8·128·96000·4 B = 375 MB, above the weights
        assert added <= 1.5 * weights_mb + BUFFER_MB, (command, added, weights_mb)


@pytest.mark.slow
def test_analyze_peak_grows_by_one_layer_not_the_model(tmp_path):
    """`analyze --hf` reads one sublayer at a time: the peak of 2, 4 and 8 layers of one bf16 shape differs by
    at most one layer's weights and the allocator's noise, while 2 → 8 adds six layers (83 MB at this shape) to
    the checkpoint. A walk that held the model, or kept each layer's freed activations, fails it."""
    import torch
    import transformers

    env = dict(os.environ, OMP_NUM_THREADS="2")
    np.save(tmp_path / "t.npy", np.random.default_rng(0).integers(0, 8_000, 8 * 8 * 129))
    peaks, layer_mb = {}, None
    for layers in (2, 4, 8):
        torch.manual_seed(0)
        config = transformers.Qwen2Config(vocab_size=8_000, hidden_size=512, intermediate_size=4096,
                                          num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                          tie_word_embeddings=True)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        layer_mb = sum(p.numel() * 2 for p in model.model.layers[0].parameters()) / 2**20
        model.save_pretrained(tmp_path / f"m{layers}")
        peaks[layers] = _peak_mb(["-m", "optquant.cli", "analyze", "--hf", str(tmp_path / f"m{layers}"), "--tokens",
                                  str(tmp_path / "t.npy"), "--out", str(tmp_path / "out")], env)
    assert 6 * layer_mb > 80  # the six layers the bound must not let through
    for layers in (4, 8):
        assert peaks[layers] - peaks[2] <= layer_mb + 24, (peaks, layer_mb)  # 24 MB: RSS noise between processes

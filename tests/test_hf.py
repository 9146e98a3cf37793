"""Hugging Face models through optquant.hf: for each supported family a tiny random model is built with
transformers (config → model → save_pretrained into a temp dir; nothing downloads). The adapter's
sublayer chain must reproduce HF's logits, the Hadamard-rotated chain too, ABC's identity A + B + C = R
must hold on every row, and `optquant ptq/analyze --hf` must run end to end on a folder with a tokenizer."""

import copy
import json

import pytest
import torch

from optquant.cli import main
from optquant.errors import OptquantError

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'optquant[hf]'")

from optquant.hf import load_hf, load_hf_model  # noqa: E402
from optquant.metrics.propagation import PropagationConfig, propagation, ptq_pair  # noqa: E402
from optquant.quant.ptq import PTQConfig  # noqa: E402
from optquant.quant.rotate import rotate_model_  # noqa: E402

V, T = 96, 12
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=0, eos_token_id=0,
              initializer_range=0.1)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),  # T > window: the window matters
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),  # q/k/v biases
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),  # per-head RMS QK-norm
    "olmo2": lambda: transformers.Olmo2Config(**COMMON),  # post-sublayer norms, full-width QK-norm
}


def save_tiny(family: str, path, seed: int = 0, vocab_size: int = V, **config_values):
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    config.vocab_size = vocab_size
    for key, value in config_values.items():  # e.g. a real checkpoint's max_position_embeddings
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if family == "qwen2":  # HF initialises biases to zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def tokens(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_chain_reproduces_hf_logits_and_abc_identity(family, tmp_path):
    path = save_tiny(family, tmp_path / family)
    hf, ours = load_hf_model(path), load_hf(path)
    assert len(ours.sublayers()) == 4 and ours.cfg.arch == family
    idx = tokens()
    with torch.no_grad():
        ref = hf(idx).logits
        torch.testing.assert_close(ours(idx), ref, rtol=0, atol=1e-5)
        x = ours.embed(idx)  # the chain, walked the way the ABC analysis walks it
        for sub in ours.sublayers():
            x = sub(x)
        torch.testing.assert_close(ours.head(x), ref, rtol=0, atol=1e-5)
        rotated = rotate_model_(copy.deepcopy(ours))
        torch.testing.assert_close(rotated(idx), ref, rtol=0, atol=1e-5)
    for qcfg in (PTQConfig(), PTQConfig(method="gptq", rotation="hadamard")):
        fp, q = ptq_pair(ours, qcfg, tokens(8, seed=2))
        with torch.no_grad():
            assert (q(idx) - fp(idx)).abs().max() > 1e-3  # the quantizer really acted
        rows, summary = propagation(fp, q, [idx], PropagationConfig(granularity="linear", skip=("lm_head",)))
        assert len([r for r in rows if r.kind == "linear"]) == 2 * 2 * 7  # norms × layers × (q,k,v,o,gate,up,down)
        for r in rows:
            assert r.R == pytest.approx(r.A + r.B + r.C, rel=1e-9, abs=1e-15), (qcfg.name, r)
        assert summary.R_L > 0


def test_sliding_window_is_applied(tmp_path):
    """The Mistral window changes the logits at T > window: the adapter must not fall back to full causal."""
    path = save_tiny("mistral", tmp_path / "m")
    ours = load_hf(path)
    idx = tokens()
    with torch.no_grad():
        windowed = ours(idx)
        for sub in ours.sublayers():
            sub.window = None
        assert (ours(idx) - windowed).abs().max() > 1e-4


def _with_tokenizer(path, corpus):
    from optquant.data import train_tokenizer

    texts = [p.read_text() for p in sorted(corpus.iterdir())]
    tok = train_tokenizer(texts, 320)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def test_ptq_and_analyze_cli_on_an_hf_folder(tmp_path, corpus, capsys):
    path = _with_tokenizer(save_tiny("llama", tmp_path / "llama", vocab_size=320), corpus)
    out = tmp_path / "out"
    common = ["--hf", str(path), "--data", str(corpus), "--seq-len", "32", "--out", str(out)]
    assert main(["ptq", *common, "--mc-items", "20"]) == 0
    summary = json.loads((out / "w4a4-rtn" / "summary.json").read_text())
    assert summary["val_loss_fp"] > 0 and summary["val_loss_q"] != summary["val_loss_fp"]  # a random model: any sign
    assert 0 <= summary["mc_acc_q"] <= 1
    assert main(["analyze", *common, "--method", "gptq", "--rotation", "hadamard", "--mc-items", "0"]) == 0
    result = json.loads((out / "w4a4-gptq-had" / "analysis.json").read_text())
    assert result["R_L"] > 0 and (out / "w4a4-gptq-had" / "propagation.parquet").exists()
    capsys.readouterr()
    assert main(["ptq", "--hf", str(tmp_path)]) == 2  # not a model folder: one line, exit 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err


@pytest.mark.parametrize("score", ["abc", "fisher"])
def test_bits_and_ptq_plan_on_an_hf_folder(tmp_path, corpus, capsys, score):
    """`bits --hf`: a plan over the folder's own linears (the chain's names) within the budget, exported under HF
    names that are the model's modules; `ptq --hf --plan` applies it (its scheme directory is the plan's)."""
    from optquant.quant.bit_plan import average_bits, hf_names

    path = _with_tokenizer(save_tiny("llama", tmp_path / "llama", vocab_size=320), corpus)
    plan, recipe, out = tmp_path / "plan.json", tmp_path / "recipe.yaml", tmp_path / "out"
    common = ["--hf", str(path), "--data", str(corpus), "--seq-len", "32"]
    assert main(["bits", *common, "--avg-bits", "5", "--a-bits", "16", "--score", score, "--plan-out", str(plan),
                 "--recipe", str(recipe)]) == 0
    record = json.loads(plan.read_text())
    bits = {m: v["bits"] for m, v in record["modules"].items()}
    params = {m: v["params"] for m, v in record["modules"].items()}
    hf = load_hf_model(path)
    linears = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert set(hf_names(bits).values()) == linears and len(bits) == 14
    assert average_bits(bits, params) <= 5 and set(bits.values()) == {4, 8} and record["score"] == score
    groups = json.loads(recipe.read_text())["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["config_groups"]
    assert {t for g in groups.values() for t in g["targets"]} == {f"re:^{n.replace('.', '[.]')}$" for n in linears}
    assert main(["ptq", *common, "--plan", str(plan), "--mc-items", "0", "--out", str(out)]) == 0
    scheme = PTQConfig(a_bits=16, plan=tuple(bits.items())).name
    summary = json.loads((out / scheme / "summary.json").read_text())
    assert summary["ptq"]["plan"] and summary["val_loss_q"] != summary["val_loss_fp"]


def test_an_hf_model_is_scored_on_a_prepared_directory_prepared_with_its_tokenizer(tmp_path, corpus, capsys):
    """`--data DIR` from `optquant data prepare --tokenizer <the model folder>`: its val shards are the very tokens
    the raw files give with the model's tokenizer (the same split by document, EOS after each), so RTN's damage is
    the raw files' to the bit; GPTQ calibrates on its train shards; a directory prepared with another tokenizer is
    one error line."""
    from test_reliability import one_line_error

    path = _with_tokenizer(save_tiny("llama", tmp_path / "llama", vocab_size=320), corpus)
    prep = ["data", "prepare", str(corpus), "--processes", "1"]
    assert main([*prep, "--out", str(tmp_path / "tok"), "--tokenizer", str(path)]) == 0

    def damage(data: str, out: str) -> dict:
        assert main(["ptq", "--hf", str(path), "--data", data, "--seq-len", "32", "--mc-items", "20",
                     "--out", str(tmp_path / out)]) == 0
        return json.loads((tmp_path / out / "w4a4-rtn" / "summary.json").read_text())

    assert damage(str(tmp_path / "tok"), "prepared") == damage(str(corpus), "raw")
    assert main(["analyze", "--hf", str(path), "--data", str(tmp_path / "tok"), "--seq-len", "32", "--method", "gptq",
                 "--mc-items", "0", "--out", str(tmp_path / "prepared")]) == 0
    assert json.loads((tmp_path / "prepared" / "w4a4-gptq" / "analysis.json").read_text())["R_L"] > 0
    assert main([*prep, "--out", str(tmp_path / "bpe"), "--vocab-size", "300"]) == 0
    capsys.readouterr()
    assert main(["ptq", "--hf", str(path), "--data", str(tmp_path / "bpe"), "--seq-len", "32"]) == 2
    one_line_error(capsys, "was prepared with another tokenizer than", "--tokenizer")


def test_unsupported_family_is_one_clear_error(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(OptquantError, match="model_type 'gpt2' is not supported"):
        load_hf(tmp_path / "gpt2")


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def llama_run(nano_cfg, tmp_path, request):
    from optquant.config import apply_overrides
    from optquant.runs import run_dir
    from optquant.train import train

    cfg = apply_overrides(nano_cfg, ["model.arch=llama", "model.n_kv_head=1", f"model.tie_embeddings={request.param}",
                                     "train.steps=10"])
    path = run_dir(tmp_path / "runs", cfg)
    assert train(cfg, path)["status"] == "done"
    return path


def test_export_llama_run_matches_our_logits_and_tokenizer(llama_run, tmp_path, corpus):
    from optquant.data import load_tokens
    from optquant.ptq_stage import load_run_model

    out = tmp_path / "exported"
    assert main(["export", str(llama_run), "--hf", str(out)]) == 0
    cfg, ours = load_run_model(llama_run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(hf).__name__ == "LlamaForCausalLM"
    idx = torch.randint(0, cfg.model.vocab_size, (3, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=0, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    data = load_tokens(cfg.data, cfg.model.vocab_size)
    text = (corpus / "doc000.txt").read_text()[:300]
    assert tok(text, add_special_tokens=False)["input_ids"] == data.tokenizer.encode(text).ids
    assert tok(text)["input_ids"] == [data.eot_id, *data.tokenizer.encode(text).ids]  # by default after EOT
    assert tok.eos_token_id == data.eot_id and tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_export_refuses_the_olmo2_variant(nano_cfg, tmp_path, capsys):
    from optquant.runs import run_dir
    from optquant.train import train

    path = run_dir(tmp_path / "runs", nano_cfg)
    train(nano_cfg, path)
    assert main(["export", str(path), "--hf", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "matches no Hugging Face architecture exactly" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_bare_checkpoint_analyses_with_tokens_or_a_tokenizer_as_with_its_own(nano_cfg, runs_cache, corpus,
                                                                                  tmp_path, capsys):
    """An export with its tokenizer files deleted: `--tokens` (the very ids the folder's tokenizer gives: held-out
    windows as .npy, calibration as text) and `--tokenizer` (the deleted file, kept elsewhere) give the same
    analysis and damage as the folder with its tokenizer; a bare folder without either, or bad ids, is one line."""
    import shutil

    import numpy as np
    from test_reliability import one_line_error

    from optquant.config import apply_overrides
    from optquant.data import DataConfig
    from optquant.hf.ptq_stage import TRAIN_TOKENS_PER_SEQUENCE, HFSource, hf_tokens
    from optquant.ptq_stage import AnalysisConfig
    from optquant.runs import run_dir
    from optquant.train import train

    cfg = apply_overrides(nano_cfg, ["model.arch=llama", "model.n_kv_head=1"])
    train(cfg, run_dir(runs_cache, cfg))
    full, bare = tmp_path / "full", tmp_path / "bare"
    assert main(["export", str(run_dir(runs_cache, cfg)), "--hf", str(full)]) == 0
    shutil.copytree(full, bare)
    (tmp_path / "tokenizer.json").write_bytes((bare / "tokenizer.json").read_bytes())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).unlink()
    data = hf_tokens(HFSource(full, DataConfig(source=str(corpus)), seq_len=32),
                     TRAIN_TOKENS_PER_SEQUENCE * AnalysisConfig().gptq_sequences * 33)
    np.save(tmp_path / "val.npy", data.val)
    (tmp_path / "calib.txt").write_text(" ".join(map(str, data.train)))
    text, ids = ["--data", str(corpus)], ["--tokens", str(tmp_path / "val.npy"), "--calib-tokens",
                                          str(tmp_path / "calib.txt")]

    def result(what: str, path, source: list[str], out: str) -> dict:
        args = [what, "--hf", str(path), *source, "--seq-len", "32", "--mc-items", "0", "--out", str(tmp_path / out)]
        assert main([*args, *(["--method", "gptq"] if what == "analyze" else [])]) == 0
        file = "w4a4-gptq/analysis.json" if what == "analyze" else "w4a4-rtn/summary.json"
        return json.loads((tmp_path / out / file).read_text())

    for what in ("analyze", "ptq"):
        want = result(what, full, text, "with")
        assert result(what, bare, ids, "ids") == want
        assert result(what, bare, [*text, "--tokenizer", str(tmp_path / "tokenizer.json")], "tok") == want
    capsys.readouterr()
    bad = tmp_path / "bad.txt"
    for content, needle in (("", "cannot fill one window"), ("1 2 x", "not token ids"),
                            ("5 320 " * 40, "outside [0, 320)"), ("-1 " * 40, "token id -1")):
        bad.write_text(content)
        assert main(["analyze", "--hf", str(bare), "--tokens", str(bad), "--seq-len", "32"]) == 2
        one_line_error(capsys, str(bad), needle)
    np.save(tmp_path / "2d.npy", data.val[:66].reshape(2, 33))
    assert main(["analyze", "--hf", str(bare), "--tokens", str(tmp_path / "2d.npy"), "--seq-len", "32"]) == 2
    one_line_error(capsys, "1-D array of integers")
    assert main(["analyze", "--hf", str(bare), "--seq-len", "32"]) == 2
    one_line_error(capsys, str(bare), "--tokenizer PATH (ptq/analyze: or --tokens FILE)")
    assert main(["ptq", "--hf", str(bare), *ids[:2]]) == 2
    one_line_error(capsys, "--mc-items 0")


@pytest.mark.parametrize("family", ["qwen2", "olmo2"])
def test_lazy_loading_gives_the_resident_numbers(family, tmp_path):
    """A checkpoint in shards, its decoder layers read one sublayer at a time (hf/lazy.py, the meta device
    in between): outliers and the ABC walk (RTN and GPTQ) give exactly the numbers of the model loaded whole,
    and between two sublayers no decoder weight is in memory."""
    from optquant.metrics.outliers import outlier_metrics
    from optquant.metrics.propagation import propagation_of

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
    hf_model.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    whole, lazy = load_hf(tmp_path / "m"), load_hf(tmp_path / "m", lazy=True)
    assert all(p.is_meta for sub in lazy.sublayers() for p in sub.parameters())
    batches, calib = [tokens(2, seed=s) for s in (1, 2)], tokens(8, seed=3)
    assert repr(outlier_metrics(lazy, batches)) == repr(outlier_metrics(whole, batches))
    for qcfg in (PTQConfig(), PTQConfig(method="gptq", a_bits=16, w_group_size=32)):
        cfg = PropagationConfig(granularity="linear")
        got, want = (propagation_of(m, qcfg, batches, cfg, calib) for m in (lazy, whole))
        assert repr(got) == repr(want)  # every float equal (repr: nan too)
    assert all(p.is_meta for sub in lazy.sublayers() for p in sub.parameters())
    from optquant.hf.lazy import materialize_  # ptq --hf's load: read for good, the same model

    held = materialize_(lazy)
    assert not any(p.is_meta for p in held.parameters()) and not hasattr(held.blocks[0].attn, "_lazy_weights")
    assert torch.equal(held(batches[0]), whole(batches[0]))
    (tmp_path / "m" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(OptquantError, match="not a safetensors index"):
        load_hf(tmp_path / "m", lazy=True)


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_computes_in_fp32_one_sublayer_at_a_time_without_native_bf16(tied, tmp_path, monkeypatch):
    """The compute rule of a lazily read bf16 checkpoint (hf/lazy.py), the probe monkeypatched both ways. Without
    native bf16 each sublayer is read as fp32 (only while resident) and the embedding stays bf16: outliers and the
    ABC walk give exactly the numbers of the same checkpoint loaded as fp32 (bf16 → fp32 is exact). With it, the
    walk computes in bf16 (test_propagation's rounding bound holds that one), its R_L within 15 % of fp32's (on
    this random 2-layer model: under 5 % tied, 6.4 % untied, measured; a walk in fp32 gives a difference of 0)."""
    from optquant import device
    from optquant.device import resident
    from optquant.metrics.outliers import outlier_metrics
    from optquant.metrics.propagation import propagation_of

    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    config.tie_word_embeddings = tied
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    batches, calib, cfg = [tokens(2, seed=s) for s in (1, 2)], tokens(8, seed=3), PropagationConfig("linear")
    fp32 = load_hf(tmp_path / "m", dtype="float32", lazy=True)
    runs = {}
    for native in (False, True):
        monkeypatch.setattr(device, "fast_bf16", lambda d, native=native: native)
        model = load_hf(tmp_path / "m", lazy=True)
        assert model.embed.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16
        with resident(model.sublayers()[0]) as sub:
            assert {p.dtype for p in sub.parameters()} == {torch.bfloat16 if native else torch.float32}
        assert all(p.is_meta for sub in model.sublayers() for p in sub.parameters())
        runs[native] = [propagation_of(model, q, batches, cfg, calib) for q in (PTQConfig(), PTQConfig(
            method="gptq", a_bits=16, w_group_size=32), PTQConfig(quantize_head=True))]
        if not native:
            assert repr(outlier_metrics(model, batches)) == repr(outlier_metrics(fp32, batches))
    want = [propagation_of(fp32, q, batches, cfg, calib) for q in (PTQConfig(), PTQConfig(
        method="gptq", a_bits=16, w_group_size=32))]
    assert repr(runs[False][:2]) == repr(want)  # every float equal
    for (_, s32), (_, s16) in zip(runs[False], runs[True], strict=True):
        assert s16.R_L != s32.R_L and abs(s16.R_L - s32.R_L) <= 0.15 * s32.R_L, (s16.R_L, s32.R_L)


def test_a_bf16_checkpoint_stays_bf16_unless_asked(tmp_path):
    """The stored dtype by default (whole and lazy), fp32 with dtype="float32" (the analysis before issue 33)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES["llama"]())
    model.to(torch.bfloat16).save_pretrained(tmp_path / "m")
    for lazy in (False, True):
        model = load_hf(tmp_path / "m", lazy=lazy)
        assert model.embed.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
        assert load_hf(tmp_path / "m", dtype="float32", lazy=lazy).embed.weight.dtype == torch.float32
    with pytest.raises(OptquantError, match="--dtype"):
        load_hf(tmp_path / "m", dtype="int8")

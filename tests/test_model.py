"""Model tests: the architecture's defining properties, checked directly rather than by snapshot.

Causality by perturbing future tokens; preset parameter counts against closed-form formulas; weight
tying by identity and by gradient flow; the OLMo2 block's post-norm and QK-norm by construction.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from optquant.model import LM, MODEL_PRESETS, ModelConfig, count_params, lm_loss, model_config


def _closed_form_params(cfg: ModelConfig) -> tuple[int, int]:
    d, kv = cfg.d_model, cfg.n_kv_head * cfg.head_dim
    attn = 2 * d * d + 2 * d * kv
    mlp = (3 if cfg.arch == "llama" else 2) * d * cfg.mlp_hidden
    norms = 2 * d
    qk = cfg.n_head if cfg.arch == "olmo2" else 0
    blocks = cfg.n_layer * (attn + mlp + norms + qk)
    emb = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return blocks + d + emb, blocks + d


@pytest.mark.parametrize("arch", ["olmo2", "llama"])
def test_causality(arch):
    torch.manual_seed(0)
    model = LM(model_config("nano", arch=arch, vocab_size=50, seq_len=16, n_kv_head=1)).eval()
    idx = torch.randint(0, 50, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
def test_preset_param_counts(preset):
    cfg = model_config(preset)
    with torch.device("meta"):
        model = LM(cfg)
    total, non_emb = _closed_form_params(cfg)
    assert count_params(model) == total
    assert count_params(model, embeddings=False) == non_emb
    if preset[0].isdigit():  # the paper sizes: every linear input dimension a multiple of 128
        assert cfg.d_model % 128 == 0 and cfg.mlp_hidden % 128 == 0
        nominal = {"m": 1e6, "b": 1e9}[preset[-1]] * float(preset[:-1])
        assert 0.8 < total / nominal < 1.1, (preset, total)


def test_untied_llama_counts_head():
    cfg = model_config("nano", arch="llama", tie_embeddings=False)
    model = LM(cfg)
    assert model.lm_head.weight is not model.embed.weight
    assert count_params(model) == _closed_form_params(cfg)[0]


def test_tied_weights_share_storage_and_gradient():
    torch.manual_seed(0)
    model = LM(model_config("nano", vocab_size=40, seq_len=8))
    assert model.lm_head.weight is model.embed.weight
    x = torch.randint(0, 40, (2, 8))
    lm_loss(model, x, x).backward()
    # the embedding gradient includes the head's contribution: rows of unseen tokens still get gradient
    unseen = sorted(set(range(40)) - set(x.flatten().tolist()))
    assert model.embed.weight.grad[unseen].abs().sum() > 0


def test_init_and_qk_scale():
    torch.manual_seed(0)
    cfg = model_config("micro")
    model = LM(cfg)
    w = model.blocks[0].mlp.inner.up_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002
    scale = model.blocks[0].attn.inner.qk_scale
    assert scale.shape == (1, cfg.n_head, 1, 1)
    assert torch.allclose(scale, torch.full_like(scale, math.sqrt(cfg.head_dim)))


def test_post_norm_block_output_is_normalised_before_residual():
    torch.manual_seed(0)
    model = LM(model_config("nano", seq_len=8))
    sub = model.blocks[0].mlp
    x = 10 * torch.randn(2, 8, model.cfg.d_model)  # large enough that RMSNorm's eps is negligible
    delta = sub(x) - x
    rms = delta.pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3)  # RMSNorm with unit gain


def test_bad_model_config():
    with pytest.raises(ValueError, match="divisible"):
        LM(ModelConfig(d_model=100, n_head=3))
    with pytest.raises(ValueError, match="unknown model preset"):
        model_config("huge")


def test_single_scale_rmsnorm_is_osps_ssnorm():
    """OSP's SSNorm (Flax nn.RMSNorm(feature_axes=())): y = g·x/√(mean x² + ε) with one scalar g."""
    from optquant.model import SingleScaleRMSNorm

    norm = SingleScaleRMSNorm()
    x = torch.tensor([[3.0, -4.0], [1.0, 1.0]], dtype=torch.float64)
    with torch.no_grad():
        norm.weight.fill_(2.5)
    eps = torch.finfo(torch.float64).eps
    expected = 2.5 * x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps)  # rows: 2.5·(3,−4)/√12.5, 2.5·(1, 1)
    torch.testing.assert_close(norm(x), expected, rtol=1e-15, atol=0)
    assert norm.weight.shape == () and [p.numel() for p in norm.parameters()] == [1]
    lm = LM(model_config("nano", vocab_size=64, d_model=16, seq_len=8, norm="single"))
    norms = [m for m in lm.modules() if isinstance(m, torch.nn.RMSNorm | SingleScaleRMSNorm)]
    assert len(norms) == 2 * 2 + 1 and all(isinstance(m, SingleScaleRMSNorm) for m in norms)


def test_embedding_projection_is_osps_embproj():
    """OSP's EmbProj: x = P_in·e(idx) into the blocks, logits = W·P_out·norm(h), P orthogonal at init."""
    from optquant.optim.groups import split_params

    torch.manual_seed(0)
    lm = LM(model_config("nano", vocab_size=64, d_model=16, seq_len=8, embed_proj=True)).double()
    P_in, P_out = lm.embed.proj.weight, lm.norm[1].weight
    eye = torch.eye(16, dtype=torch.float64)
    torch.testing.assert_close(P_in @ P_in.T, eye, rtol=0, atol=1e-6)  # orthogonal in fp32
    torch.testing.assert_close(P_out.T @ P_out, eye, rtol=0, atol=1e-6)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    h = lm.embed.weight[idx] @ P_in.T  # the closed form, by hand
    torch.testing.assert_close(lm.embed(idx), h, rtol=1e-14, atol=0)
    for block in lm.blocks:
        h = block(h)
    logits = F.rms_norm(h, (16,), lm.norm[0].weight, None) @ P_out.T @ lm.embed.weight.T  # tied head
    torch.testing.assert_close(lm(idx), logits, rtol=1e-12, atol=1e-12)
    groups = split_params(lm)
    assert any(p is P_in for p in groups.matrices) and any(p is P_out for p in groups.matrices)
    assert [p for p in groups.embeddings] == [lm.embed.weight]
    from optquant.quant.layers import linear_layers

    assert not any(m is lm.embed.proj for _, m in linear_layers(lm))  # left in FP by PTQ


def test_osp_options_train_and_change_the_run_id(nano_cfg, tmp_path):
    from optquant.config import apply_overrides, config_hash
    from optquant.train import train

    osp = apply_overrides(nano_cfg, ["optim.name=muon", "model.norm=single", "model.embed_proj=true",
                                     "train.steps=10"])
    assert config_hash(osp) != config_hash(apply_overrides(osp, ["model.norm=rms", "model.embed_proj=false"]))
    assert math.isfinite(train(osp, tmp_path / "osp")["final_val_loss"])
    with pytest.raises(Exception, match="model.norm"):
        apply_overrides(nano_cfg, ["model.norm=layer"])


FP32_ROPE = dict(rtol=1e-6, atol=1e-7)  # the RoPE tables are computed in fp64 and kept in fp32 (model.rope_cache)


def _rope_by_hand(x: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE as a complex rotation: pair (x[2i], x[2i+1]) at position t times e^{i·t·base^(−2i/Dh)}."""
    dh, t = x.shape[-1], torch.arange(x.shape[-2], dtype=torch.float64)
    theta = t[:, None] * base ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], dh // 2, 2).contiguous()) * torch.polar(
        torch.ones_like(theta), theta)
    return torch.view_as_real(z).flatten(-2)


def _attention_by_hand(attn, x: torch.Tensor, base: float) -> torch.Tensor:
    """Causal softmax attention written out: heads, QK-norm (L2 · per-head scale) or 1/√Dh, the optional
    elementwise gate σ(x W_gᵀ) on the concatenated heads, then o_proj."""
    B, T, D = x.shape
    H, dh = attn.n_head, attn.head_dim

    def heads(W):
        return (x @ W.T).view(B, T, H, dh).transpose(1, 2)

    q, k, v = heads(attn.q_proj.weight), heads(attn.k_proj.weight), heads(attn.v_proj.weight)
    q, k = _rope_by_hand(q, base), _rope_by_hand(k, base)
    if attn.qk_norm:
        q = q / q.norm(dim=-1, keepdim=True) * attn.qk_scale
        k = k / k.norm(dim=-1, keepdim=True)
        scores = q @ k.transpose(-1, -2)
    else:
        scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
    if hasattr(attn, "gate_proj"):
        y = y * (1 / (1 + torch.exp(-(x @ attn.gate_proj.weight.T))))
    return y @ attn.o_proj.weight.T


def _tiny(arch: str, **options) -> LM:
    torch.manual_seed(0)
    lm = LM(model_config("nano", arch=arch, vocab_size=300, d_model=8, n_head=2, n_kv_head=2, seq_len=5,
                         **options)).double()
    with torch.no_grad():  # weights well away from init, so that no term is negligible
        for p in lm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return lm


@pytest.mark.parametrize("arch", ["olmo2", "llama"])
def test_op_block_is_he_et_als_outlier_protected_block(arch):
    """He et al. 2024's OP block: no norm in the block, each sublayer x + β·f(x) with a learnable scalar β
    (init 1/√(2·n_layer)), QK-norm on (the entropy regulation) also for llama; the final norm stays."""
    lm = _tiny(arch, block="op")
    assert all(sub.norm is None for sub in lm.sublayers()) and isinstance(lm.norm, torch.nn.RMSNorm)
    assert all(sub.inner.qk_norm for sub in lm.sublayers()[::2])
    assert all(sub.beta.shape == () for sub in lm.sublayers())
    assert LM(model_config("nano", block="op")).blocks[0].mlp.beta.item() == pytest.approx(1 / math.sqrt(4))
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    att, mlp = lm.blocks[0].attn, lm.blocks[0].mlp
    h = x + att.beta * _attention_by_hand(att.inner, x, lm.cfg.rope_base)
    torch.testing.assert_close(att(x), h, **FP32_ROPE)
    m = mlp.inner
    f = (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T) if arch == "llama"
         else F.relu(h @ m.up_proj.weight.T) ** 2) @ m.down_proj.weight.T
    torch.testing.assert_close(mlp(h), h + mlp.beta * f, **FP32_ROPE)
    plain = _tiny(arch)  # the standard block is what it was: the same weights give other outputs
    assert plain.blocks[0].attn.norm is not None and not hasattr(plain.blocks[0].attn, "beta")


@pytest.mark.parametrize("arch", ["olmo2", "llama"])
def test_gated_attention_is_qwens_sdpa_output_gate(arch):
    """Qwen's gated attention (G1): o_proj(SDPA(x) ⊙ σ(x·W_gᵀ)), x the attention's input, one gate per
    element of the concatenated heads; W_g is a quantized linear like q_proj and a matrix for the optimizer."""
    from optquant.optim.groups import split_params
    from optquant.quant.layers import linear_layers

    lm = _tiny(arch, attn_gate=True)
    attn = lm.blocks[0].attn.inner
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(attn(x), _attention_by_hand(attn, x, lm.cfg.rope_base), **FP32_ROPE)
    with torch.no_grad():
        attn.gate_proj.weight.zero_()  # σ(0) = 1/2: half the ungated output
    ungated = _tiny(arch).blocks[0].attn.inner
    ungated.load_state_dict({k: v for k, v in attn.state_dict().items() if k != "gate_proj.weight"})
    torch.testing.assert_close(attn(x), 0.5 * ungated(x), **FP32_ROPE)
    assert attn.gate_proj.weight.shape == (8, 8)
    assert any(m is attn.gate_proj for _, m in linear_layers(lm))
    assert any(p is attn.gate_proj.weight for p in split_params(lm).matrices)


@pytest.mark.parametrize("arch", ["olmo2", "llama"])
def test_hadamard_rotation_keeps_the_function_of_the_op_block_and_the_gate(arch):
    """QuaRot's rotation stays exact in FP with both options: the gate reads the rotated stream like q/k/v,
    an OP sublayer has no norm to fold, and β commutes with the rotation."""
    from optquant.quant.rotate import rotate_model_

    idx = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(3))
    for options in ({"attn_gate": True}, {"block": "op", "attn_gate": True}):  # the gate also after a pre-norm
        lm = _tiny(arch, **options)
        before = lm(idx)
        torch.testing.assert_close(rotate_model_(lm)(idx), before, rtol=1e-9, atol=1e-9)


def test_architecture_options_train_change_the_run_id_and_are_robust_arm_entries(nano_cfg, tmp_path):
    from optquant.config import apply_overrides, config_hash
    from optquant.quant.robust_config import entry_overrides
    from optquant.train import train

    both = apply_overrides(nano_cfg, ["model.block=op", "model.attn_gate=true", "train.steps=10"])
    off = apply_overrides(both, ["model.block=standard", "model.attn_gate=false"])
    ids = {config_hash(c) for c in (both, off, apply_overrides(off, ["model.block=op"]),
                                    apply_overrides(off, ["model.attn_gate=true"]))}
    assert len(ids) == 4 and config_hash(off) == config_hash(apply_overrides(nano_cfg, ["train.steps=10"]))
    assert math.isfinite(train(both, tmp_path / "both")["final_val_loss"])
    assert entry_overrides("model.block=op") == ("model.block=op",)
    assert apply_overrides(nano_cfg, list(entry_overrides("model.attn_gate=true"))).model.attn_gate
    osp = apply_overrides(nano_cfg, list(entry_overrides("model.norm=single+model.embed_proj=true")))
    assert (osp.model.norm, osp.model.embed_proj) == ("single", True)  # OSP's architecture as one arm
    with pytest.raises(Exception, match="joined by"):
        entry_overrides("model.norm=single+ema:0.9")
    with pytest.raises(Exception, match="model.block"):
        apply_overrides(nano_cfg, ["model.block=pre"])

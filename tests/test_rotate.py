"""Tests for quant/rotate.py.

Strategy: (1) the Hadamards are orthonormal and the factored online transform equals the dense
block Hadamard; (2) rotation is exact in FP: logits before and after agree to 1e-4 on small models
of both archs (tied/untied, GQA, non-power-of-two widths, random signs), with norm gains randomised
and weights large enough that a wrong fold moves logits by far more than the tolerance (a negative
control checks that); (3) rotation does its job: with planted outlier channels, the per-token
max/median ratio and the kurtosis of the inputs PTQ quantizes drop; (4) the nn.Linear set PTQ
iterates is the same after rotation, each module once.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optquant.errors import OptquantError
from optquant.model import LM, model_config
from optquant.quant.hadamard import block_hadamard, hadamard, largest_pow2_divisor
from optquant.quant.layers import linear_layers
from optquant.quant.rotate import (
    OnlineHadamard,
    Rotated,
    RotatedNorm,
    fuse_norms_,
    make_rotation,
    rotate_embedding_,
    rotate_model_,
    untie_head_,
)

SMALL = dict(vocab_size=128, seq_len=16, init_std=0.1, d_model=64)  # width 64: the tests below use it


def tiny_lm(preset: str = "nano", seed: int = 0, **kw) -> LM:
    torch.manual_seed(seed)
    model = LM(model_config(preset, **{**SMALL, **kw})).eval()
    with torch.no_grad():  # gains ≠ 1, else folding them would go untested
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model


def tokens(model: LM, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, model.cfg.vocab_size, (batch, model.cfg.seq_len), generator=g)


@pytest.mark.parametrize("n", [1, 2, 64, 128, 256, 1024])
def test_hadamard_power_of_two_orthonormal(n):
    H = hadamard(n, torch.float64)
    torch.testing.assert_close(H @ H.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(H.abs(), torch.full_like(H, n**-0.5))  # a Hadamard, not just orthogonal


@pytest.mark.parametrize("n", [96, 768, 1280, 3072])
def test_block_hadamard_orthonormal(n):
    H = block_hadamard(n, dtype=torch.float64)
    b = largest_pow2_divisor(n)
    assert b == {96: 32, 768: 256, 1280: 256, 3072: 1024}[n]
    # H·Hᵀ = I block by block (m·b³ flops instead of n³): diagonal blocks orthonormal, the rest zero
    blocks = H.view(n // b, b, n // b, b).transpose(1, 2)  # (m, m, b, b)
    for i in range(n // b):
        for j in range(n // b):
            want = torch.eye(b, dtype=torch.float64) if i == j else torch.zeros(b, b, dtype=torch.float64)
            got = blocks[i, j] @ blocks[i, j].T if i == j else blocks[i, j]
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("n", [64, 96, 768, 1280, 2048, 3072])
@pytest.mark.parametrize("kind", ["hadamard", "random"])
def test_online_hadamard_matches_dense(n, kind):
    rot = make_rotation(n, kind, torch.Generator().manual_seed(0))
    R = rot.matrix()
    if n <= 1280:  # larger ones equal block_hadamard(n), whose orthonormality is tested above
        torch.testing.assert_close(R @ R.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    if kind == "hadamard":
        torch.testing.assert_close(R, block_hadamard(n, dtype=torch.float64))
    else:
        assert not torch.equal(R, block_hadamard(n, dtype=torch.float64))
    x = torch.randn(3, 5, n, dtype=torch.float64)
    torch.testing.assert_close(rot(x), x @ R)


def test_online_hadamard_factors_large_blocks():
    rot = OnlineHadamard(2048)
    assert (rot.h1.shape[0], rot.h2.shape[0]) == (8, 256)  # 2048 = 8 · 256: n·264 flops, not n·2048


def test_random_rotation_is_seeded():
    a = make_rotation(64, "random", torch.Generator().manual_seed(3)).matrix()
    b = make_rotation(64, "random", torch.Generator().manual_seed(3)).matrix()
    c = make_rotation(64, "random", torch.Generator().manual_seed(4)).matrix()
    assert torch.equal(a, b) and not torch.equal(a, c)


CASES = {
    "olmo2-nano-tied": dict(arch="olmo2"),
    "olmo2-d128-random": dict(arch="olmo2", d_model=128, kind="random"),
    "olmo2-gqa-untied": dict(arch="olmo2", n_head=4, n_kv_head=2, tie_embeddings=False),
    "olmo2-d96-blocks": dict(arch="olmo2", d_model=96, n_head=2, n_kv_head=1),
    "llama-nano-tied": dict(arch="llama"),
    "llama-nano-untied": dict(arch="llama", tie_embeddings=False),
    "llama-d128-gqa": dict(arch="llama", d_model=128, n_head=4, n_kv_head=2),  # MLP 384 = 3·128
    "llama-random-d96": dict(arch="llama", d_model=96, n_head=2, n_kv_head=2, kind="random"),
}


@pytest.mark.parametrize("case", CASES)
def test_rotation_preserves_logits(case):
    kw = dict(CASES[case])
    preset, kind = kw.pop("preset", "nano"), kw.pop("kind", "hadamard")
    model = tiny_lm(preset, **kw)
    x = tokens(model)
    with torch.no_grad():
        ref = model(x)
        rotate_model_(model, kind, seed=0)
        out = model(x)
    assert ref.std() > 0.3  # logits are O(1), so atol 1e-4 is a real test
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert model.lm_head.weight is not model.embed.weight
    post = [isinstance(sub.norm, RotatedNorm) for sub in model.sublayers()]
    assert all(post) if model.cfg.arch == "olmo2" else not any(post)


def test_fuse_norms_alone_preserves_logits_and_sets_unit_gains():
    model = tiny_lm(arch="llama")
    x = tokens(model)
    with torch.no_grad():
        ref = model(x)
        untie_head_(model)
        fuse_norms_(model)
        out = model(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert all(torch.equal(sub.norm.weight, torch.ones(64)) for sub in model.sublayers())
    assert torch.equal(model.norm.weight, torch.ones(64))


def test_fuse_norms_needs_untied_head():
    with pytest.raises(OptquantError, match="untied"):
        fuse_norms_(tiny_lm())


def test_partial_rotation_changes_logits():
    """Negative control: the logit test can fail — rotating the embedding alone is far off."""
    model = tiny_lm()
    x = tokens(model)
    with torch.no_grad():
        ref = model(x)
        rotate_embedding_(model, make_rotation(64).matrix())  # tied: also rotates the head
        out = model(x)
    assert (out - ref).abs().max() > 0.1


def mmr(a: torch.Tensor) -> float:
    """Per-token max|x| / median|x|, averaged over tokens (paper.md §6.1)."""
    a = a.reshape(-1, a.shape[-1]).abs()
    return (a.max(-1).values / a.median(-1).values).mean().item()


def kurtosis(a: torch.Tensor) -> float:
    a = a.flatten().double()
    z = (a - a.mean()) / a.std(unbiased=False)
    return (z**4).mean().item() - 3.0


def linear_inputs(model: LM, x: torch.Tensor, linears: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda _m, args, n=n: seen.__setitem__(n, args[0].detach()))
        for n, m in linears.items()
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("arch", ["olmo2", "llama"])
def test_rotation_spreads_planted_outliers(arch):
    model = tiny_lm(arch=arch, init_std=0.02)
    inner_a, inner_m = model.blocks[0].attn.inner, model.blocks[0].mlp.inner
    with torch.no_grad():  # one huge residual channel, one huge v channel, one huge hidden unit
        model.embed.weight[:, 5] = 20.0
        inner_a.v_proj.weight[9] *= 100
        inner_m.up_proj.weight[7] *= 30
    watch = {
        "q": inner_a.q_proj,
        "o": inner_a.o_proj,
        "down": inner_m.down_proj,
        "up1": model.blocks[1].mlp.inner.up_proj,
    }
    x = tokens(model)
    before = linear_inputs(model, x, watch)
    rotate_model_(model)
    after = linear_inputs(model, x, watch)  # the same nn.Linear objects, now behind their rotations
    for name in watch:
        assert mmr(before[name]) > 8, name  # the planted outlier is there (inf: ReLU² median 0)
        assert mmr(after[name]) < 0.5 * mmr(before[name]), name
        assert kurtosis(after[name]) < 0.5 * kurtosis(before[name]), name


def test_linear_iteration_unchanged_by_rotation():
    for arch in ("olmo2", "llama"):
        model = tiny_lm(arch=arch, n_head=4, n_kv_head=2)
        before = linear_layers(model)
        rotate_model_(model)
        after = linear_layers(model)
        assert len(after) == len(before) == 2 * (7 if arch == "llama" else 6)
        assert [id(m) for _, m in after] == [id(m) for _, m in before]  # same objects, same order
        wrapped = [n for n, _ in after if n.endswith(".linear")]
        assert len(wrapped) == 4 and all(".o_proj." in n or ".down_proj." in n for n in wrapped)
        assert all(isinstance(m.linear, nn.Linear) for m in model.modules() if isinstance(m, Rotated))


def test_rotated_state_dict_has_no_shared_tensors():
    model = tiny_lm()
    rotate_model_(model, "random")
    ptrs = [t.data_ptr() for t in model.state_dict().values()]
    assert len(ptrs) == len(set(ptrs))


def test_rotate_model_rejects_bad_input():
    model = tiny_lm()
    with pytest.raises(OptquantError, match="rotation kind"):
        rotate_model_(model, "givens")
    assert rotate_model_(model, "none") is model and not any(isinstance(m, Rotated) for m in model.modules())
    rotate_model_(model)
    with pytest.raises(OptquantError, match="already rotated"):
        rotate_model_(model)
    with pytest.raises(OptquantError, match="autocast"), torch.autocast("cpu", dtype=torch.bfloat16):
        rotate_model_(tiny_lm())

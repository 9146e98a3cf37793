"""QAT tests: the QuEST quantizer against closed forms and the authors' constants, the gradient rules
(trust mask, STE, LSQ's eq. 3), the half-Hadamard identity, weight tying, the integer export against
the fake-quant forward, and a short QAT run with every registered optimizer (its loss falls, and its
first loss is not the FP model's on the same batch: the quantizers are in the loop).

The clip-scale references are independent of our formula: √(2/π) for 1 bit (the MSE-optimal ±c for a
Gaussian is ±E|X|), Max (1960) for the optimal uniform 2/4/8/16-level Gaussian quantizers, the
authors' table (gvlassis/ant@alexa, src/models/quantization.py), and a Monte Carlo run of the torch
quantizer itself. Everything runs single-threaded: the machine is shared and tiny ops thrash 2 threads.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optquant.errors import OptquantError
from optquant.model import LM, lm_loss, model_config
from optquant.optim import OPTIMIZERS, build_optimizers
from optquant.quant.hadamard import block_hadamard
from optquant.quant.primitives import QuantSpec, fake_quant
from optquant.quant.qat import (
    IntLinear,
    QATConfig,
    QATLinear,
    convert_qat_,
    export_quantized,
    gaussian_clip_scale,
    gaussian_mse,
    load_quantized_,
    lsq_quantize,
    prepare_qat_,
    quest_quantize,
    relative_degradation,
    ste_quantize,
)

# OPTIMAL_GAUSSIAN_SCALES of the authors' QAT code (QuEST's table)
AUTHORS_SCALES = {
    1: 0.7978845587140913,
    2: 1.4935346200015913,
    3: 2.051068354131873,
    4: 2.513930578568423,
    5: 2.9160938834961225,
    6: 3.276597282593217,
    7: 3.6010497188221655,
    8: 3.884938678807525,
}
# Max (1960), optimal *uniform* quantizer of N(0, 1): levels N -> (step, MSE)
MAX_1960 = {2: (1.596, 0.3634), 4: (0.9957, 0.1188), 8: (0.5860, 0.03744), 16: (0.3352, 0.01154)}


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # conftest already runs every test on one thread


def _slope(c: float, bits: int, h: float = 1e-4) -> float:
    return (gaussian_mse(c + h, bits) - gaussian_mse(c - h, bits)) / (2 * h)


@pytest.mark.parametrize("bits", range(1, 9))
def test_clip_scales_are_the_authors_table_solved_exactly(bits):
    c, theirs = gaussian_clip_scale(bits), AUTHORS_SCALES[bits]
    assert abs(_slope(c, bits)) < 1e-9  # a stationary point ...
    assert gaussian_mse(c, bits) <= gaussian_mse(theirs, bits)  # ... that beats theirs
    assert abs(_slope(theirs, bits)) < 1e-5  # theirs stopped on a gradient tolerance
    assert gaussian_mse(theirs, bits) / gaussian_mse(c, bits) - 1 < 2e-3
    assert abs(c - theirs) < (1e-4 if bits <= 5 else 0.04)


def test_clip_scale_closed_forms():
    assert gaussian_clip_scale(1) == pytest.approx(math.sqrt(2 / math.pi), abs=1e-12)
    for bits in range(1, 5):
        step, mse = MAX_1960[2**bits]
        c = gaussian_clip_scale(bits)
        assert 2 * c / (2**bits - 1) == pytest.approx(step, abs=6e-4)
        assert gaussian_mse(c, bits) == pytest.approx(mse, abs=6e-5)


def test_gaussian_mse_is_the_torch_quantizer_error():
    x = torch.randn(4, 2**18, dtype=torch.float64)
    for bits in (2, 4):
        err = (quest_quantize(x, bits) - x).square().mean(-1) / x.square().mean(-1)
        assert err.mean().item() == pytest.approx(gaussian_mse(gaussian_clip_scale(bits), bits), rel=0.02)


def _outlier_rows(rows: int = 8, cols: int = 256) -> torch.Tensor:
    x = torch.randn(rows, cols)
    x[:, :5] *= 8  # a few entries far beyond the clip scale in every row
    return x


def test_trust_mask_is_zero_exactly_on_clipped_entries():
    """Clipped = moved by clipping further than rounding can move anything: |x| > s + Δ/2 (the outer
    levels sit at ±s, so entries in (s, s + Δ/2] lose no more than half a step and keep their gradient)."""
    x = _outlier_rows().requires_grad_()
    g = torch.randn_like(x)
    out = quest_quantize(x, 4)
    out.backward(g)
    s = gaussian_clip_scale(4) * x.detach().square().mean(-1, keepdim=True).sqrt() + 1e-8
    step = 2 * s / 15
    clipped = x.detach().abs() > s + step / 2
    clamped_kept = (x.detach().abs() > s) & ~clipped
    assert clipped.sum() >= 8 and clamped_kept.sum() >= 1 and (~clipped).sum() > 1000
    assert torch.equal(x.grad[clipped], torch.zeros(int(clipped.sum())))
    assert torch.equal(x.grad[~clipped], g[~clipped])  # the identity elsewhere
    assert torch.equal(out.detach(), (torch.round(x.detach().clamp(-s, s) / step + 0.5) - 0.5) * step)


def test_trust_mask_with_a_tighter_trust():
    x = torch.randn(4, 512, requires_grad=True)
    quest_quantize(x, 4, trust=0.05).sum().backward()
    with torch.no_grad():
        err = (quest_quantize(x, 4) - x).abs()
        keep = err <= 0.05 * x.square().mean(-1, keepdim=True).sqrt()
    assert 0 < keep.float().mean() < 0.9
    assert torch.equal(x.grad, keep.float())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quest_levels_per_row(bits):
    x = _outlier_rows(4, 4096)
    q = quest_quantize(x, bits)
    counts = [row.unique().numel() for row in q]
    assert max(counts) <= 2**bits
    assert bits == 8 or min(counts) == 2**bits  # up to 4 bits, 4096 entries fill every level
    step = 2 * (gaussian_clip_scale(bits) * x.square().mean(-1, keepdim=True).sqrt() + 1e-8) / (2**bits - 1)
    odd = q / step * 2  # odd multiples of step/2
    assert torch.allclose(odd, odd.round(), atol=1e-3) and (odd.round().remainder(2) == 1).all()


def test_ste_and_lsq_levels_and_gradients():
    x = _outlier_rows().requires_grad_()
    q = ste_quantize(x, 4)
    assert torch.equal(q.detach(), fake_quant(x.detach(), QuantSpec(4, "sym", "channel")))
    assert max(row.unique().numel() for row in q) <= 15  # [-7, 7]
    g = torch.randn_like(x)
    q.backward(g)
    assert torch.equal(x.grad, g)  # straight through everywhere
    x.grad = None
    step = torch.full((8, 1), 0.3, requires_grad=True)
    ql = lsq_quantize(x, step, 4, grad_scale=1.0)
    assert max(row.unique().numel() for row in ql) <= 16  # [-8, 7]


def test_lsq_gradient_is_esser_eq3():
    x = (torch.randn(6, 40) * 2).requires_grad_()
    step = torch.rand(6, 1).add(0.2).requires_grad_()
    g, gs = torch.randn(6, 40), 0.37
    lsq_quantize(x, step, 3, gs).backward(g)
    qn, qp = 4, 3
    v = (x / step).detach()
    inside = (v > -qn) & (v < qp)
    ds = torch.where(inside, v.round() - v, torch.where(v <= -qn, -float(qn), float(qp)))
    assert torch.allclose(step.grad, gs * (g * ds).sum(-1, keepdim=True), atol=1e-5)
    assert torch.allclose(x.grad, g * inside, atol=1e-6)


def test_lsq_layer_init_and_grad_scale():
    lin = nn.Linear(64, 32, bias=False)
    q = QATLinear(lin, QATConfig(method="lsq", w_bits=4, a_bits=4))
    w_expected = 2 * lin.weight.detach().abs().mean(-1) / math.sqrt(7)
    assert q.w_step.step.shape == (32,) and torch.allclose(q.w_step.step.detach(), w_expected)
    x = torch.randn(2, 5, 64)
    q(x).sum().backward()
    assert q.a_step.step.shape == () and bool(q.a_step.initialized)
    assert torch.allclose(q.a_step.step.detach(), 2 * x.abs().mean() / math.sqrt(7))
    assert q.w_step.step.grad.abs().sum() > 0 and q.a_step.step.grad.abs() > 0


@pytest.mark.parametrize("in_features", [64, 96, 256])
def test_half_hadamard_leaves_the_layer_unchanged(in_features):
    lin = nn.Linear(in_features, 48).double()
    q = QATLinear(lin, QATConfig(hadamard_block=128))
    assert q.block == min(128, in_features & -in_features)
    x = torch.randn(3, 7, in_features, dtype=torch.float64)
    q.quantize = False  # the rotations alone
    assert torch.allclose(q(x), lin(x), atol=1e-12)  # (xH)(WH)ᵀ = xWᵀ
    q.quantize = True
    H = block_hadamard(in_features, q.block, torch.float64)  # independent dense construction
    ref = F.linear(quest_quantize(x @ H, 4), quest_quantize(lin.weight @ H, 4), lin.bias)
    assert torch.allclose(q(x), ref, atol=1e-12)
    assert not torch.allclose(q(x), lin(x), atol=1e-3)


def _nano() -> LM:
    return LM(model_config("micro", vocab_size=64, seq_len=32))


def test_prepare_keeps_weight_tying_and_optimizer_groups():
    model = _nano()
    n_params = len(list(model.parameters()))
    prepare_qat_(model, QATConfig())
    assert isinstance(model.lm_head, QATLinear) and model.lm_head.weight is model.embed.weight
    assert len(list(model.parameters())) == n_params
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lm_loss(model, torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))).backward()
    opt.step()
    assert model.lm_head.weight is model.embed.weight
    with pytest.raises(OptquantError):
        prepare_qat_(model, QATConfig())
    plain = prepare_qat_(_nano(), QATConfig(quantize_head=False))
    assert type(plain.lm_head) is nn.Linear and sum(isinstance(m, QATLinear) for m in plain.modules()) == 12


@pytest.mark.parametrize(
    "kw",
    [
        dict(method="x"),
        dict(w_bits=0),
        dict(method="ste", a_bits=1),
        dict(hadamard_block=96),
        dict(trust=0.0),
        dict(lsq_step="col"),
        dict(a_bits=12),
    ],
)
def test_config_rejects_bad_values(kw):
    """Types and ranges are checked as a run's config is built (config.validate); the bits, which depend on the
    method, and the block, a power of two, by QATConfig itself."""
    from optquant.config import RunConfig, validate

    with pytest.raises(OptquantError, match="qat"):
        validate(RunConfig(qat=QATConfig(**kw)))


@pytest.mark.parametrize(
    "cfg",
    [
        QATConfig(),
        QATConfig(method="ste"),
        QATConfig(method="lsq", lsq_step="tensor"),
        QATConfig(w_bits=3, a_bits=16),
        QATConfig(w_bits=8, a_bits=2, quantize_head=False),
    ],
)
def test_integer_export_matches_fake_quant(cfg, tmp_path):
    from safetensors.torch import load_file, save_file

    model = prepare_qat_(_nano().double(), cfg)
    x = torch.randint(0, 64, (2, 32))
    with torch.no_grad():
        fake = model(x)
    tensors = export_quantized(model)
    save_file(tensors, tmp_path / "q.safetensors")
    tensors = load_file(tmp_path / "q.safetensors")
    head = tensors.get("lm_head.meta")
    assert (head is not None) == cfg.quantize_head
    meta = tensors["blocks.0.mlp.inner.down_proj.meta"].tolist()
    assert meta[3] == (128 if cfg.method == "quest" else 0)  # Hadamard block of a 256-wide input
    if cfg.w_bits < 16:
        codes = tensors["blocks.0.attn.inner.q_proj.codes"]
        wide = cfg.method == "quest" and cfg.w_bits == 8  # odd codes up to ±255
        assert codes.dtype == (torch.int16 if wide else torch.int8) and codes.unique().numel() <= 2**cfg.w_bits
    real = load_quantized_(_nano().double(), tensors)
    assert sum(isinstance(m, IntLinear) for m in real.modules()) == 12 + cfg.quantize_head
    with torch.no_grad():
        assert torch.allclose(real(x), fake, rtol=1e-9, atol=1e-9)


def test_convert_in_fp32_and_bad_tensors():
    model = prepare_qat_(_nano(), QATConfig())
    x = torch.randint(0, 64, (2, 32))
    with torch.no_grad():
        fake = model(x)
        real = convert_qat_(model)(x)
    assert torch.allclose(real, fake, atol=1e-4)
    with pytest.raises(OptquantError):
        export_quantized(_nano())
    with pytest.raises(OptquantError):
        load_quantized_(_nano(), {"embed.weight": torch.zeros(64, 64)})


def test_bf16_autocast_trains():
    model = prepare_qat_(_nano(), QATConfig())
    x = torch.randint(0, 64, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    assert logits.dtype == torch.bfloat16
    F.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_relative_degradation():
    assert relative_degradation(56.58, 54.64) == pytest.approx(3.43, abs=5e-3)  # AdamW 350M, Table 4
    assert relative_degradation(63.05, 62.76) == pytest.approx(0.46, abs=5e-3)  # Shampoo 760M
    assert relative_degradation(3.0, 3.3, kind="loss") == pytest.approx(10.0)
    with pytest.raises(OptquantError):
        relative_degradation(0.0, 1.0)
    with pytest.raises(OptquantError):
        relative_degradation(1.0, 1.0, kind="ppl")


STREAM = (torch.arange(4096) % 17) * 3 % 64  # a repeating pattern: the next token is predictable


def _window(gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, len(STREAM) - 33, (8,), generator=gen)
    return torch.stack([STREAM[i : i + 33] for i in start.tolist()])


def _train(name: str, qat: QATConfig, steps: int = 25) -> list[float]:
    torch.manual_seed(0)
    model = prepare_qat_(_nano(), qat)
    optimizers = build_optimizers(model, OPTIMIZERS[name]())
    gen, losses = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        window = _window(gen)
        loss = lm_loss(model, window[:, :-1].contiguous(), window[:, 1:].contiguous())
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_qat_trains_with_every_optimizer(name):
    qat = _train(name, QATConfig())
    assert all(math.isfinite(v) for v in qat)
    assert sum(qat[-3:]) / 3 < 0.85 * qat[0]
    torch.manual_seed(0)  # the FP model _train starts from, on its first batch (FP training: test_optim)
    window = _window(torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp = lm_loss(_nano(), window[:, :-1].contiguous(), window[:, 1:].contiguous()).item()
    assert qat[0] != fp  # same weights and data: only the quantizers in the forward can make them differ


def test_lsq_and_ste_train():
    for cfg in (QATConfig(method="lsq"), QATConfig(method="ste")):
        losses = _train("adamw", cfg, steps=20)
        assert sum(losses[-3:]) / 3 < 0.85 * losses[0]

"""RTN primitives and FP4 formats.

Strategy: structural invariants on random data for every grid × granularity × format (at most 2^b
levels per scale group, idempotence, shapes, per-token independence), plus closed forms written out
independently here: hand-computed 4-bit values, the authors' `UniformQuantizer` formula, IEEE
round-to-nearest-even ties of E2M1, the MX spec's power-of-two scale, NVFP4's E4M3 scales.
"""

import math

import pytest
import torch

from optquant.errors import OptquantError
from optquant.quant import formats
from optquant.quant.primitives import QuantSpec, fake_quant, grid_range, group_rows, quant_params, round_to_grid

INT_SPECS = [
    QuantSpec(bits, grid, gran, 32)
    for bits in (3, 4, 8)
    for grid in ("sym", "sym8", "full", "odd", "asym")
    for gran in ("tensor", "channel", "token", "group")
]
FP4_SPECS = [QuantSpec(format="mxfp4"), QuantSpec(format="nvfp4")]
ALL_SPECS = INT_SPECS + FP4_SPECS


def _x(shape=(6, 96), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g).add(0.1)  # uneven channels
    x.view(-1, shape[-1])[0, 5] = 12.0  # an outlier
    return x


def _levels_per_group(xq: torch.Tensor, spec: QuantSpec) -> int:
    return max(len(torch.unique(row)) for row in group_rows(xq, spec.block))


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
def test_levels_and_idempotence(spec):
    x = _x()
    xq = fake_quant(x, spec)
    assert xq.shape == x.shape and xq.dtype == x.dtype
    assert _levels_per_group(xq, spec) <= 2**spec.bits
    if spec.grid != "full":  # "full": x̂'s absmax is 7Δ or 8Δ, not 7.5Δ, so a second pass takes another scale
        torch.testing.assert_close(fake_quant(xq, spec), xq, rtol=1e-6, atol=1e-7)
    rel = ((xq - x).norm() / x.norm()).item()
    assert 0 < rel < (0.05 if spec.bits == 8 else 2.0)


@pytest.mark.parametrize("grid", ["sym", "sym8", "full", "odd", "asym"])
def test_finer_scales_and_more_bits_reduce_error(grid):
    x = _x((16, 256), seed=2)

    def err(bits: int, gran: str) -> float:
        return ((fake_quant(x, QuantSpec(bits, grid, gran, 32)) - x).norm() / x.norm()).item()

    assert err(4, "group") < err(4, "channel") < err(4, "tensor")
    assert err(8, "channel") < err(4, "channel") / 8


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s.block != -1 and s.format != "nvfp4"], ids=str)
def test_rows_are_independent_per_token(spec):
    """Per-row scales: quantizing one token alone = quantizing it inside a (B, T, D) batch (not for
    per-tensor scales or NVFP4, where one tensor-wide scale couples the rows)."""
    x = _x((2, 3, 64), seed=1)
    xq = fake_quant(x, spec)
    torch.testing.assert_close(fake_quant(x[1, 2:3], spec), xq[1, 2:3], rtol=0, atol=0)


def test_group_rows_shapes():
    x = torch.randn(3, 5, 40)
    assert group_rows(x, -1).shape == (1, 600)
    assert group_rows(x, 0).shape == (15, 40)
    assert group_rows(x, 16).shape == (45, 16)  # 40 → padded to 48 = 3 groups
    s, z = quant_params(group_rows(x, 16), QuantSpec(4, "asym", "group", 16))
    assert s.shape == z.shape == (45, 1)


def test_short_last_group_equals_padded():
    x = torch.randn(4, 40)
    spec = QuantSpec(4, "asym", "group", 16)
    padded = torch.cat((x, torch.zeros(4, 8)), 1)
    torch.testing.assert_close(fake_quant(x, spec), fake_quant(padded, spec)[:, :40], rtol=0, atol=0)


def test_sym_closed_form():
    x = torch.tensor([[-1.0, 0.52, 0.2, 0.0, 0.07, 0.08]])
    expected = torch.tensor([[-7, 4, 1, 0, 0, 1]]) / 7  # round(7x): 3.64 → 4, 1.4 → 1, 0.49 → 0, 0.56 → 1
    torch.testing.assert_close(fake_quant(x, QuantSpec(4, "sym")), expected)
    assert grid_range(4, "sym") == (-7, 7) and grid_range(8, "sym") == (-127, 127)


def test_sym8_uses_both_ends():
    x = torch.tensor([[0.8, -0.45, 0.1, 0.75], [-1.0, 0.95, 0.3, 0.0]])
    xq = fake_quant(x, QuantSpec(4, "sym8"))
    # row 0: Δ = −0.8/8 (extreme positive, lands on −8); 0.75/Δ = −7.5 → −8; −0.45/Δ = 4.5 → 4 (even)
    torch.testing.assert_close(xq[0], torch.tensor([0.8, -0.4, 0.1, 0.8]))
    # row 1: Δ = 1/8; 0.95 → 7.6 clamps to 7 (the side opposite the extreme reaches 7/8)
    torch.testing.assert_close(xq[1], torch.tensor([-1.0, 0.875, 0.25, 0.0]))
    dense = fake_quant(torch.linspace(-1, 1, 1001)[None], QuantSpec(4, "sym8"))
    assert len(torch.unique(dense)) == 16


def test_full_grid_closed_form():
    """llm-compressor's and torchao's symmetric int: Δ = absmax/((q_max − q_min)/2), q = clamp(round(x/Δ), −8, 7)."""
    x = torch.tensor([[-7.5, 7.5, 0.5, 1.5, -0.5, 2.5, -3.2, 6.9]])  # absmax 7.5: Δ = 1 exactly
    assert [t.item() for t in quant_params(x, QuantSpec(4, "full"))] == [1.0, 0.0] and grid_range(4, "full") == (-8, 7)
    # ties to even: −7.5 → −8, 7.5 → 8 clamps to 7, 0.5 → 0, 1.5 → 2, 2.5 → 2
    want = torch.tensor([[-8.0, 7, 0, 2, 0, 2, -3, 7]])
    torch.testing.assert_close(fake_quant(x, QuantSpec(4, "full")), want, rtol=0, atol=0)
    x = _x()
    for bits in (3, 4, 8):
        spec = QuantSpec(bits, "full")
        scale = quant_params(x, spec)[0]
        assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / (float(2**bits - 1) / 2))  # compressed-tensors
        xq = fake_quant(x, spec)
        q = (xq / scale).round()
        assert q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
        assert ((x - xq).abs() <= scale / 2 + 1e-6 * x.abs()).all()  # every entry is in range: error ≤ Δ/2
    dense = fake_quant(torch.linspace(-1, 1, 1001, dtype=torch.float64)[None], QuantSpec(4, "full"))
    assert len(torch.unique(dense)) == 16  # all levels: −1/Δ = −7.5 exactly in fp64, rounding to −8


def test_full_grid_equals_compressed_tensors():
    """Where compressed-tensors (llm-compressor's quantization library) is installed: bitwise its symmetric int4."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    W = _x((64, 256), seed=3)
    for group in (0, 64):
        args = ct.QuantizationArgs(num_bits=4, symmetric=True, strategy="group" if group else "channel",
                                   group_size=group or None)
        Wg = W.reshape(64, -1, group) if group else W
        scale, zp = calculate_qparams(Wg.amin(-1), Wg.amax(-1), args)
        ref = fake_quantize(W, scale, zp, args) if group else fake_quantize(W, scale[:, None], zp[:, None], args)
        assert torch.equal(fake_quant(W, QuantSpec(4, "full", "group" if group else "channel", group or 128)), ref)


def _fake_quant_fp32(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """fake_quant before it kept fp64, verbatim: every dtype computed in fp32."""
    xf = x.float()
    k = x.shape[-1]
    rows = group_rows(xf, spec.block)
    amax = xf.abs().amax() if spec.format == "nvfp4" else None
    out = round_to_grid(rows, *quant_params(rows, spec, amax), spec)
    if spec.block > 0:
        out = out.reshape(-1, k + (-k % spec.block))[:, :k]
    return out.reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
def test_fp32_and_bf16_as_before_fp64_in_fp64(spec):
    x = _x()
    for dtype in (torch.float32, torch.bfloat16):  # the default study's dtypes: bitwise as before
        assert torch.equal(fake_quant(x.to(dtype), spec), _fake_quant_fp32(x.to(dtype), spec))
    x = x.double()
    if spec.format == "int" and spec.grid in ("sym", "full") and spec.block == 0:
        delta = x.abs().amax(-1, keepdim=True) / {"sym": 2 ** (spec.bits - 1) - 1, "full": 2 ** (spec.bits - 1) - 0.5}[
            spec.grid]
        want = (x / delta).round().clamp(*grid_range(spec.bits, spec.grid)) * delta  # the closed form, in fp64
        assert torch.equal(fake_quant(x, spec), want)
        assert not torch.equal(_fake_quant_fp32(x, spec), want)  # fp32 rounding: ~1e-8 relative off


def test_odd_matches_authors_formula():
    x = _x()
    b = 4
    s = x.abs().amax(-1, keepdim=True) + 1e-8
    step = 2 * s / (2**b - 1)
    ref = (torch.round(torch.clamp(x, -s, s) / step + 0.5) - 0.5) * step
    xq = fake_quant(x, QuantSpec(b, "odd", "token"))
    torch.testing.assert_close(xq, ref, rtol=1e-6, atol=1e-7)
    assert (xq != 0).all()  # no zero level
    assert len(torch.unique(xq[0])) <= 16


def test_asym_closed_form():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 1.4], [-2.0, -1.1, -0.4, 0.0, -1.9]])
    xq = fake_quant(x, QuantSpec(2, "asym"))
    torch.testing.assert_close(xq[0], torch.tensor([0.0, 1.0, 2.0, 3.0, 1.0]))  # Δ = 1, z = 0
    torch.testing.assert_close(xq[1], torch.tensor([-2.0, -4 / 3, -2 / 3, 0.0, -2.0]))  # Δ = 2/3, z = 3
    y = torch.randn(5, 64) + 3  # all positive: the range is widened to include 0, so 0 is exact
    assert (fake_quant(torch.cat((y, torch.zeros(5, 1)), 1), QuantSpec(4, "asym"))[:, -1] == 0).all()


def test_zero_rows_stay_zero():
    for spec in ALL_SPECS:
        if spec.grid == "odd" and spec.format == "int":
            continue  # "odd" has no zero level by construction
        assert (fake_quant(torch.zeros(3, 64), spec) == 0).all()


def test_e2m1_round_ties_to_even():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.3, -2.9, 0.2])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -3.0, 0.0])
    torch.testing.assert_close(formats.e2m1_round(y), want, rtol=0, atol=0)


def _on_e2m1(v: torch.Tensor) -> bool:
    grid = torch.tensor(formats.E2M1_VALUES)
    return bool(((v.abs().unsqueeze(-1) - grid).abs().amin(-1) <= 1e-5 * (1 + v.abs())).all())


def test_mxfp4_spec():
    x = _x((4, 64), seed=3)
    xq = fake_quant(x, QuantSpec(format="mxfp4"))
    blocks, qblocks = x.reshape(-1, 32), xq.reshape(-1, 32)
    X = formats.mx_scale(blocks.abs().amax(-1, keepdim=True))
    for amax, scale in zip(blocks.abs().amax(-1).tolist(), X.flatten().tolist(), strict=True):
        assert scale == 2.0 ** (math.floor(math.log2(amax)) - 2)  # OCP MX v1.0 §6.3, E8M0 power of two
    assert _on_e2m1(qblocks / X)
    assert (qblocks / X).abs().max() <= 6
    assert formats.mx_scale(torch.tensor([0.0])).item() == 2.0**-127  # all-zero block: smallest scale
    # saturation: amax/X ∈ [4, 8) and elements above 6·X clamp to it
    sat = fake_quant(torch.tensor([[7.5] + [0.1] * 31]), QuantSpec(format="mxfp4"))
    assert sat[0, 0].item() == 6.0


def test_nvfp4_spec():
    x = _x((4, 64), seed=4)
    xq = fake_quant(x, QuantSpec(format="nvfp4"))
    blocks, qblocks = x.reshape(-1, 16), xq.reshape(-1, 16)
    s = formats.nv_tensor_scale(x.abs().amax())
    assert s.dtype == torch.float32
    E = formats.nv_block_scale(blocks.abs().amax(-1, keepdim=True), s)
    assert torch.equal(E.to(torch.float8_e4m3fn).float(), E)  # representable in E4M3
    assert E.max().item() == 448.0  # the block holding the tensor max uses the top of E4M3
    assert _on_e2m1(qblocks / (E * s))
    assert qblocks.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)


def test_bad_specs_raise():
    with pytest.raises(OptquantError):
        QuantSpec(bits=3, format="mxfp4")
    with pytest.raises(OptquantError):
        QuantSpec(grid="nf4")  # type: ignore[arg-type]
    with pytest.raises(OptquantError):
        QuantSpec(granularity="group", group_size=0)
    with pytest.raises(OptquantError):
        fake_quant(torch.tensor(1.0), QuantSpec())

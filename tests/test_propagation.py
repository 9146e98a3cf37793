"""ABC decomposition, R_L and the linear-layer gain split.

Strategy: exact identities only. On a briefly trained nano model with real W4A4 RTN: A + B + C = R in
both norms, R_in of each chain module equals the previous module's R, and R_L equals the relative
error of the two models' logits computed from two plain forwards (the chain walk is the real network).
With quantization off every term is exactly 0. On a single linear layer with an explicitly built
f^q(x) = (W+ε^W)x + ε^h (ε^h fixed): the closed forms of a and b (paper.md §7.5) and G = G1·G2.
"""

import copy
import math

import pytest
import torch

from optquant.errors import OptquantError
from optquant.metrics.gains import gain_split
from optquant.metrics.propagation import (
    PropagationConfig,
    abc_terms,
    propagation,
    propagation_of,
    ptq_pair,
    summarize,
)
from optquant.model import LM, lm_loss, model_config
from optquant.quant.ptq import PTQConfig

VOCAB, T = 64, 32




def _stream(n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    pattern = torch.randint(0, VOCAB, (23,), generator=g)
    return pattern.repeat(n // 23 + 1)[:n]


@pytest.fixture(scope="module")
def trained() -> LM:
    """nano, 30 AdamW steps on a repeating-pattern stream (so the weights are not just the init)."""
    torch.manual_seed(0)
    model = LM(model_config("nano", vocab_size=VOCAB, seq_len=T))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stream = _stream()
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        starts = torch.randint(0, len(stream) - T - 1, (8,), generator=g)
        x = torch.stack([stream[s : s + T] for s in starts])
        y = torch.stack([stream[s + 1 : s + T + 1] for s in starts])
        opt.zero_grad()
        lm_loss(model, x, y).backward()
        opt.step()
    return model.eval()


def _batches(n=2, b=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (b, T), generator=g) for _ in range(n)]


def _chain_rows(rows, norm):
    return [r for r in rows if r.norm == norm and r.kind != "linear"]


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_abc_identity_and_chain_on_trained_model(trained, rotation):
    fp, q = ptq_pair(trained, PTQConfig(rotation=rotation))
    batches = _batches()
    rows, summary = propagation(fp, q, batches, PropagationConfig(granularity="linear"))
    assert {r.kind for r in rows} == {"linear", "sublayer", "final"}
    for r in rows:
        assert r.R > 0 and r.A + r.B + r.C == pytest.approx(r.R, rel=1e-5), r
    for norm in ("token", "tensor"):
        chain = _chain_rows(rows, norm)
        assert len(chain) == 2 * 2 + 1 and chain[-1].name == "head"
        assert chain[0].R_in == 0 and math.isnan(chain[0].G)
        for prev, cur in zip(chain, chain[1:], strict=False):
            assert cur.R_in == pytest.approx(prev.R, rel=1e-12)
            assert cur.G == pytest.approx(cur.A / prev.R, rel=1e-12)
    # the chain is the network: R_L equals the logits' relative error from two plain forwards
    with torch.no_grad():
        lf = torch.cat([fp(b) for b in batches]).double().flatten(0, 1)
        lq = torch.cat([q(b) for b in batches]).double().flatten(0, 1)
    per_token = ((lq - lf).square().sum(-1) / lf.square().sum(-1)).mean().item()
    assert summary.R_L == pytest.approx(per_token, rel=1e-6)
    tensor = summarize(rows, "tensor")
    assert tensor.R_L == pytest.approx(((lq - lf).square().sum() / lf.square().sum()).item(), rel=1e-6)
    chain = _chain_rows(rows, "token")
    assert summary.sum_A == pytest.approx(sum(r.A for r in chain))
    assert summary.sum_B == pytest.approx(sum(r.B for r in chain))


def test_gain_split_identity_on_real_layers(trained):
    fp, q = ptq_pair(trained, PTQConfig())
    rows, summary = propagation(fp, q, _batches(n=1), PropagationConfig(granularity="linear"))
    lin = [r for r in rows if r.kind == "linear" and r.norm == "tensor" and r.R_in > 0]
    assert len(lin) >= 4  # o_proj, up_proj, down_proj of block 0 and everything of block 1
    for r in lin:
        assert r.G1 * r.G2 == pytest.approx(r.G_lin, rel=1e-9)
        assert 0.5 < r.G1 < 2.0  # W + ½ε^W stays close to W in spectral norm
    token_lin = [r for r in rows if r.kind == "linear" and r.norm == "token"]
    assert all(math.isnan(r.G1) for r in token_lin)
    all_lin = [r for r in rows if r.kind == "linear" and r.norm == "tensor"]
    assert summary.mean_G1 == pytest.approx(sum(r.G1 for r in all_lin) / len(all_lin), rel=1e-12)


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_all_terms_zero_without_quantization(trained, rotation):
    fp, q16 = ptq_pair(trained, PTQConfig(w_bits=16, a_bits=16, rotation=rotation))
    for q in (q16, copy.deepcopy(fp)):
        rows, summary = propagation(fp, q, _batches(n=1), PropagationConfig(granularity="linear"))
        for r in rows:
            assert (r.R, r.A, r.B, r.C, r.R_in) == (0, 0, 0, 0, 0), r
        assert summary.R_L == 0 and summary.sum_A == 0 and summary.sum_B == 0


def test_batches_stream_like_one_batch(trained):
    fp, q = ptq_pair(trained, PTQConfig())
    b1, b2 = _batches(n=2, b=2)
    split, _ = propagation(fp, q, [b1, b2])
    whole, _ = propagation(fp, q, [torch.cat([b1, b2])])
    for r, s in zip(split, whole, strict=True):
        assert (r.name, r.norm) == (s.name, s.norm)
        assert r.R == pytest.approx(s.R, rel=1e-4) and r.A == pytest.approx(s.A, rel=1e-4, abs=1e-12)


def test_final_module_settings(trained):
    fp, q = ptq_pair(trained, PTQConfig())
    batches = _batches(n=1)
    logits_rows, _ = propagation(fp, q, batches)
    none_rows, none_sum = propagation(fp, q, batches, PropagationConfig(final="none"))
    norm_rows, _ = propagation(fp, q, batches, PropagationConfig(final="norm"))
    assert _chain_rows(none_rows, "token")[-1].kind == "sublayer"
    assert none_sum.R_L == pytest.approx(_chain_rows(logits_rows, "token")[-2].R, rel=1e-12)
    assert _chain_rows(norm_rows, "token")[-1].name == "norm"
    with_head, _ = propagation(fp, q, batches, PropagationConfig(granularity="linear", skip=()))
    assert any(r.name == "lm_head" for r in with_head)  # lm_head is FP here, but still a linear row


def _linear_case(seed=0, T_=40, d_in=6, d_out=9):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    eW = 0.1 * torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    eh = 0.05 * torch.randn(d_out, generator=g, dtype=torch.float64)  # fixed additive activation noise
    h = torch.randn(T_, d_in, generator=g, dtype=torch.float64)
    dh = 0.2 * torch.randn(T_, d_in, generator=g, dtype=torch.float64)
    return W, eW, eh, h, dh


def test_linear_closed_forms():
    W, eW, eh, h, dh = _linear_case()
    f = lambda x: x @ W.T  # noqa: E731
    fq = lambda x: x @ (W + eW).T + eh  # noqa: E731
    from propagation_reference import four_evals, shapley_split  # the fast walk forms a, b inside output_rows

    a, b = shapley_split(*four_evals(f, fq, h, h + dh))
    torch.testing.assert_close(a, dh @ (W + 0.5 * eW).T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b, (h + 0.5 * dh) @ eW.T + eh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a + b, fq(h + dh) - f(h), rtol=1e-12, atol=1e-12)


def test_gain_equals_G1_times_G2_in_tensor_norm():
    W, eW, eh, h, dh = _linear_case(seed=1)
    f = lambda x: x @ W.T  # noqa: E731
    fq = lambda x: x @ (W + eW).T + eh  # noqa: E731
    t = abc_terms(f, fq, h, h + dh, norm="tensor")
    G1, G2, G_lin = gain_split(W, W + eW, h, h + dh)
    assert t["A"] + t["B"] + t["C"] == pytest.approx(t["R"], rel=1e-12)
    assert t["G"] == pytest.approx(G1 * G2, rel=1e-10)
    assert G_lin == pytest.approx(G1 * G2, rel=1e-12)
    M = W + 0.5 * eW
    assert G1 == pytest.approx(
        (torch.linalg.svdvals(M)[0] / torch.linalg.svdvals(W)[0]).item() ** 2, rel=1e-12
    )
    # the per-token norm has no such identity: its gain differs
    assert abc_terms(f, fq, h, h + dh, norm="token")["G"] != pytest.approx(G1 * G2, rel=1e-3)


def test_input_dependent_noise_breaks_only_G(trained):
    """With per-token activation rounding ε^h depends on x, so G ≠ G_lin, but A+B+C=R still holds."""
    W, eW, _, h, dh = _linear_case(seed=2)
    fq = lambda x: torch.round(4 * x) / 4 @ (W + eW).T  # noqa: E731
    t = abc_terms(lambda x: x @ W.T, fq, h, h + dh, norm="tensor")
    _, _, G_lin = gain_split(W, W + eW, h, h + dh)
    assert t["A"] + t["B"] + t["C"] == pytest.approx(t["R"], rel=1e-12)
    assert t["G"] != pytest.approx(G_lin, rel=1e-3)


def test_bad_inputs(trained):
    fp, q = ptq_pair(trained, PTQConfig())
    small = LM(model_config("nano", vocab_size=VOCAB, seq_len=T, n_layer=1))
    with pytest.raises(OptquantError, match="sublayers"):
        propagation(fp, small, _batches(n=1))
    with pytest.raises(OptquantError, match="granularity"):
        propagation(fp, q, _batches(n=1), PropagationConfig(granularity="block"))
    with pytest.raises(OptquantError, match="LM"):
        propagation(torch.nn.Linear(2, 2), q, _batches(n=1))


@pytest.mark.parametrize("granularity", ["sublayer", "linear"])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_fast_abc_equals_the_reference_implementation_in_fp64(trained, granularity, method):
    """The batched, buffer-reusing ABC gives today's numbers: the implementation before the speed-up is
    kept verbatim in tests/propagation_reference.py; in fp64 every term of every row agrees to 1e-12."""
    model = copy.deepcopy(trained).double()
    calib = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(5))
    fp, q = ptq_pair(model, PTQConfig(method=method, rotation="hadamard" if method == "gptq" else "none"), calib)
    _assert_matches_reference(fp, q, granularity=granularity)


def test_fast_abc_equals_the_reference_on_llama_with_the_head_as_a_linear_row():
    """Llama: pre-norm sublayers (a linear's inputs in the two calls are equal, not one tensor) and
    gate/up sharing an input; skip=() makes the FP head, evaluated once per input, a linear row too."""
    torch.manual_seed(0)
    model = LM(model_config("nano", arch="llama", vocab_size=VOCAB, seq_len=T)).double()
    fp, q = ptq_pair(model, PTQConfig())
    _assert_matches_reference(fp, q, granularity="linear", skip=())


def _assert_matches_reference(fp, q, **cfg):
    import propagation_reference as ref

    rows, summary = propagation(fp, q, _batches(n=2, b=3), PropagationConfig(**cfg))
    ref_rows, ref_summary = ref.propagation(fp, q, _batches(n=2, b=3), ref.PropagationConfig(**cfg))
    assert len(rows) == len(ref_rows) and len(rows) > 0
    for r, e in zip(rows, ref_rows, strict=True):
        assert (r.index, r.name, r.kind, r.norm) == (e.index, e.name, e.kind, e.norm)
        for f in ("R", "A", "B", "C", "R_in", "G", "G1", "G2", "G_lin"):
            got, want = getattr(r, f), getattr(e, f)
            assert (math.isnan(got) and math.isnan(want)) or abs(got - want) <= 1e-12 * max(1.0, abs(want)), \
                (r.name, r.norm, f, got, want)
    for f in ("R_L", "sum_A", "sum_B", "sum_C", "mean_gain", "mean_gain_linear", "mean_G1", "mean_G2"):
        got, want = getattr(summary, f), getattr(ref_summary, f)
        assert (math.isnan(got) and math.isnan(want)) or abs(got - want) <= 1e-12 * max(1.0, abs(want))


@pytest.mark.parametrize("qcfg", [PTQConfig(), PTQConfig(method="gptq", quantize_head=True),
                                  PTQConfig(method="gptq", rotation="hadamard", a_bits=16, w_group_size=16)],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("granularity", ["sublayer", "linear"])
def test_walk_quantizing_one_sublayer_at_a_time_equals_the_two_model_path(trained, qcfg, granularity):
    """propagation_of (the FP model held once, each quantized sublayer made as it is reached, GPTQ's
    calibration moved along the walk) gives the rows of propagation(*ptq_pair(...)) in fp32, and in fp64
    those of the implementation before its speed-up (tests/propagation_reference.py) to 1e-12."""
    import propagation_reference as ref

    calib = torch.randint(0, VOCAB, (6, T), generator=torch.Generator().manual_seed(5))
    skip = () if qcfg.quantize_head else ("lm_head",)
    cfg = PropagationConfig(granularity=granularity, skip=skip)
    rows, summary = propagation_of(trained, qcfg, _batches(n=2, b=3), cfg, calib)
    want, want_summary = propagation(*ptq_pair(trained, qcfg, calib), _batches(n=2, b=3), cfg)
    assert [(r.name, r.norm) for r in rows] == [(r.name, r.norm) for r in want]
    for r, e in zip(rows, want, strict=True):
        for f in ("R", "A", "B", "C", "R_in", "G", "G1", "G2", "G_lin"):
            assert getattr(r, f) == pytest.approx(getattr(e, f), rel=1e-6, abs=1e-12, nan_ok=True), (r.name, f)
    assert summary.R_L == pytest.approx(want_summary.R_L, rel=1e-6)
    model = copy.deepcopy(trained).double()
    rows, _ = propagation_of(model, qcfg, _batches(n=2, b=3), cfg, calib)
    ref_rows, _ = ref.propagation(*ptq_pair(model, qcfg, calib), _batches(n=2, b=3), ref.PropagationConfig(
        granularity=granularity, skip=skip))
    for r, e in zip(rows, ref_rows, strict=True):
        for f in ("R", "A", "B", "C", "R_in"):
            got, wanted = getattr(r, f), getattr(e, f)
            assert abs(got - wanted) <= 1e-12 * max(1.0, abs(wanted)), (r.name, r.norm, f, got, wanted)


def _states(model, batches):
    """Per token, each chain module's output (the sublayers', then the logits) over `batches`, in fp64."""
    out = []
    with torch.no_grad():
        for b in batches:
            h, rows = model.embed(b), []
            for sub in model.sublayers():
                h = sub(h)
                rows.append(h.double().flatten(0, 1))
            rows.append(model.head(h).double().flatten(0, 1))
            out.append(rows)
    return [torch.cat(col) for col in zip(*out, strict=True)]


def _floor(a, b):
    """mean over tokens of ‖a − b‖²/‖b‖²: the relative rounding error of one chain in bf16."""
    return ((a - b).square().sum(-1) / b.square().sum(-1)).mean().item()


@pytest.mark.parametrize("qcfg", [PTQConfig(), PTQConfig(method="gptq", a_bits=16, w_group_size=16)],
                         ids=lambda c: c.name)
def test_bf16_analysis_is_within_its_rounding_bound(trained, qcfg):
    """A bf16 model analysed in bf16 (the stored dtype, fp32 bookkeeping) against the same weights in fp32
    (what loading a bf16 checkpoint as fp32 did before issue 33). Each chain module's outputs are rounded
    with a relative error f (per token, mean ‖δh‖²/‖h‖², measured here from the FP and quantized chains in
    both dtypes, f = the larger); a and b combine four evaluations, so ‖δa‖², ‖δb‖² ≤ e·‖h‖² with e = 4f,
    and Cauchy–Schwarz gives |X_bf16 − X_fp32| ≤ 2√(X·e) + e + 3X√f for X = R, A, B (the last term: the
    denominator ‖h‖² rounded) and 2(√(A·e) + √(B·e) + e) + 3|C|√f for C. The damage: cross-entropy is
    √2-Lipschitz in the logits z (‖softmax − onehot‖ ≤ √2), so |ΔL_bf16 − ΔL_fp32| ≤ √2·(mean ‖δz‖ of the FP
    model + that of the quantized one). Measured: R_L within 0.3-2 % (docs/your-own.md)."""
    from optquant.evaluate import val_loss
    from optquant.metrics.chain import shared_copy
    from optquant.quant.ptq import quantize_

    m16 = copy.deepcopy(trained).to(torch.bfloat16)
    m32 = copy.deepcopy(m16).float()  # the very bf16 weights, computed in fp32
    calib = torch.randint(0, VOCAB, (8, T), generator=torch.Generator().manual_seed(5))
    batches = _batches(n=2, b=4)
    rows = {dt: _chain_rows(propagation_of(m, qcfg, batches, PropagationConfig(), calib)[0], "token")
            for dt, m in (("16", m16), ("32", m32))}
    q = {dt: quantize_(shared_copy(m), qcfg, calib) for dt, m in (("16", m16), ("32", m32))}
    fp_states, q_states = (_states(m, batches) for m in (m16, m32)), (_states(q[d], batches) for d in ("16", "32"))
    floors = [max(_floor(a, b), _floor(c, d)) for a, b, c, d in zip(*fp_states, *q_states, strict=True)]
    assert len(floors) == len(rows["32"]) and max(floors) > 0
    for r16, r32, f in zip(rows["16"], rows["32"], floors, strict=True):
        e = 4 * f
        for x in ("R", "A", "B"):
            want = getattr(r32, x)
            assert abs(getattr(r16, x) - want) <= 2 * (want * e) ** 0.5 + e + 3 * want * f**0.5, (r32.name, x, f)
        bound_c = 2 * ((r32.A * e) ** 0.5 + (r32.B * e) ** 0.5 + e) + 3 * abs(r32.C) * f**0.5
        assert abs(r16.C - r32.C) <= bound_c, (r32.name, "C")
    val = [torch.randint(0, VOCAB, (4, T + 1), generator=torch.Generator().manual_seed(9)) for _ in range(2)]
    delta = {d: val_loss(q[d], val).loss - val_loss(m, val).loss for d, m in (("16", m16), ("32", m32))}
    with torch.no_grad():
        dz = [torch.cat([(a(b[:, :-1]).double() - c(b[:, :-1]).double()).norm(dim=-1).flatten() for b in val]).mean()
              for a, c in ((m16, m32), (q["16"], q["32"]))]
    assert abs(delta["16"] - delta["32"]) <= 2**0.5 * sum(dz).item()
    assert rows["16"][-1].R != rows["32"][-1].R  # the bf16 walk really computed in bf16

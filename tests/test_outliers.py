"""Outlier metrics and activation capture.

Strategy: the pure metrics are checked against direct numpy / scipy.stats computations on tensors
with planted outlier channels; the streaming model-level version is checked against the pure
functions applied to the concatenated captured activations (so the exact merges are tested), and the
hooks are checked to disappear on exit, also after an exception.
"""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from optquant.metrics.capture import capture
from optquant.metrics.outliers import (
    Moments,
    aggregate,
    kurt_rms,
    kurtosis,
    mmr,
    outlier_metrics,
)
from optquant.model import LM, model_config
from optquant.quant.layers import linear_layers


def _acts(seed=0, T=200, d=48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g, dtype=torch.float64)
    x[:, 3] *= 40.0  # a planted outlier channel
    x[:, d // 3] += 5.0
    return x


@pytest.mark.parametrize("center", ["median", "mean"])
def test_mmr_matches_numpy(center):
    x = _acts()
    a = np.abs(x.numpy())
    den = np.median(a, axis=1) if center == "median" else a.mean(axis=1)
    expected = np.mean(a.max(axis=1) / den)
    assert mmr(x, center) == pytest.approx(expected, rel=1e-6)
    # leading axes are token axes
    assert mmr(x.view(4, 50, -1), center) == pytest.approx(expected, rel=1e-6)


def test_mmr_odd_width_median():
    x = _acts(d=31)
    a = np.abs(x.numpy())
    assert mmr(x) == pytest.approx(np.mean(a.max(1) / np.median(a, 1)), rel=1e-6)


def test_mmr_skips_zero_median_tokens():
    x = _acts(T=10, d=8)
    x[:4, :5] = 0.0  # 5 of 8 zeros: median |x| = 0 for the first four tokens
    x[9] = 0.0  # an all-zero token: 0/0
    a = np.abs(x.numpy())[4:9]
    assert mmr(x) == pytest.approx(np.mean(a.max(1) / np.median(a, 1)), rel=1e-6)
    assert math.isnan(mmr(torch.zeros(3, 8)))


def test_kurtosis_and_kurt_rms_match_scipy():
    x = _acts(seed=1)
    assert kurtosis(x) == pytest.approx(stats.kurtosis(x.numpy().ravel()), rel=1e-9)
    rms = np.sqrt((x.numpy() ** 2).mean(axis=0))
    assert kurt_rms(x) == pytest.approx(stats.kurtosis(rms), rel=1e-9)
    assert kurt_rms(x.view(10, 20, -1)) == pytest.approx(stats.kurtosis(rms), rel=1e-9)
    assert math.isnan(kurtosis(torch.ones(5, 5)))


def test_moments_merge_is_exact():
    g = torch.Generator().manual_seed(2)
    parts = [
        torch.randn(n, generator=g, dtype=torch.float64) * s + m
        for n, s, m in ((7, 1, 0), (300, 3, 5), (1, 1, -2))
    ]
    merged = Moments()
    for p in parts:
        merged = merged.merge(Moments.of(p))
    whole = torch.cat(parts).numpy()
    assert merged.n == whole.size
    assert merged.mean == pytest.approx(whole.mean(), rel=1e-12)
    for k, M in ((2, merged.M2), (3, merged.M3), (4, merged.M4)):
        assert M / whole.size == pytest.approx(stats.moment(whole, k), rel=1e-9)
    assert merged.excess_kurtosis == pytest.approx(stats.kurtosis(whole), rel=1e-9)


def test_capture_records_and_removes_hooks():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    with capture(net, [net[0], net[2]], outputs=True) as acts:
        net(x)
        net(x)
    assert set(acts.inputs) == {"0", "2"} and len(acts.inputs["0"]) == 2
    torch.testing.assert_close(acts.inputs["0"][0], x)
    torch.testing.assert_close(acts.outputs["2"][1], net(x))
    torch.testing.assert_close(torch.cat(acts.inputs["2"]), torch.relu(net[0](x)).repeat(2, 1))
    assert all(not m._forward_hooks for m in net.modules())
    seen = []
    with (
        pytest.raises(RuntimeError),
        capture(net, {"first": net[0]}, fn=lambda n, i, o: seen.append(n)) as acts,
    ):
        net(x)
        raise RuntimeError("boom")
    assert seen == ["first"] and not acts.inputs
    assert all(not m._forward_hooks for m in net.modules())


def test_outlier_metrics_stream_equals_direct():
    torch.manual_seed(0)
    model = LM(model_config("nano", vocab_size=64, seq_len=16))
    batches = [torch.randint(0, 64, (2, 16)) for _ in range(3)]
    rows = outlier_metrics(model, batches)
    linears = linear_layers(model)
    subs = model.sublayers()
    assert [r.kind for r in rows] == ["linear"] * len(linears) + ["residual"] * len(subs)
    with capture(model, linears) as acts_in, capture(model, subs, outputs=True) as acts_out:
        for b in batches:
            model(b)
    for r in rows:
        x = torch.cat(acts_in.inputs[r.name] if r.kind == "linear" else acts_out.outputs[r.name])
        assert r.tokens == 3 * 2 * 16 and r.channels == x.shape[-1]
        assert r.kurtosis == pytest.approx(kurtosis(x), rel=1e-7)
        assert r.kurt_rms == pytest.approx(kurt_rms(x), rel=1e-7)
        assert r.mmr_mean == pytest.approx(mmr(x, "mean"), rel=1e-6)
        assert r.mmr == pytest.approx(mmr(x, "median"), rel=1e-6, nan_ok=True)
        # the authors' write_heat: features averaged over the sequences, then max/median per position
        feats = x.double().reshape(3 * 2, 16, -1).mean(dim=0).abs().numpy()
        ratio = feats.max(axis=1) / np.median(feats, axis=1)
        assert r.mmr_batchavg == pytest.approx(ratio[np.isfinite(ratio)].mean(), rel=1e-6, nan_ok=True)
        if r.kind == "residual":
            assert r.mmr_batchavg != pytest.approx(r.mmr, rel=1e-3)  # two aggregations, two numbers
    down = next(r for r in rows if r.name.endswith("down_proj"))
    assert down.mmr_skipped > 0.05  # ReLU² zeros make the median vanish for many tokens
    assert all(r.mmr_skipped == 0 for r in rows if not r.name.endswith("down_proj"))


def test_aggregate():
    torch.manual_seed(0)
    model = LM(model_config("nano", vocab_size=64, seq_len=16))
    rows = outlier_metrics(model, [torch.randint(0, 64, (2, 16))])
    agg = aggregate(rows)
    lin = np.array([r.kurtosis for r in rows if r.kind == "linear"])
    assert agg["linear.kurtosis.mean"] == pytest.approx(lin.mean())
    assert agg["linear.kurtosis.max"] == pytest.approx(lin.max())
    res = np.array([r.mmr for r in rows if r.kind == "residual"])
    assert agg["mmr"] == agg["residual.mmr.mean"] == pytest.approx(res.mean())
    assert agg["residual.mmr.max"] == pytest.approx(res.max())
    # a NaN layer (every token with a zero median) is ignored, not propagated
    rows = [*rows, replace(rows[0], mmr=math.nan, mmr_skipped=1.0)]
    lin_mmr = np.array([r.mmr for r in rows if r.kind == "linear" and not math.isnan(r.mmr)])
    assert aggregate(rows)["linear.mmr.mean"] == pytest.approx(lin_mmr.mean())

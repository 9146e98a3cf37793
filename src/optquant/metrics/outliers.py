"""Outlier metrics of activations: MMR, excess kurtosis and kurtRMS (paper.md §6).

For an activation matrix X ∈ ℝ^{T×d} (tokens × channels):
- MMR(X) = (1/T) Σ_t max_j |X_tj| / median_j |X_tj| over every token of every sequence: the per-token
  definition of paper.md §6.1 (`mmr`); `center="mean"` gives the abstract's max-to-mean variant
  (`mmr_mean`).
- MMR batch-averaged (`mmr_batchavg`): the authors' code (`write_heat`) first averages the activations
  over the sequences of the batch, position by position, then takes the same per-position ratio of the
  averaged (T×d) features and its mean over positions. Averaging over sequences cancels token-specific
  spikes and keeps only outlier channels that are systematic, so it is lower than `mmr` in general.
- kurtosis(X) = Fisher (excess) kurtosis of all entries, m4/m2² − 3 with biased moments
  (`scipy.stats.kurtosis` defaults).
- kurtRMS(X) = excess kurtosis of the d per-channel RMS values sqrt(mean_t X_tj²) (He et al. 2024,
  arXiv 2405.19279).

`outlier_metrics(model, batches)` measures them on the input of every quantized linear layer (the
tensors W4A4 rounds) and on the residual stream after every residual sublayer, streaming over the
batches with exact merges (moments are merged with Pébay's pairwise formulas in fp64), so memory does
not grow with the calibration set.

Decisions where the paper is silent (paper.md §13): the median is the usual one (mean of the two middle
values, as numpy), not torch's lower median; tokens whose median |x| is exactly zero have an undefined
ratio and are left out of the MMR mean, and each row reports the fraction left out. That happens at the
ReLU² down_proj input, where most entries are exactly 0: in a briefly trained nano model 16 % of the
tokens of one such layer and all tokens of the other, and the kept tokens give ratios in the thousands.
So the headline numbers of `aggregate` (`mmr`, `kurtosis`, …) are the mean over the residual-stream
states, as in the authors' code (block outputs); means and maxima over the linear-layer inputs are
returned beside them (`linear.<metric>.mean|max`).
Left out on purpose: attention-score and KV statistics (those tensors are not quantized here).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from optquant.device import resident
from optquant.evaluate import eval_mode, token_ids
from optquant.metrics.capture import capture
from optquant.quant.layers import linear_layers

Center = Literal["median", "mean"]
OUTLIER_METRICS = ("mmr", "mmr_batchavg", "mmr_mean", "kurtosis", "kurt_rms")


def _tokens(x: Tensor) -> Tensor:
    """(…, d) -> (N, d): every leading axis is a token axis."""
    return x.reshape(-1, x.shape[-1])


def median_abs(x: Tensor) -> Tensor:
    """Per-row median of |x| with numpy's convention (mean of the two middle values)."""
    s = _tokens(x).abs().sort(dim=-1).values
    d = s.shape[-1]
    return 0.5 * (s[:, (d - 1) // 2] + s[:, d // 2])


def mmr_per_token(x: Tensor, center: Center = "median") -> Tensor:
    """max_j |x_tj| / center_j |x_tj| per token (fp32); inf/nan where the center is 0."""
    a = _tokens(x).float().abs()
    denom = median_abs(a) if center == "median" else a.mean(dim=-1)
    return a.max(dim=-1).values / denom


def mmr(x: Tensor, center: Center = "median") -> float:
    """Mean over tokens of the per-token max-to-center ratio; tokens with a zero center are skipped."""
    r = mmr_per_token(x, center).double()
    r = r[torch.isfinite(r)]
    return r.mean().item() if r.numel() else math.nan


def kurtosis(x: Tensor) -> float:
    """Fisher excess kurtosis of all entries (biased moments, as scipy.stats.kurtosis)."""
    return Moments.of(x).excess_kurtosis


def kurt_rms(x: Tensor) -> float:
    """Excess kurtosis of the per-channel RMS over tokens."""
    t = _tokens(x).double()
    return kurtosis(t.square().mean(dim=0).sqrt())


@dataclass(frozen=True)
class Moments:
    """Count, mean and central sums M2..M4 of a set of numbers; merges exactly (Pébay 2008)."""

    n: int = 0
    mean: float = 0.0
    M2: float = 0.0
    M3: float = 0.0
    M4: float = 0.0

    @staticmethod
    def of(x: Tensor) -> Moments:
        v = x.detach().reshape(-1).double()
        if v.numel() == 0:
            return Moments()
        m = v.mean()
        d = v - m
        d2 = d * d
        return Moments(v.numel(), m.item(), d2.sum().item(), (d2 * d).sum().item(), (d2 * d2).sum().item())

    def merge(self, o: Moments) -> Moments:
        if self.n == 0:
            return o
        if o.n == 0:
            return self
        na, nb = float(self.n), float(o.n)
        n = na + nb
        delta = o.mean - self.mean
        M2 = self.M2 + o.M2 + delta**2 * na * nb / n
        M3 = (
            self.M3
            + o.M3
            + delta**3 * na * nb * (na - nb) / n**2
            + 3 * delta * (na * o.M2 - nb * self.M2) / n
        )
        M4 = (
            self.M4
            + o.M4
            + delta**4 * na * nb * (na * na - na * nb + nb * nb) / n**3
            + 6 * delta**2 * (na * na * o.M2 + nb * nb * self.M2) / n**2
            + 4 * delta * (na * o.M3 - nb * self.M3) / n
        )
        return Moments(self.n + o.n, self.mean + delta * nb / n, M2, M3, M4)

    @property
    def excess_kurtosis(self) -> float:
        if self.n == 0 or self.M2 == 0:
            return math.nan
        return self.n * self.M4 / self.M2**2 - 3.0


@dataclass(frozen=True)
class OutlierRow:
    """Outlier metrics of one tensor site over the calibration batches."""

    name: str
    kind: Literal["linear", "residual"]  # input of a quantized linear layer | residual-stream state
    index: int  # forward order within its kind
    mmr: float  # max-to-median per token, mean over tokens (paper.md §6.1)
    mmr_batchavg: float  # max-to-median of the features averaged over sequences (the authors' write_heat)
    mmr_mean: float  # max-to-mean per token
    mmr_skipped: float  # fraction of tokens with median |x| = 0, left out of `mmr`
    kurtosis: float
    kurt_rms: float
    tokens: int
    channels: int


class _Stream:
    """Running sums for one site, fed one activation tensor at a time."""

    def __init__(self) -> None:
        self.ratio_sum = {"median": 0.0, "mean": 0.0}
        self.ratio_n = {"median": 0, "mean": 0}
        self.tokens = 0
        self.moments = Moments()
        self.sq_sum: Tensor | None = None  # per channel, fp64
        self.seq_sum: Tensor | None = None  # (T, d) sum over sequences, for the batch-averaged MMR
        self.sequences = 0

    def add(self, x: Tensor) -> None:
        if x.dim() == 3:  # (B, T, d); calibration batches share T
            s = x.detach().double().sum(dim=0)
            self.seq_sum = s if self.seq_sum is None else self.seq_sum + s
            self.sequences += x.shape[0]
        t = _tokens(x.detach())
        for center in ("median", "mean"):
            r = mmr_per_token(t, center).double()
            r = r[torch.isfinite(r)]
            self.ratio_sum[center] += r.sum().item()
            self.ratio_n[center] += r.numel()
        self.tokens += t.shape[0]
        self.moments = self.moments.merge(Moments.of(t))
        sq = t.double().square().sum(dim=0)
        self.sq_sum = sq if self.sq_sum is None else self.sq_sum + sq

    def row(self, name: str, kind: str, index: int) -> OutlierRow:
        def mean_ratio(center: str) -> float:
            n = self.ratio_n[center]
            return self.ratio_sum[center] / n if n else math.nan

        channels = 0 if self.sq_sum is None else self.sq_sum.numel()
        krms = math.nan if self.sq_sum is None else kurtosis((self.sq_sum / self.tokens).sqrt())
        skipped = 1.0 - self.ratio_n["median"] / self.tokens if self.tokens else math.nan
        batchavg = math.nan if self.seq_sum is None else mmr(self.seq_sum / self.sequences)
        return OutlierRow(name, kind, index, mean_ratio("median"), batchavg, mean_ratio("mean"), skipped,
                          self.moments.excess_kurtosis, krms, self.tokens, channels)  # fmt: skip


@torch.no_grad()
def outlier_metrics(
    model: nn.Module,
    batches: Iterable,
    *,
    skip: tuple[str, ...] = ("lm_head",),
    residual: bool = True,
) -> list[OutlierRow]:
    """MMR, kurtosis and kurtRMS at every quantized-linear input and (optionally) every residual state.

    `batches` yields token ids (B, T) or (x, y) pairs; the model runs as it is (dtype, autocast are the
    caller's). `skip` is passed to `linear_layers` and should match the PTQ config (lm_head unless
    `quantize_head`). Linear rows come first, then residual rows, each in forward order.
    """
    names = {id(m): n for n, m in model.named_modules()}
    kinds = {"linear": linear_layers(model, skip=skip),
             "residual": [(names[id(sub)], sub) for sub in model.sublayers()] if residual else []}
    sites = {f"{kind}:{name}": (kind, i, name, m)  # i: the forward order within its kind
             for kind, layers in kinds.items() for i, (name, m) in enumerate(layers)}
    streams = {key: _Stream() for key in sites}

    def on_forward(key: str, x: Tensor, y: Tensor | None) -> None:
        streams[key].add(y if key.startswith("residual:") else x)

    hooked = {key: m for key, (*_, m) in sites.items()}
    # a chain model is walked module by module over all batches (each lazily loaded module read once), and
    # its head run only when a site is in it: the (tokens × vocabulary) logits are otherwise not needed
    in_head = any(name.split(".")[0] in ("norm", "lm_head") for _, _, name, _ in sites.values())
    chain = all(hasattr(model, a) for a in ("embed", "sublayers", "head"))
    with eval_mode(model), capture(model, hooked, outputs=residual, fn=on_forward):
        device = next(model.parameters()).device
        ids = [token_ids(batch).to(device) for batch in batches]
        if not chain:
            for idx in ids:
                model(idx)
        else:
            hs = [model.embed(idx) for idx in ids]
            for sub in model.sublayers():
                with resident(sub, device):
                    hs = [sub(h) for h in hs]
            for h in hs if in_head else ():
                model.head(h)
    return [streams[key].row(name, kind, i) for key, (kind, i, name, _) in sites.items()]


def aggregate(rows: Iterable[OutlierRow]) -> dict[str, float]:
    """Model-level numbers: `{kind}.{metric}.{mean|max}` over layers (NaNs ignored), plus the
    headline `mmr`, `mmr_mean`, `kurtosis`, `kurt_rms` = the mean over residual-stream states (see the
    module docstring for why not the linear inputs)."""
    rows = list(rows)
    out: dict[str, float] = {}
    for kind in ("linear", "residual"):
        for metric in OUTLIER_METRICS:
            vals = np.array([getattr(r, metric) for r in rows if r.kind == kind], dtype=np.float64)
            finite = vals[np.isfinite(vals)]
            out[f"{kind}.{metric}.mean"] = float(finite.mean()) if finite.size else math.nan
            out[f"{kind}.{metric}.max"] = float(finite.max()) if finite.size else math.nan
    for metric in OUTLIER_METRICS:
        out[metric] = out[f"residual.{metric}.mean"]
    return out

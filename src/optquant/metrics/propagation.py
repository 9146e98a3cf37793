"""The ABC decomposition of quantization error propagation, R_L, and linear-layer gains (paper.md §7).

The network is walked as a chain h_ℓ = f_ℓ(h_{ℓ−1}) next to its quantized copy h^q_ℓ = f^q_ℓ(h^q_{ℓ−1}),
both starting from their embeddings of the same tokens. At each module the four evaluations f(h),
f(h^q), f^q(h), f^q(h^q) give the Shapley split of Δh_ℓ = h^q_ℓ − h_ℓ = a_ℓ + b_ℓ (§7.2):
    a = ½[(f^q(h^q) − f^q(h)) + (f(h^q) − f(h))]   propagated error (input change)
    b = ½[(f^q(h^q) − f(h^q)) + (f^q(h) − f(h))]   local error (function change)
and R = ‖Δh‖²/‖h_ℓ‖² = A + B + C with A = ‖a‖²/‖h_ℓ‖², B = ‖b‖²/‖h_ℓ‖², C = 2⟨a,b⟩/‖h_ℓ‖² (§7.3).
The gain is G = A / R_in, R_in being the same relative error measured on the module's input.

Module granularity (paper.md §13 leaves it open): the chain is the residual sublayers of
`model.sublayers()` (attention with its norm and residual add, then MLP likewise), followed by one final
module, `final="logits"` (final norm + LM head, the default) or `"norm"` (final RMSNorm only) or `"none"`.
R_L is measured on the logits by default: they are what the accuracy depends on, and unlike a hidden
state they do not change when a rotation fuses the final norm into the head, so R_L compares plainly
across FP/rotated models. `granularity="linear"` adds nested rows for every quantized linear layer
inside the chain modules (f = the linear, h = its input in each chain), captured by hooks during the
module's evaluations; these also give the linear's f(h^q) and f^q(h) when it reads the module's own
input (q/k/v, up), so only o and down are evaluated again.

Cost: a module's four evaluations are two calls, f and f^q on h and h^q stacked; f^q is not called
when it computes f, nor h^q passed when it equals h (the first module), nor an unquantized head at all (its
rows come from d-wide products, metrics/chain.py). Linear rows add ‖MΔH‖² (below) per batch, as ⟨ΔHᵀΔH, MᵀM⟩
when in ≤ out (q/k/v share ΔHᵀΔH), and two spectral norms per layer; ‖WH‖² is the linear's own ‖f(h)‖².
Memory: the walk goes module by module over all batches, holding the two streams of every batch and one
module's sums; `propagation_of` holds the FP model once and one quantized sublayer at a time (chain.py).
Precision: evaluations run in the model's dtype, the bookkeeping (a, b, ΔH, Gram matrices, spectral norms)
too or in fp32 for a 16-bit model (`rows2d`), with sums over rows and batches in fp64: a difference of two
outputs is rounded relative to itself, so an fp32 model's terms agree with fp64 arithmetic to ~1e-7 (G1, G2
~3e-7, through fp32 eigenvalues); an fp64 model gives the fp64 numbers.

Norms: `token` (default) takes each ratio per token vector and averages over tokens ([3P]); `tensor`
takes one Frobenius norm over all tokens. Both are always computed (rows carry `norm`); A+B+C = R holds
exactly in both. Gain split (§7.5) for a bias-free linear with M = W + ½ε^W, ε^W = W^q − W, and input
H (FP chain), ΔH = H^q − H, in the tensor norm:
    G1 = (‖M‖₂/‖W‖₂)²,  G2 = (cos φ / cos ψ)²,  cos φ = ‖MΔH‖_F/(‖M‖₂‖ΔH‖_F), cos ψ = ‖WH‖_F/(‖W‖₂‖H‖_F)
so G1·G2 = G_lin := (‖MΔH‖²/‖ΔH‖²)/(‖WH‖²/‖H‖²) identically. G_lin equals the measured tensor-norm gain
G = A/R_in exactly when f^q(x) = (W+ε^W)x + ε^h with ε^h independent of x (then a = MΔH); with real
per-token activation rounding ε^h depends on x and G − G_lin is that term's share. The per-token norm
has no such identity, so G1, G2, G_lin are given on tensor-norm rows only.

Rotated models: pass the rotated FP model as `fp` and its quantized copy as `q`; never compare across
bases. Left out on purpose: splitting attention into its internal modules (q/k/v projections are
linear rows; softmax and RoPE stay inside the sublayer, as in the paper's MHSA-as-one-unit view).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.evaluate import eval_mode, token_ids
from optquant.metrics.capture import capture
from optquant.metrics.chain import Link, model_links, quantized_links
from optquant.metrics.gains import (
    gain_terms,
    gram,
    ratio,
    rows2d,
    spectral_norm,
    sym_inner,
    syrk,
    top_singular,
)
from optquant.quant.ptq import PTQConfig, quantize_
from optquant.quant.rotate import rotate_model_

Norm = Literal["token", "tensor"]
TERMS = {"R": ("d", "y"), "A": ("a", "y"), "B": ("b", "y"), "C": ("ab", "y"), "R_in": ("din", "hin")}  # term: its sums


@dataclass(frozen=True)
class PropagationConfig:
    """Which chain to walk and how to report it (see the module docstring for the choices)."""

    granularity: Literal["sublayer", "linear"] = "sublayer"
    final: Literal["logits", "norm", "none"] = "logits"  # where R_L is measured
    norm: Norm = "token"  # the norm the summary reports
    skip: tuple[str, ...] = ("lm_head",)  # linear layers not quantized (as in the PTQ config)


@dataclass(frozen=True)
class ABCRow:
    """One module's terms in one norm; `propagation` returns a token row and a tensor row per module."""

    index: int  # ℓ in the chain (1-based); linear rows carry their chain module's ℓ
    name: str
    kind: Literal["sublayer", "final", "linear"]
    norm: Norm
    R: float
    A: float
    B: float
    C: float
    R_in: float  # relative error of the module's input, same norm
    G: float  # A / R_in (nan when R_in = 0)
    G1: float = math.nan  # linear rows, tensor norm: spectral ratio
    G2: float = math.nan  # alignment ratio
    G_lin: float = math.nan  # G1·G2 = gain of the linear part (W + ½ε^W)ΔH


@dataclass(frozen=True)
class ABCSummary:
    """Model-level numbers for the correlation study; G1 and G2 come from the tensor-norm rows."""

    norm: Norm
    R_L: float  # R at the last chain module
    sum_A: float  # sums over chain modules (linear rows are nested, not summed)
    sum_B: float
    sum_C: float
    mean_gain: float  # mean finite G over chain modules
    mean_gain_linear: float  # mean finite G over linear rows
    mean_G1: float
    mean_G2: float


def _sq(x: Tensor) -> Tensor:
    """Per-row squared norm of a 2-D tensor, as fp64 for the sums over rows."""
    return torch.linalg.vector_norm(x, dim=-1).double().square()


def output_rows(ys: tuple[Tensor, Tensor, Tensor, Tensor]) -> dict[str, Tensor]:
    """Per-row ‖y‖², ‖a‖², ‖b‖², 2⟨a,b⟩ and ‖Δy‖² = ‖a + b‖² (fp64) from f(h), f(h^q), f^q(h), f^q(h^q).

    With u = qq − ff (= Δy) and v = fq − qf, the Shapley terms (§7.2) are a = ½(u + v) and b = ½(u − v), formed
    in the outputs' dtype (an fp32 pass moves half the bytes of an fp64 one; its precision: module docstring).
    ‖Δy‖² is summed as ‖a‖² + ‖b‖² + 2⟨a,b⟩, so R = A + B + C to fp64 rounding."""
    ff, fq, qf, qq = (rows2d(y) for y in ys)
    u = qq - ff
    if qf is ff and qq is fq:  # f^q = f (e.g. an unquantized head): v = u, a = Δy, b = 0
        a = _sq(u)
        b = ab = torch.zeros_like(a)
    else:
        v = fq - qf
        a2, b2 = u + v, u - v  # 2a, 2b
        a, b, ab = 0.25 * _sq(a2), 0.25 * _sq(b2), 0.5 * torch.linalg.vecdot(a2, b2).double()
    return {"d": a + b + ab, "y": _sq(ff), "a": a, "b": b, "ab": ab}


def _view(x: Tensor) -> tuple:
    """What identifies a tensor's data: two tensors with equal keys hold the same values."""
    return x.data_ptr(), x.shape, x.stride(), x.dtype


class _Input:
    """A module's input in the two chains, x and x^q, as rows: ΔH = x^q − x, the row norms
    (‖x‖², ‖ΔH‖²) and, on demand, ΔHᵀΔH (fp64)."""

    def __init__(self, x: Tensor, xq: Tensor) -> None:
        H = rows2d(x)
        self.dH = rows2d(xq) - H
        self.rows = (_sq(H), _sq(self.dH))

    @cached_property
    def gram(self) -> np.ndarray:
        return syrk(self.dH).astype(np.float64)


class _Sums:
    """Streaming sums of the ABC terms of one module over batches, in both norms; for a linear layer
    with weights W, W^q of one shape also those of the gain split (§7.5), with M = ½(W + W^q)."""

    def __init__(self, W: Tensor | None = None, Wq: Tensor | None = None) -> None:
        self.tok = dict.fromkeys(TERMS, 0.0)
        self.ten = dict.fromkeys(("d", "a", "b", "ab", "y", "din", "hin"), 0.0)
        self.n = 0
        self.W, self.M = W, 0.5 * (rows2d(W) + rows2d(Wq)) if W is not None and W.shape == Wq.shape else None
        # ‖MΔH‖² summed directly, or ΣΔHᵀΔH for ⟨ΔHᵀΔH, MᵀM⟩ at the end (`add_gain`); ‖WH‖², ‖H‖², ‖ΔH‖²
        # are the sums y, hin, din
        self.MdH, self.dHdH = 0.0, None

    def add_rows(self, inp: tuple[Tensor, Tensor], out: dict[str, Tensor]) -> None:
        """Add per-row squared norms: `inp` = (‖h‖², ‖h^q − h‖²), `out` from `output_rows`."""
        sq = {**out, "hin": inp[0], "din": inp[1]}
        for k, v in sq.items():
            self.ten[k] += v.sum().item()
        for term, (num, den) in TERMS.items():
            self.tok[term] += (sq[num] / sq[den]).sum().item()
        self.n += sq["y"].shape[0]

    def add_gain(self, x: _Input) -> None:
        """Add ‖MΔH‖² of one batch. With in ≤ out it is ⟨ΔHᵀΔH, MᵀM⟩: ΔHᵀΔH costs N·in² instead of
        N·in·out, q/k/v share it, and MᵀM is the Gram `spectral_norm` needs anyway."""
        if self.M is None:
            return
        if self.M.shape[1] <= self.M.shape[0]:
            self.dHdH = x.gram if self.dHdH is None else self.dHdH + x.gram
        else:
            self.MdH += _sq(x.dH @ self.M.T).sum().item()  # the model's dtype, as the rows

    def gains(self) -> tuple[float, float, float]:
        """(G1, G2, G_lin) of a linear layer, nan for other modules."""
        if self.M is None:
            return (math.nan,) * 3
        gram_M = gram(self.M)  # MᵀM whenever dHdH was accumulated
        MdH = self.MdH if self.dHdH is None else self.MdH + sym_inner(self.dHdH, gram_M.astype(np.float64))
        t = self.ten
        return gain_terms(spectral_norm(self.W), top_singular(gram_M), MdH, t["din"], t["y"], t["hin"])

    def terms(self, norm: Norm) -> dict[str, float]:
        t = ({k: v / self.n for k, v in self.tok.items()} if norm == "token" else
             {k: self.ten[num] / self.ten[den] for k, (num, den) in TERMS.items()})
        return t | {"G": ratio(t["A"], t["R_in"])}


def abc_terms(f: Callable, fq: Callable, h: Tensor, hq: Tensor, norm: Norm = "token") -> dict[str, float]:
    """R, A, B, C, R_in and G = A/R_in of one module f (FP) / fq (quantized) on inputs h, hq."""
    s = _Sums()
    s.add_rows(_Input(h, hq).rows, output_rows((f(h), f(hq), fq(h), fq(hq))))
    return s.terms(norm)


def _halves(x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The two halves of a stacked call's tensor; twice the tensor itself when the call was not stacked."""
    return (x, x) if x.shape[0] == n else (x[:n], x[n:])


def _step_link(link: Link, h: Tensor, hq: Tensor, sums: dict[str, _Sums],
               inp: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """The four evaluations of one chain module (plus its linears), as two batched calls; returns the
    next (h, h^q) and their per-row input norms (this module's output norms: nothing is recomputed)."""
    if link.readout is not None:
        return None, None, _readout_rows(link.readout, h, hq, sums[link.name], inp)
    fp_lin, q_lin = link.fp_lin, link.q_lin
    B = h.shape[0]
    # h and h^q stacked along the batch (every module acts on each sequence alone); h alone when they are
    # equal (the first module: both chains start from the same embedding)
    hh = h if torch.equal(h, hq) else torch.cat((h, hq))
    with capture(None, fp_lin, outputs=True) as acts_f:
        y_ff, y_fq = _halves(link.f(hh), B)
    if link.same:
        (y_qf, y_qq), acts_q = (y_ff, y_fq), acts_f
    else:
        with capture(None, q_lin, outputs=True) as acts_q:
            y_qf, y_qq = _halves(link.fq(hh), B)
    out = output_rows((y_ff, y_fq, y_qf, y_qq))
    sums[link.name].add_rows(inp, out)
    inputs: dict[tuple, _Input] = {}  # one per distinct (x, x^q): q/k/v share one
    for n in link.linears:
        calls = zip(acts_f.inputs[n], acts_f.outputs[n], acts_q.inputs[n], acts_q.outputs[n], strict=True)
        for xf, of, xq_, oq in calls:
            (x, x_in_fhq), (lin_ff, lin_fq) = _halves(xf, B), _halves(of, B)
            (x_in_qh, xq), (lin_qf, lin_qq) = _halves(xq_, B), _halves(oq, B)
            # the cross evaluations f_lin(x^q), f^q_lin(x) came for free when the linear saw the same
            # input inside f(h^q) / f^q(h) (e.g. q/k/v and the MLP's up projection read h directly)
            if not torch.equal(x_in_fhq, xq):
                lin_fq = fp_lin[n](xq)
            if not torch.equal(x_in_qh, x):
                lin_qf = q_lin[n](x)
            key = (_view(x), _view(xq))
            xs = inputs[key] = inputs.get(key) or _Input(x, xq)
            sums[n].add_rows(xs.rows, output_rows((lin_ff, lin_fq, lin_qf, lin_qq)))
            sums[n].add_gain(xs)
    return y_ff, y_qq, (out["y"], out["d"])


def _readout_rows(readout: tuple[nn.Module, Tensor], h: Tensor, hq: Tensor, sums: _Sums,
                  inp: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The head's rows when it is the same in both models, y = W·norm(x) with a bias-free W = QR: then
    a = Δy and b = 0, and ‖W x‖ = ‖R x‖ gives ‖y‖² and ‖Δy‖² from d × d products, without evaluating
    the V-wide logits (in fp64 from norm's outputs; an fp32 model's logits would carry fp32 rounding)."""
    norm, R = readout
    n, nq = rows2d(norm(h)), rows2d(norm(hq))
    y, d = _sq(n @ R.T), _sq((nq - n) @ R.T)
    zero = torch.zeros_like(y)
    sums.add_rows(inp, {"d": d, "y": y, "a": d, "b": zero, "ab": zero})
    return y, d


def _link_rows(idx: int, link: Link, sums: dict[str, _Sums]) -> list[ABCRow]:
    rows: list[ABCRow] = []
    for name, kind in [*((n, "linear") for n in link.linears), (link.name, link.kind)]:
        split = dict(zip(("G1", "G2", "G_lin"), sums[name].gains(), strict=True))
        for norm in ("token", "tensor"):
            rows.append(ABCRow(idx, name, kind, norm, **sums[name].terms(norm), **(split if norm == "tensor" else {})))
    return rows


def ptq_pair(model: nn.Module, cfg: PTQConfig, calib=None) -> tuple[nn.Module, nn.Module]:
    """(FP reference, quantized copy) of `model` under a PTQConfig, in one basis: with a rotation the
    reference is the rotated FP model and the quantized copy is made from that very model."""
    fp = copy.deepcopy(model)
    if cfg.rotation != "none":
        rotate_model_(fp)
    return fp, quantize_(copy.deepcopy(fp), replace(cfg, rotation="none"), calib)


@torch.no_grad()
def propagation(
    fp: nn.Module, q: nn.Module, batches: Iterable, cfg: PropagationConfig = PropagationConfig()
) -> tuple[list[ABCRow], ABCSummary]:
    """ABC rows (both norms; linear rows before their chain module) and the summary in `cfg.norm`.

    `fp` is the FP reference (the rotated FP model when the PTQ rotates) and `q` its quantized copy;
    `batches` yields token ids (B, T) or (x, y) pairs. Cost: four evaluations per chain module, run as
    two calls on the stacked inputs; a module's output norms are its successor's input norms.
    """
    with eval_mode(fp, q):
        return _walk(fp, q.embed, model_links(fp, q, cfg), batches, cfg.norm)


@torch.no_grad()
def propagation_of(model: nn.Module, qcfg: PTQConfig, batches: Iterable, cfg: PropagationConfig = PropagationConfig(),
                   calib=None, in_place: bool = False) -> tuple[list[ABCRow], ABCSummary]:
    """`propagation(*ptq_pair(model, qcfg, calib), batches, cfg)` holding the FP model once: the quantized
    sublayers are made one at a time as the walk reaches them (metrics/chain.py). With a rotation the
    rotated FP model is made first, in a copy (`in_place`: the model itself is rotated)."""
    if qcfg.rotation != "none":
        model = rotate_model_(model if in_place else copy.deepcopy(model))
        qcfg = replace(qcfg, rotation="none")
    with eval_mode(model):
        return _walk(model, model.embed, quantized_links(model, qcfg, cfg, calib), batches, cfg.norm)


def _walk(fp: nn.Module, q_embed, links: Iterable[Link], batches: Iterable, norm: Norm):
    """The chain, module by module over every batch (so each module is needed once): the FP and quantized
    streams of all batches are held, the terms summed per module, its rows made as it is left."""
    device = next(fp.parameters()).device
    ids = [token_ids(b).to(device) for b in batches]
    streams = [(fp.embed(i), q_embed(i)) for i in ids]
    inps = [_Input(h, hq).rows for h, hq in streams]
    rows: list[ABCRow] = []
    for idx, link in enumerate(links, start=1):
        sums = {link.name: _Sums()} | {n: _Sums(link.fp_lin[n].weight, link.q_lin[n].weight) for n in link.linears}
        for i, (h, hq) in enumerate(streams):
            *streams[i], inps[i] = _step_link(link, h, hq, sums, inps[i])
        rows += _link_rows(idx, link, sums)
    return rows, summarize(rows, norm)


def _finite_mean(vals: list[float]) -> float:
    v = np.asarray(vals, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


def summarize(rows: Iterable[ABCRow], norm: Norm = "token") -> ABCSummary:
    """Summary in `norm`; G1 and G2 are always the tensor-norm means (the only norm they exist in)."""
    rows = list(rows)
    chain = [r for r in rows if r.norm == norm and r.kind != "linear"]
    lin = [r for r in rows if r.norm == norm and r.kind == "linear"]
    tensor_lin = [r for r in rows if r.norm == "tensor" and r.kind == "linear"]
    if not chain:
        raise OptquantError(f"summarize: no chain rows (kind sublayer/final) with norm {norm!r}")
    return ABCSummary(
        norm=norm,
        R_L=chain[-1].R,
        sum_A=sum(r.A for r in chain),
        sum_B=sum(r.B for r in chain),
        sum_C=sum(r.C for r in chain),
        mean_gain=_finite_mean([r.G for r in chain]),
        mean_gain_linear=_finite_mean([r.G for r in lin]),
        mean_G1=_finite_mean([r.G1 for r in tensor_lin]),
        mean_G2=_finite_mean([r.G2 for r in tensor_lin]),
    )

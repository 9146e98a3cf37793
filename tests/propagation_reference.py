"""The ABC implementation before its speed-up (commit 28d7dc3; imports as on main), kept verbatim as the
reference the fast one must match to 1e-12 in fp64 (tests/test_propagation.py). Not used by the package.

The ABC decomposition of quantization error propagation, R_L, and linear-layer gains (paper.md §7).

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
inside the chain modules (f = the linear, h = its input in each chain; captured by hooks during f(h)
and f^q(h^q), so only two extra linear evaluations are needed).

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
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.metrics.capture import capture
from optquant.quant.layers import linear_layers
from optquant.quant.ptq import PTQConfig, quantize_
from optquant.quant.rotate import rotate_model_

Norm = Literal["token", "tensor"]
TERMS = ("R", "A", "B", "C", "R_in")


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


def shapley_split(y_ff: Tensor, y_fq: Tensor, y_qf: Tensor, y_qq: Tensor) -> tuple[Tensor, Tensor]:
    """(a, b) in fp64 from f(h), f(h^q), f^q(h), f^q(h^q); a + b = f^q(h^q) − f(h)."""
    ff, fq, qf, qq = (y.double() for y in (y_ff, y_fq, y_qf, y_qq))
    return 0.5 * ((qq - qf) + (fq - ff)), 0.5 * ((qq - fq) + (qf - ff))


def four_evals(f: Callable, fq: Callable, h: Tensor, hq: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return f(h), f(hq), fq(h), fq(hq)


def _rows2d(x: Tensor) -> Tensor:
    return x.double().reshape(-1, x.shape[-1])


class _Sums:
    """Streaming sums of the ABC terms of one module over batches, in both norms."""

    def __init__(self) -> None:
        self.tok = dict.fromkeys(TERMS, 0.0)
        self.ten = dict.fromkeys(("d", "a", "b", "ab", "y", "din", "hin"), 0.0)
        self.n = 0
        self.lin = dict.fromkeys(("MdH", "dH", "WH", "H"), 0.0)

    def add(self, h: Tensor, hq: Tensor, ys: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
        a, b = shapley_split(*ys)
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        y, d = _rows2d(ys[0]), _rows2d(ys[3]) - _rows2d(ys[0])
        hin, din = _rows2d(h), _rows2d(hq) - _rows2d(h)
        sq = {
            "d": d.square().sum(-1), "a": a.square().sum(-1), "b": b.square().sum(-1),
            "ab": 2 * (a * b).sum(-1), "y": y.square().sum(-1),
            "din": din.square().sum(-1), "hin": hin.square().sum(-1),
        }  # fmt: skip
        for k, v in sq.items():
            self.ten[k] += v.sum().item()
        for term, num, den in (("R", "d", "y"), ("A", "a", "y"), ("B", "b", "y"), ("C", "ab", "y")):
            self.tok[term] += (sq[num] / sq[den]).sum().item()
        self.tok["R_in"] += (sq["din"] / sq["hin"]).sum().item()
        self.n += y.shape[0]

    def add_linear(self, W: Tensor, Wq: Tensor, h: Tensor, hq: Tensor) -> None:
        M = 0.5 * (W.double() + Wq.double())
        H, dH = _rows2d(h), _rows2d(hq) - _rows2d(h)
        self.lin["MdH"] += (dH @ M.T).square().sum().item()
        self.lin["dH"] += dH.square().sum().item()
        self.lin["WH"] += (H @ W.double().T).square().sum().item()
        self.lin["H"] += H.square().sum().item()

    def terms(self, norm: Norm) -> dict[str, float]:
        if norm == "token":
            return {k: v / self.n for k, v in self.tok.items()}
        t = self.ten
        return {"R": t["d"] / t["y"], "A": t["a"] / t["y"], "B": t["b"] / t["y"], "C": t["ab"] / t["y"],
                "R_in": t["din"] / t["hin"]}  # fmt: skip


def abc_terms(f: Callable, fq: Callable, h: Tensor, hq: Tensor, norm: Norm = "token") -> dict[str, float]:
    """R, A, B, C, R_in and G = A/R_in of one module f (FP) / fq (quantized) on inputs h, hq."""
    s = _Sums()
    s.add(h, hq, four_evals(f, fq, h, hq))
    t = s.terms(norm)
    return t | {"G": _div(t["A"], t["R_in"])}


def _div(x: float, y: float) -> float:
    return x / y if y > 0 else math.nan


def gain_terms(spec_W: float, spec_M: float, sq_MdH: float, sq_dH: float, sq_WH: float, sq_H: float):
    """(G1, G2, G_lin) from spectral norms ‖W‖₂, ‖M‖₂ and the squared Frobenius norms of §7.5."""
    G1 = (spec_M / spec_W) ** 2
    cos_phi = _div(math.sqrt(sq_MdH), spec_M * math.sqrt(sq_dH))
    cos_psi = _div(math.sqrt(sq_WH), spec_W * math.sqrt(sq_H))
    G2 = _div(cos_phi, cos_psi) ** 2
    G_lin = _div(_div(sq_MdH, sq_dH), _div(sq_WH, sq_H))
    return G1, G2, G_lin


def spectral_norm(W: Tensor) -> float:
    return torch.linalg.matrix_norm(W.detach().double(), ord=2).item()


def gain_split(W: Tensor, Wq: Tensor, h: Tensor, hq: Tensor) -> tuple[float, float, float]:
    """(G1, G2, G_lin) of a bias-free linear layer with weights W (FP) and Wq (quantized) on inputs
    h (FP chain) and hq (quantized chain), tensor norm."""
    s = _Sums()
    s.add_linear(W, Wq, h, hq)
    M = 0.5 * (W.double() + Wq.double())
    return gain_terms(spectral_norm(W), spectral_norm(M), *s.lin.values())


@dataclass
class _Link:
    name: str
    kind: str
    f: Callable[[Tensor], Tensor]
    fq: Callable[[Tensor], Tensor]
    linears: list[str]  # qualified names of the quantized linears inside this module


def _chain(fp: nn.Module, q: nn.Module, cfg: PropagationConfig) -> list[_Link]:
    for m, role in ((fp, "fp"), (q, "q")):
        if not all(hasattr(m, a) for a in ("embed", "sublayers", "head", "norm")):
            raise OptquantError(f"propagation: the {role} model lacks embed/sublayers/norm/head (an LM)")
    subs, subs_q = fp.sublayers(), q.sublayers()
    if len(subs) != len(subs_q):
        raise OptquantError(f"propagation: fp has {len(subs)} sublayers but q has {len(subs_q)}")
    names = {id(m): n for n, m in fp.named_modules()}
    links = [_Link(names[id(s)], "sublayer", s, sq, []) for s, sq in zip(subs, subs_q, strict=True)]
    if cfg.final == "logits":
        links.append(_Link("head", "final", fp.head, q.head, []))
    elif cfg.final == "norm":
        links.append(_Link("norm", "final", fp.norm, q.norm, []))
    elif cfg.final != "none":
        raise OptquantError(f"propagation: final must be logits|norm|none, got {cfg.final!r}")
    if cfg.granularity == "linear":
        prefixes = {"head": ("norm", "lm_head"), "norm": ("norm",)}
        for name, _ in linear_layers(fp, skip=cfg.skip):
            for link in links:
                if any(name == p or name.startswith(p + ".") for p in prefixes.get(link.name, (link.name,))):
                    link.linears.append(name)
                    break
    elif cfg.granularity != "sublayer":
        raise OptquantError(f"propagation: granularity must be sublayer|linear, got {cfg.granularity!r}")
    return links


def _step_link(fp, q, link: _Link, h: Tensor, hq: Tensor, sums: dict[str, _Sums]) -> tuple[Tensor, Tensor]:
    """The four evaluations of one chain module (plus its linears); returns the next (h, h^q)."""
    fp_lin = {n: fp.get_submodule(n) for n in link.linears}
    q_lin = {n: q.get_submodule(n) for n in link.linears}
    with capture(fp, fp_lin, outputs=True) as acts_f:
        y_ff = link.f(h)
    with capture(q, q_lin, outputs=True) as acts_q:
        y_qq = link.fq(hq)
    sums[link.name].add(h, hq, (y_ff, link.f(hq), link.fq(h), y_qq))
    for n in link.linears:
        calls = zip(acts_f.inputs[n], acts_f.outputs[n], acts_q.inputs[n], acts_q.outputs[n], strict=True)
        for x, lin_ff, xq, lin_qq in calls:
            s = sums[n]
            s.add(x, xq, (lin_ff, fp_lin[n](xq), q_lin[n](x), lin_qq))
            if fp_lin[n].weight.shape == q_lin[n].weight.shape:
                s.add_linear(fp_lin[n].weight, q_lin[n].weight, x, xq)
    return y_ff, y_qq


def _rows(links: list[_Link], sums: dict[str, _Sums], fp, q) -> list[ABCRow]:
    rows: list[ABCRow] = []
    for idx, link in enumerate(links, start=1):
        for n in link.linears:
            W, Wq = fp.get_submodule(n).weight, q.get_submodule(n).weight
            split = (math.nan,) * 3
            if W.shape == Wq.shape:
                spec = (spectral_norm(W), spectral_norm(0.5 * (W.double() + Wq.double())))
                split = gain_terms(*spec, *sums[n].lin.values())
            for norm in ("token", "tensor"):
                t = sums[n].terms(norm)
                extra = split if norm == "tensor" else ()
                rows.append(ABCRow(idx, n, "linear", norm, **t, G=_div(t["A"], t["R_in"]), **_g(extra)))
        for norm in ("token", "tensor"):
            t = sums[link.name].terms(norm)
            rows.append(ABCRow(idx, link.name, link.kind, norm, **t, G=_div(t["A"], t["R_in"])))
    return rows


def _g(split: tuple) -> dict[str, float]:
    return dict(zip(("G1", "G2", "G_lin"), split, strict=True)) if split else {}


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
    `batches` yields token ids (B, T) or (x, y) pairs. Cost: four evaluations per chain module.
    """
    links = _chain(fp, q, cfg)
    sums = {n: _Sums() for link in links for n in (*link.linears, link.name)}
    modes = fp.training, q.training
    fp.eval(), q.eval()
    try:
        device = next(fp.parameters()).device
        for batch in batches:
            idx = (batch[0] if isinstance(batch, tuple | list) else batch).to(device)
            h, hq = fp.embed(idx), q.embed(idx)
            for link in links:
                h, hq = _step_link(fp, q, link, h, hq, sums)
    finally:
        fp.train(modes[0]), q.train(modes[1])
    rows = _rows(links, sums, fp, q)
    return rows, summarize(rows, cfg.norm)


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

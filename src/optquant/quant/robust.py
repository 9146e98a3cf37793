"""Quantization-robust training with any optimizer: three methods, switched on by `robust.method`.

The paper (arXiv 2509.23500, paper.md §7) finds that PTQ damage follows how quantization error propagates
(the A_ℓ terms, the gains G_ℓ, summed up in R_L), and proposes R_L as a training-time regularizer or a
G_ℓ constraint as future work (§7.6). Each method acts only through the loss or on the weights after the
optimizer's step, so it works for the six optimizers and any plugin alike.

penalty (strength λ): loss = CE + λ·R_L on the step's batch, every `every`-th step, where
    R_L = mean over tokens of ‖z^q − z‖²/‖z‖²,  z = logits of the model,  z^q = those of its W4A4 RTN copy
is propagation.py's R at the logits (token norm) for PTQConfig()'s scheme: every linear but the LM head,
symmetric absmax, weights per output channel, activations per token. The copy shares the parameters;
rounding is straight-through (Bengio et al. 2013, arXiv 1308.3432): x̂ = x + (q(x) − x) with the
bracket held constant, so the gradient is the exact gradient of that frozen-noise surrogate (what the
finite-difference test checks), and it flows through both chains (R_L's full derivative). Penalising a
quantized copy's deviation is in the spirit of Alizadeh et al. 2020 (arXiv 2002.07520), who regularise
the loss's first-order change under quantization noise; λ·R_L itself is this project's choice. The
quantized chain stops at the final norm: with the head in FP, ‖W u‖² = uᵀ(WᵀW)u gives R_L from d-wide
states. Cost on a penalty step: one more forward and backward of the blocks (benchmarks/robust.py).

gain (strength τ ≥ 1), invented here. For a linear layer h ↦ Wh with error Δh, the paper's gain is
G_lin = (‖MΔH‖²/‖ΔH‖²)/(‖WH‖²/‖H‖²), M = W + ½ε^W (§7.5), so for *any* error direction
    G_lin ≤ G1 · Ĝ,   Ĝ := ‖W‖₂²·tr C / tr(W C Wᵀ),   C = HᵀH the layer's input second moment,
G1 = (‖M‖₂/‖W‖₂)² ≈ 1 (the paper's Fig. 4). Ĝ is the worst-case gain: the top singular value's gain over
the signal's mean gain. After the optimizer step (every `every`-th step) each linear but the LM head is
moved onto {Ĝ ≤ τ} by capping its singular values at c, W = U diag(min(s, c)) Vᵀ, with C from that
step's forward passes: with p_i = v_iᵀCv_i/tr C, Ĝ(c) = c²/Σ min(s_i, c)² p_i rises with c, and on the
segment where the top k values are capped it is c²/(c²P_k + S_k) (P_k = Σ_{i≤k} p_i, S_k = Σ_{i>k}
s_i²p_i), so c² = τ·S_k/(1 − τ·P_k) in closed form. Clipping singular values as a projection follows
Sedghi, Gupta & Long 2019 (arXiv 1805.10408); the data-dependent cap is ours. It is not the Euclidean
projection onto {Ĝ ≤ τ}, and C is the step's pre-update input (one step stale). τ below 1/Σp_i (a signal
partly outside W's row space) is unreachable: the spectrum is then made flat, the best there is. Cost:
one input Gram per distinct linear input during the forward, one SVD per linear after the step.

late-qat (strength f): QuEST W4A4 (qat.py; Panferov et al. 2025, arXiv 2502.05003) on every linear,
the head included, for the last round(f·steps) steps: at step s = steps − round(f·steps) `prepare_qat_`
swaps the layers in place, keeping their Parameters, so the optimizers and their state carry on. ParetoQ
(Liu et al. 2025, arXiv 2502.02631) finds most of the budget in FP and the last ~10 % in QAT close to
best. Evaluations after s measure the quantized model, as a QAT run's do. Cost: a QuEST step from s on.

ema, lawa and lawa-live: averaging.py, whose average is the only state a method keeps across steps (checkpointed beside
the raw weights); the others' decisions follow from the step number and the weights, so a resumed run is
bitwise the straight one with every method. Left out on purpose: the
penalty's Σ_ℓ A_ℓ variant (four evaluations per module instead of two forwards); penalty and gain under
torchrun (the penalty's forwards bypass DDP, the gain's Grams would need an all-reduce), and late QAT under
torch.compile or torchrun (it should work, as the Parameters stay, but no test runs it); combining methods.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.evaluate import hidden_states
from optquant.quant.averaging import WeightAverage
from optquant.quant.layers import linear_layers
from optquant.quant.qat import QATLinear, prepare_qat_, ste_quantize
from optquant.quant.qat_config import QATConfig
from optquant.quant.robust_config import AVERAGES, RobustConfig

Quantizer = Callable[[Tensor, int], Tensor]  # (x, bits) -> x̂ with a straight-through gradient


def _wide(x: Tensor) -> Tensor:
    """fp32 for 16-bit floats; fp32 and fp64 as they are."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _quant_linear(lin: nn.Linear, bits: int, quant: Quantizer, x: Tensor) -> Tensor:
    xf = _wide(x)
    with torch.autocast(x.device.type, enabled=False):  # quantizer arithmetic in fp32, as QATLinear
        return F.linear(quant(xf, bits), quant(lin.weight.to(xf.dtype), bits), lin.bias)


@contextmanager
def fake_quantized(model: nn.Module, bits: int, quant: Quantizer = ste_quantize) -> Iterator[nn.Module]:
    """Inside the block every linear of `model` but the LM head computes F.linear(q(x), q(W)): the
    model's W{bits}A{bits} RTN copy, on the same Parameters (an instance `forward`, removed on exit)."""
    layers = [m for _, m in linear_layers(model, skip=("lm_head",)) if type(m) is nn.Linear]
    for lin in layers:
        lin.forward = functools.partial(_quant_linear, lin, bits, quant)
    try:
        yield model
    finally:
        for lin in layers:
            del lin.forward


def relative_error(z: Tensor, zq: Tensor) -> Tensor:
    """R in the token norm: the mean over tokens of ‖zq − z‖²/‖z‖² (propagation.py's R at the logits)."""
    z, zq = _wide(z).flatten(0, -2), _wide(zq).flatten(0, -2)
    return ((zq - z).square().sum(-1) / z.square().sum(-1)).mean()


def head_relative_error(W: Tensor, n: Tensor, nq: Tensor) -> Tensor:
    """relative_error of the logits z = W n, z^q = W n^q (the head stays FP) from the d-wide final hidden
    states: ‖W u‖² = uᵀ(WᵀW)u, so neither chain's V-wide logits enter the penalty (as propagation.py's
    readout rows; one d×d Gram per step). Differentiable in W (a tied head passes it to the embedding)."""
    with torch.autocast(n.device.type, enabled=False):
        W, n, nq = _wide(W), _wide(n).flatten(0, -2), _wide(nq).flatten(0, -2)
        G, u = W.T @ W, nq - n
        return (((u @ G) * u).sum(-1) / ((n @ G) * n).sum(-1)).mean()


def penalty_terms(model: nn.Module, x: Tensor, y: Tensor, bits: int,
                  quant: Quantizer = ste_quantize) -> tuple[Tensor, Tensor]:
    """(CE, R_L) on one batch: CE exactly as lm_loss computes it, and R_L of the fake-quantized copy. The final
    hidden states norm(h_L) are walked along `model.sublayers()` (LM.forward's operations in its order, so lm_head
    of them is bitwise the model's logits)."""
    n = model.norm(hidden_states(model, x))
    logits = model.lm_head(n)
    ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
    with fake_quantized(model, bits, quant):
        nq = model.norm(hidden_states(model, x))
    if model.lm_head.bias is not None:  # no Gram shortcut for an affine head
        return ce, relative_error(logits, model.lm_head(nq))
    return ce, head_relative_error(model.lm_head.weight, n, nq)


def worst_gain(s: Tensor, p: Tensor) -> float:
    """Ĝ = s_1²/Σ s_i² p_i for singular values s (descending) and signal shares p_i = v_iᵀCv_i/tr C."""
    den = float((s.square() * p).sum())
    return float(s[0]) ** 2 / den if den > 0 else math.inf


def gain_cap(s: Tensor, p: Tensor, tau: float) -> float:
    """The largest c with Ĝ(min(s, c)) ≤ τ, in closed form per segment (module docstring); s[-1] (a flat
    spectrum) when no c reaches τ."""
    s2p = s.square() * p
    P, tail = p.cumsum(0), s2p.sum() - s2p.cumsum(0)  # P_k, S_k with the top k+1 values capped
    for k in range(len(s) - 1):  # capping all of them gives Ĝ = 1/Σp_i whatever c: not a segment
        den = 1 - tau * float(P[k])
        if den <= 0:
            break
        c2 = tau * float(tail[k]) / den
        if float(s[k + 1]) ** 2 <= c2 <= float(s[k]) ** 2:
            return math.sqrt(c2)
    return float(s[-1])


@torch.no_grad()
def cap_gain_(weight: Tensor, C: Tensor, tau: float) -> tuple[float, float]:
    """Cap the singular values of `weight` (out, in) in place so that Ĝ(W; C) ≤ τ; returns Ĝ before and
    after. SVD in fp64; a layer that sees no signal (tr C = 0) is left alone."""
    U, s, Vh = torch.linalg.svd(weight.double(), full_matrices=False)
    C = C.double()
    trace = float(C.trace())
    if trace <= 0 or float(s[0]) == 0:
        return math.nan, math.nan
    p = ((Vh @ C) * Vh).sum(-1) / trace
    before = worst_gain(s, p)
    if before <= tau:
        return before, before
    s = s.clamp(max=gain_cap(s, p, tau))
    weight.copy_((U * s) @ Vh)
    return before, worst_gain(s, p)


class InputGrams:
    """Σ xᵀx of each layer's inputs while active (forward hooks; q/k/v, reading one tensor, share one)."""

    def __init__(self, layers: list[nn.Linear]):
        self.layers, self.grams, self.handles, self._last = layers, {}, [], (None, None)

    def _hook(self, lin: nn.Module, args: tuple, _out: Tensor) -> None:
        x = args[0]
        if self._last[0] is not x:
            rows = _wide(x.detach()).reshape(-1, x.shape[-1])
            self._last = (x, (rows.T @ rows).double())
        g = self.grams.get(lin)
        self.grams[lin] = self._last[1] if g is None else g + self._last[1]

    def start(self) -> None:
        self.grams, self._last = {}, (None, None)
        self.handles = [lin.register_forward_hook(self._hook) for lin in self.layers]

    def stop(self) -> dict[nn.Module, Tensor]:
        for h in self.handles:
            h.remove()
        self.handles, self._last = [], (None, None)
        return self.grams


class Robust:
    """What the training loop calls for a RobustConfig (method ≠ none): `begin(step)` before a step's
    forward passes, `loss(...)` per micro-batch, `end(step)` after the optimizer step."""

    def __init__(self, cfg: RobustConfig, model: nn.Module, steps: int, world_size: int = 1, eval_every: int = 1):
        if cfg.method in ("penalty", "gain") and world_size > 1:
            raise OptquantError(f"robust.method={cfg.method} runs in one process only (not under torchrun)")
        self.cfg, self.model, self.value = cfg, model, cfg.value
        self.switch = steps - round(cfg.value * steps) if cfg.method == "late-qat" else steps
        layers = [m for _, m in linear_layers(model, skip=("lm_head",)) if type(m) is nn.Linear]
        self.grams = InputGrams(layers) if cfg.method == "gain" else None
        self.label = f"{cfg.method}:{cfg.value:g}"
        self.average = (WeightAverage(model, cfg.method, cfg.value, cfg.every, eval_every, steps)
                        if cfg.method in AVERAGES else None)

    def active(self, step: int) -> bool:
        return step % self.cfg.every == 0

    def begin(self, step: int) -> None:
        if step >= self.switch and not any(isinstance(m, QATLinear) for m in self.model.modules()):
            prepare_qat_(self.model, QATConfig(w_bits=self.cfg.bits, a_bits=self.cfg.bits))
        if self.grams is not None and self.active(step):
            self.grams.start()

    def loss(self, run_model: nn.Module, x: Tensor, y: Tensor, step: int) -> tuple[Tensor, Tensor] | None:
        """(objective, CE) on a penalty step; None on any other (the loop then takes its plain path)."""
        if self.cfg.method != "penalty" or not self.active(step):
            return None
        ce, rl = penalty_terms(self.model, x, y, self.cfg.bits)  # the model itself: not compiled, no DDP
        return ce + self.value * rl, ce

    def averaged(self):
        """A context in which the model holds the weights the run evaluates and saves (the average, if any)."""
        return self.average.swapped() if self.average is not None else contextlib.nullcontext()

    def state(self) -> dict | None:
        return None if self.average is None else self.average.state()

    def load(self, state: dict | None) -> None:
        if self.average is not None:
            if not isinstance(state, dict):
                raise OptquantError(f"the checkpoint holds no robust.method={self.cfg.method} average; delete it "
                                    "to train this run from scratch")
            self.average.load(state)

    def end(self, step: int) -> None:
        if self.average is not None:
            self.average.step(step)
        if self.grams is not None and self.active(step):
            for lin, C in self.grams.stop().items():
                cap_gain_(lin.weight, C, self.value)

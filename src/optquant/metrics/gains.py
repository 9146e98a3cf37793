"""The paper's layer gains (§7.5) of a linear layer, and the linear algebra they need: G1 = (‖M‖₂/‖W‖₂)²,
G2 = (cos φ / cos ψ)² and G_lin = (‖MΔH‖²/‖ΔH‖²)/(‖WH‖²/‖H‖²), M = (W + W^q)/2. Spectral norms are the
top eigenvalue of the smaller Gram matrix (BLAS syrk, LAPACK syevr) in the weights' dtype.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg
import scipy.linalg.blas
import torch
from torch import Tensor


def rows2d(x: Tensor) -> Tensor:
    """x as (rows, width) in the dtype the bookkeeping computes in: the model's own when fp32 or fp64,
    fp32 for 16-bit formats."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def ratio(x: float, y: float) -> float:
    return x / y if y > 0 else math.nan


def gain_terms(spec_W: float, spec_M: float, sq_MdH: float, sq_dH: float, sq_WH: float, sq_H: float):
    """(G1, G2, G_lin) from spectral norms ‖W‖₂, ‖M‖₂ and the squared Frobenius norms of §7.5."""
    G1 = (spec_M / spec_W) ** 2
    cos_phi = ratio(math.sqrt(sq_MdH), spec_M * math.sqrt(sq_dH))
    cos_psi = ratio(math.sqrt(sq_WH), spec_W * math.sqrt(sq_H))
    G2 = ratio(cos_phi, cos_psi) ** 2
    G_lin = ratio(ratio(sq_MdH, sq_dH), ratio(sq_WH, sq_H))
    return G1, G2, G_lin


def syrk(X: Tensor) -> np.ndarray:
    """XᵀX of X (rows, n) as its upper triangle (the lower one is 0), in X's dtype (fp32 or fp64): BLAS
    syrk, half the flops of X.T @ X."""
    X = rows2d(X.detach()).cpu()
    blas = scipy.linalg.blas.ssyrk if X.dtype == torch.float32 else scipy.linalg.blas.dsyrk
    return blas(1.0, X.numpy().T)  # the numpy .T is Xᵀ, no copy


def gram(W: Tensor) -> np.ndarray:
    """The smaller Gram matrix of W (out, in), upper triangle: WᵀW when in ≤ out, else WWᵀ."""
    return syrk(W) if W.shape[1] <= W.shape[0] else syrk(W.T.contiguous())


def sym_inner(A: np.ndarray, B: np.ndarray) -> float:
    """⟨A, B⟩ of two symmetric matrices given by their upper triangles."""
    return 2 * float((A * B).sum()) - float(np.diagonal(A) @ np.diagonal(B))


def top_singular(gram: np.ndarray) -> float:
    """√λ_max of a Gram matrix (upper triangle) in its dtype (fp32: ~3e-7 relative, and faster than fp64);
    LAPACK's syevr finds the one eigenvalue faster than a full eigvalsh (docs/benchmarks.md)."""
    n = gram.shape[0]
    try:
        lam = scipy.linalg.eigvalsh(gram, lower=False, subset_by_index=[n - 1, n - 1], check_finite=False)[0]
    except np.linalg.LinAlgError:  # fp32 syevr/syevx can fail on a tight top cluster (a capped spectrum, robust.py)
        lam = scipy.linalg.eigvalsh(gram.astype(np.float64), lower=False, subset_by_index=[n - 1, n - 1])[0]
    return math.sqrt(max(float(lam), 0.0))


def spectral_norm(W: Tensor) -> float:
    """‖W‖₂ = √λ_max of the smaller Gram matrix, in W's dtype: a symmetric eigenproblem, several times
    cheaper than the SVD of a rectangular W and equal to it to ~1e-15 in fp64."""
    return top_singular(gram(W))


def gain_split(W: Tensor, Wq: Tensor, h: Tensor, hq: Tensor) -> tuple[float, float, float]:
    """(G1, G2, G_lin) of a bias-free linear layer with weights W (FP) and Wq (quantized) on inputs
    h (FP chain) and hq (quantized chain), tensor norm."""
    W, Wq = W.double(), Wq.double()
    M = 0.5 * (W + Wq)
    H, dH = rows2d(h.double()), rows2d(hq.double()) - rows2d(h.double())
    sq = [x.square().sum().item() for x in (dH @ M.T, dH, H @ W.T, H)]
    return gain_terms(spectral_norm(W), spectral_norm(M), *sq)

"""GPTQ: one-shot weight quantization with second-order error feedback (Frantar et al. 2022,
arXiv 2210.17323, Algorithm 1; IST-DASLab/gptq `fasterquant`).

For a linear layer with inputs X (N, in), GPTQ minimises ‖XWᵀ − XŴᵀ‖² column by column: quantize
column j of W, then spread its error over the not-yet-quantized columns through the inverse Hessian
H⁻¹ of the layer-wise problem, H = 2/N · XᵀX. Pieces, as in the paper and the reference:
- damping H += λ·mean(diag H)·I, λ = `damp` (the reference's percdamp);
- dead inputs (diag H = 0) get H_jj = 1 and W[:, j] = 0;
- the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU) replaces H⁻¹ (Algorithm 1, line 3), so the update
  after column j is W[:, j:] −= (w_j − q_j)/U_jj · U[j, j:];
- lazy batches of `block_size` columns: updates inside a block are immediate, those to the columns
  after it are applied once per block (Algorithm 1, lines 13/15);
- act_order: columns in order of decreasing diag H;
- scales: per row (channel) / per tensor from the whole W; per group, computed when the group's first
  column is reached, as the reference's `find_params(W[:, j:j + groupsize])`: from the full W, which
  holds the lazy updates of all earlier blocks but none from inside the current block (those live in
  the block copy W1), so a group's columns within the current block are taken as of the block's start. With
  act_order, group scales are "static" (the reference's `static_groups`): computed from W before any
  update for contiguous groups of the original column order, so the result stays a plain grouped layout.
Any QuantSpec works (all integer grids, MXFP4, NVFP4; the NVFP4 per-tensor scale comes from the
original W). Closed form used by the tests: if H ∝ I the feedback term is exactly zero, so GPTQ = RTN.

Left out on purpose: the reference's per-row loss bookkeeping, true-sequential sub-ordering within a
block (ptq.py orders layers by the actual forward), and multi-GPU / packing code.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from optquant.errors import OptquantError
from optquant.quant.primitives import QuantSpec, group_rows, quant_params, round_to_grid

log = logging.getLogger(__name__)


def accumulate_hessian(H: Tensor | None, n: int, x: Tensor) -> tuple[Tensor, int]:
    """Running H = 2/N · Σ x xᵀ over the rows of x (…, in), as the reference's `add_batch`.

    Returns the updated (H, N), H updated in place (no temporaries of H's size); start with (None, 0).
    """
    x = x.reshape(-1, x.shape[-1]).float()
    m = x.shape[0]
    if H is None:
        H = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    return H.mul_(n / (n + m)).addmm_(x.T, x, alpha=2.0 / (n + m)), n + m


def inverse_hessian_factor(H: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor U of (H + λ·mean(diag H)·I)⁻¹. λ grows ×10 (≤ 4 times) if H is not PD."""
    mean_diag = torch.diag(H).mean()
    A = torch.empty_like(H)  # H + λ·mean·I, the identity never built; L, H⁻¹ and U each overwrite it in turn
    for attempt in range(5):
        A.copy_(H).diagonal().add_(damp * 10**attempt * mean_diag)
        _, info = torch.linalg.cholesky_ex(A, out=(A, torch.empty((), dtype=torch.int32)))
        if info == 0:
            if attempt:
                log.warning("GPTQ: Hessian not positive definite; damping raised to %g", damp * 10**attempt)
            torch.cholesky_inverse(A, out=A)
            _, info = torch.linalg.cholesky_ex(A, upper=True, out=(A, torch.empty((), dtype=torch.int32)))
            if info == 0:
                return A
    raise OptquantError("GPTQ: the Hessian stays singular after damping; use more calibration data")


def _static_params(W: Tensor, spec: QuantSpec, amax: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Scale and zero per (row, group) from W (rows, cols), plus each column's group index."""
    rows, cols = W.shape
    block = spec.block
    scale, zero = quant_params(group_rows(W, block), spec, amax)
    if block <= 0:  # one group: per row (rows, 1), or per tensor (1, 1)
        return scale, zero, torch.zeros(cols, dtype=torch.long, device=W.device)
    col_group = torch.arange(cols, device=W.device) // block
    return scale.reshape(rows, -1), zero.reshape(rows, -1), col_group


def gptq_quantize(
    W: Tensor,
    H: Tensor,
    spec: QuantSpec,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
) -> Tensor:
    """GPTQ-quantized (dequantized, same dtype as W) copy of W (out, in) given H (in, in); computed in fp64 for an
    fp64 W, else fp32. The work is on Wᵀ: each column of W is a contiguous row, its update within a block a rank-1
    `addr_` and the lazy batch update one `addmm_`, so the column loop runs a few small ops per column."""
    if H.shape != (W.shape[1], W.shape[1]):
        raise OptquantError(f"GPTQ: Hessian {tuple(H.shape)} does not match weight {tuple(W.shape)}")
    dtype, work = W.dtype, torch.float64 if W.dtype == torch.float64 else torch.float32
    Wt, H = W.detach().to(work).T.clone(), H.to(work)  # Wt (in, out): row j = column j of W
    diag = torch.diag(H).clone()
    dead = diag == 0
    diag[dead] = 1.0  # a dead input's H_jj, as below
    perm = torch.argsort(diag, descending=True, stable=True) if act_order else None
    # one working copy of H (the caller's stays as it was), permuted in one gather: a 0.5B model's down_proj
    # Hessian is 4864² (95 MB), and with the factor's own (inverse_hessian_factor) three are alive at most
    H = H.clone() if perm is None else H[perm[:, None], perm]
    H.diagonal()[dead if perm is None else dead[perm]] = 1.0
    Wt[dead] = 0.0
    amax = Wt.abs().amax() if spec.format == "nvfp4" else None
    dynamic = spec.block > 0 and not act_order
    scale, zero, col_group = _static_params(Wt.T, spec, amax)
    scale, zero = scale.T.contiguous(), zero.T.contiguous()  # (groups, out): a column's scales are one row
    if perm is not None:
        Wt, col_group = Wt[perm], col_group[perm]
    col_group = col_group.tolist()
    U = inverse_hessian_factor(H, damp)
    del H
    Qt, threads = torch.empty_like(Wt), torch.get_num_threads()
    torch.set_num_threads(1)  # the loop's ops are too small to share: a second thread's sync costs 5x (issue 33)
    try:
        _column_loop(Wt, Qt, U, scale, zero, col_group, spec, amax, dynamic, block_size)
    finally:
        torch.set_num_threads(threads)
    if perm is not None:
        Qt = Qt[torch.argsort(perm)]
    return Qt.T.contiguous().to(dtype)


def _column_loop(Wt, Qt, U, scale, zero, col_group, spec, amax, dynamic, block_size) -> None:
    """Algorithm 1's loop over the columns (rows of Wt, updated in place), each quantized into Qt."""
    cols = Wt.shape[0]
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1, U1 = Wt[i1:i2].clone(), U[i1:i2, i1:i2]  # Wt[i1:i2] stays as of the block's start
        Err1 = torch.empty_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            if dynamic and j % spec.block == 0:  # Algorithm 1 with groups: fresh scales per group
                s, z = (t.reshape(-1) for t in quant_params(Wt[j : j + spec.block].T, spec, amax))
            elif not dynamic:
                s, z = scale[col_group[j]], zero[col_group[j]]
            w = W1[i]
            Qt[j] = q = round_to_grid(w, s, z, spec)
            Err1[i] = err = (w - q) / U1[i, i]
            W1[i + 1 :].addr_(U1[i, i + 1 :], err, alpha=-1)
        Wt[i2:].addmm_(U[i1:i2, i2:].T, Err1, alpha=-1)  # the lazy batch update


def layer_error(X: Tensor, W: Tensor, Q: Tensor) -> float:
    """Relative output error ‖X(W − Q)ᵀ‖ / ‖XWᵀ‖ of a linear layer on inputs X (…, in)."""
    X = X.reshape(-1, X.shape[-1]).float()
    ref = torch.linalg.norm(F.linear(X, W.float()))
    return (torch.linalg.norm(F.linear(X, (W - Q).float())) / ref).item()

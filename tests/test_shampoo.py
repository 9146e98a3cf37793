"""Shampoo (optim/shampoo.py) against closed forms and against Adam.

Strategy: each test pins one semantic of DistributedShampoo as the paper ran it, on small fp64 tensors so
the closed forms hold to rounding: β2 = 0 and no grafting on a square full-rank G gives the polar factor
UVᵀ; a vector's full-matrix root gives g/‖g‖; the grafted step has Adam's norm at every step; before the
start step the optimizer is exactly Adam; a blocked matrix equals its blocks optimized separately;
decoupled weight decay and momentum follow their formulas; the fp64 eigh retry is counted; at β2 = 1
factors and grafting state are Adagrad's sums (DistributedShampoo 2025-06), checked against the closed
form and torch's Adagrad.
(The step-for-step comparison with facebookresearch/optimizers itself ran outside the repository.)
"""

from __future__ import annotations

import pytest
import torch

from optquant.errors import OptquantError
from optquant.optim import ParamGroups, ShampooConfig
from optquant.optim.shampoo import Shampoo, block_views, inverse_root


def param(*shape, seed=0, dtype=torch.float64) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def grads(shape, steps, seed=1, dtype=torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=dtype) for _ in range(steps)]


def step_deltas(opt: torch.optim.Optimizer, p: torch.Tensor, gs: list[torch.Tensor]) -> list[torch.Tensor]:
    deltas = []
    for g in gs:
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        deltas.append(p.detach() - before)
    return deltas


def test_beta2_zero_without_grafting_is_polar_factor():
    W = param(6, 6)
    opt = Shampoo([W], lr=0.1, betas=(0.0, 0.0), eps=1e-12, grafting="none", precondition_frequency=1)
    (G,) = grads((6, 6), 1)
    (delta,) = step_deltas(opt, W, [G])
    U, _, Vh = torch.linalg.svd(G)
    torch.testing.assert_close(-delta / 0.1, U @ Vh, rtol=1e-5, atol=1e-5)  # L^-¼ G R^-¼ = UVᵀ


def test_vector_full_matrix_root_normalizes():
    v = param(5)
    opt = Shampoo([v], lr=1.0, betas=(0.0, 0.0), eps=1e-12, grafting="none", precondition_frequency=1)
    (g,) = grads((5,), 1)
    (delta,) = step_deltas(opt, v, [g])
    torch.testing.assert_close(-delta, g / g.norm(), rtol=1e-5, atol=1e-5)  # (ggᵀ)^-½ g = g/‖g‖


def test_bias_corrections_make_a_constant_gradient_exact():
    v = param(5)
    opt = Shampoo([v], lr=1.0, betas=(0.9, 0.5), eps=1e-12, grafting="none", precondition_frequency=1)
    (g,) = grads((5,), 1)
    for delta in step_deltas(opt, v, [g] * 4):  # M̂ = g and F/(1−β2^t) = ggᵀ at every step
        torch.testing.assert_close(-delta, g / g.norm(), rtol=1e-5, atol=1e-5)


def adam_directions(gs, beta1, beta2, eps):
    m, v, out = torch.zeros_like(gs[0]), torch.zeros_like(gs[0]), []
    for t, g in enumerate(gs, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        out.append((m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps))
    return out


def test_grafted_step_has_adams_norm_and_shampoos_direction():
    W = param(4, 3)
    opt = Shampoo([W], lr=0.5, betas=(0.9, 0.95), eps=1e-10, precondition_frequency=2)
    gs = grads((4, 3), 7)
    deltas = step_deltas(opt, W, gs)
    for t, (d, a) in enumerate(zip(deltas, adam_directions(gs, 0.9, 0.95, 1e-10), strict=True), start=1):
        torch.testing.assert_close(d.norm(), 0.5 * a.norm(), rtol=1e-9, atol=0)
        cos = torch.nn.functional.cosine_similarity(-d.flatten(), a.flatten(), dim=0)
        assert (cos > 1 - 1e-12) == (t < 2)  # Adam itself before the first roots, Shampoo's direction after


def test_before_start_it_is_adamw():
    W, ref = param(8, 5), param(8, 5)
    opt = Shampoo([W], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    adamw = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gs = grads((8, 5), 19)  # start = precondition frequency = 20
    step_deltas(opt, W, gs), step_deltas(adamw, ref, gs)
    torch.testing.assert_close(W, ref, rtol=1e-12, atol=1e-12)
    step_deltas(opt, W, grads((8, 5), 1, seed=9)), step_deltas(adamw, ref, grads((8, 5), 1, seed=9))
    assert (W - ref).norm() > 1e-4  # step 20: the first roots, no longer Adam's direction


def test_blocking_equals_separate_blocks():
    top, bottom = param(4, 3, seed=0), param(4, 3, seed=1)
    whole = torch.nn.Parameter(torch.cat([top.detach(), bottom.detach()]))
    kw = dict(lr=0.1, betas=(0.9, 0.95), precondition_frequency=3, max_preconditioner_dim=4, weight_decay=0.1)
    opt_whole, opt_parts = Shampoo([whole], **kw), Shampoo([top, bottom], **kw)
    assert [b.shape for b in block_views(whole.detach(), 4)] == [(4, 3), (4, 3)]
    for g in grads((8, 3), 8):
        whole.grad, top.grad, bottom.grad = g.clone(), g[:4].clone(), g[4:].clone()
        opt_whole.step(), opt_parts.step()
    torch.testing.assert_close(whole.detach(), torch.cat([top.detach(), bottom.detach()]), rtol=1e-14, atol=1e-14)


def test_squeezes_unit_dims_and_vectors_can_take_the_graft_only():
    scale = param(1, 3, 1, 1)
    assert [b.shape for b in block_views(scale.detach(), 12288)] == [(3,)]
    v, ref = param(6), param(6)
    opt = Shampoo([v], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, precondition_frequency=2, precondition_1d=False)
    adam = torch.optim.Adam([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    gs = grads((6,), 6)
    step_deltas(opt, v, gs), step_deltas(adam, ref, gs)
    torch.testing.assert_close(v, ref, rtol=1e-12, atol=1e-12)
    assert opt.state[v]["factors"] == [[]]


def test_momentum_accumulates_the_direction():
    W, ref = param(3, 3), param(3, 3)
    with_mom = Shampoo([W], lr=0.1, betas=(0.0, 0.9), momentum=0.5, precondition_frequency=1)
    without = Shampoo([ref], lr=0.1, betas=(0.0, 0.9), precondition_frequency=1)
    gs = grads((3, 3), 3)
    d_mom, d_plain = step_deltas(with_mom, W, gs), step_deltas(without, ref, gs)
    torch.testing.assert_close(d_mom[2], d_plain[2] + 0.5 * d_plain[1] + 0.25 * d_plain[0])


def test_inverse_root_shifts_a_non_positive_spectrum_to_eps():
    A = torch.diag(torch.tensor([-1.0, 2.0], dtype=torch.float64))  # rounding can make factors indefinite
    X, retried = inverse_root(A, 2.0, eps=0.01)  # λ(A + εI) = (−0.99, 2.01) → shifted to (0.01, 3.01)
    torch.testing.assert_close(X, torch.diag(torch.tensor([0.01, 3.01], dtype=torch.float64) ** -0.5))
    assert not retried


def test_eigh_retry_in_fp64_is_counted(monkeypatch):
    A = torch.randn(5, 5, dtype=torch.float32)
    A = A @ A.T
    expected, _ = inverse_root(A.double(), 4.0, 1e-6)
    real_eigh = torch.linalg.eigh

    def flaky(M):
        if M.dtype == torch.float32:
            raise torch.linalg.LinAlgError("simulated ill-conditioned fp32 eigh")
        return real_eigh(M)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    X, retried = inverse_root(A, 4.0, 1e-6)
    assert retried and X.dtype == torch.float32
    torch.testing.assert_close(X.double(), expected, rtol=1e-5, atol=1e-6)
    W = param(4, 4, dtype=torch.float32)
    opt = Shampoo([W], precondition_frequency=1)
    step_deltas(opt, W, grads((4, 4), 3, dtype=torch.float32))
    assert opt.eigh_retries == 3 * 2  # every step, both factors


def test_config_builds_two_groups_and_rejects_bad_values():
    emb, gain, mat = param(10, 4), param(4), param(4, 4)
    (opt,) = ShampooConfig().build(ParamGroups([emb], [gain], [mat]))
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1]
    assert opt.param_groups[0]["betas"] == (0.95, 0.95) and opt.param_groups[0]["eps"] == 1e-10
    with pytest.raises(OptquantError):
        Shampoo([mat], precondition_frequency=20, start_preconditioning_step=5)
    with pytest.raises(OptquantError):
        Shampoo([mat], grafting="sgd")


def matrix_power(A: torch.Tensor, power: float) -> torch.Tensor:
    L, Q = torch.linalg.eigh(A)
    return (Q * L.pow(power)) @ Q.T


@pytest.mark.parametrize("beta1", [0.0, 0.9])
def test_beta2_one_is_adagrad_accumulation(beta1):
    lr, eps, f = 0.1, 1e-10, 5
    W = param(4, 3)
    start = W.detach().clone()
    opt = Shampoo([W], lr=lr, betas=(beta1, 1.0), eps=eps, precondition_frequency=f)
    gs = grads((4, 3), 8)
    deltas = step_deltas(opt, W, gs)
    m, v = torch.zeros_like(gs[0]), torch.zeros_like(gs[0])
    L, R = torch.zeros(4, 4, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64)
    for t, (g, d) in enumerate(zip(gs, deltas, strict=True), start=1):
        m, v = beta1 * m + (1 - beta1) * g, v + g * g  # weight 1 on g², no bias correction
        L, R = L + g @ g.T, R + g.T @ g
        m_hat = m / (1 - beta1**t)
        adagrad = m_hat / (v.sqrt() + eps)
        if t == f:  # the roots of the summed factors, computed once in this window
            XL, XR = matrix_power(L + eps * torch.eye(4), -0.25), matrix_power(R + eps * torch.eye(3), -0.25)
        expected = adagrad if t < f else (XL @ m_hat @ XR) * (adagrad.norm() / (XL @ m_hat @ XR).norm())
        torch.testing.assert_close(-d, lr * expected, rtol=1e-9, atol=1e-12)
    assert deltas[0].abs().max() <= lr  # |g|/(|g| + ε) ≤ 1: not g/ε (the V = 0 bug gave ~1e9·lr)
    if beta1 == 0:  # before the first roots it is torch's Adagrad
        ref = torch.nn.Parameter(start.clone())
        step_deltas(torch.optim.Adagrad([ref], lr=lr, eps=eps), ref, gs[: f - 1])
        W2 = torch.nn.Parameter(start.clone())
        step_deltas(Shampoo([W2], lr=lr, betas=(0.0, 1.0), eps=eps, precondition_frequency=f), W2, gs[: f - 1])
        torch.testing.assert_close(W2, ref, rtol=1e-12, atol=1e-12)

"""PSGD Kron's memoised einsum paths (optim/psgd.py `memoised_einsum_paths`): torch.einsum asks
opt_einsum for a contraction path on every call with three or more operands; Kron.step memoises them.
Checked: the real `contract_path` runs once per (equation, shapes, strategy) instead of once per call,
the steps are bitwise those of the library's Kron run without the memo (test_optim's
`test_kron_equals_library_call_and_keeps_global_rng` compares against the library class itself), and
torch's opt_einsum is restored after each step."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.backends.opt_einsum as torch_opt_einsum

import optquant.optim.psgd as psgd
from optquant.model import LM, lm_loss, model_config
from optquant.optim import PSGDConfig, build_optimizers

pytestmark = pytest.mark.skipif(not torch_opt_einsum.is_available(), reason="torch without opt_einsum")


MEMOISED = psgd.memoised_einsum_paths


class CountingOptEinsum:
    """opt_einsum with its `contract_path` calls counted."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def contract_path(self, *args, **kwargs):
        self.calls += 1
        return self.real.contract_path(*args, **kwargs)


def run_kron(monkeypatch, memo: bool, steps: int = 6) -> tuple[list[torch.Tensor], CountingOptEinsum]:
    counter = CountingOptEinsum(torch_opt_einsum.get_opt_einsum())
    monkeypatch.setattr(torch_opt_einsum, "get_opt_einsum", lambda: counter)
    monkeypatch.setattr(psgd, "_PATHS", None)  # a fresh memo: this test's counter is what it wraps
    monkeypatch.setattr(psgd, "memoised_einsum_paths", MEMOISED if memo else nullcontext)
    torch.manual_seed(0)
    model = LM(model_config("micro", vocab_size=64, seq_len=16))
    (opt,) = build_optimizers(model, PSGDConfig(lr=0.01, seed=3, balance_prob=0.5))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 17), generator=gen)
        lm_loss(model, idx[:, :-1].contiguous(), idx[:, 1:].contiguous()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch_opt_einsum.get_opt_einsum() is counter  # restored after every step
    return [p.detach().clone() for p in model.parameters()], counter


def test_memoised_paths_are_computed_once_per_shape_and_change_no_bit(monkeypatch):
    plain, plain_count = run_kron(monkeypatch, memo=False)
    memo, memo_count = run_kron(monkeypatch, memo=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, memo, strict=True))
    assert memo_count.calls == len(psgd._PATHS.paths) > 0
    assert plain_count.calls >= 5 * memo_count.calls  # every step asked again without the memo


def test_the_memo_keys_on_shapes():
    paths = psgd.EinsumPaths(torch_opt_einsum.get_opt_einsum())
    a, b, c = torch.ones(2, 3), torch.ones(3, 4), torch.ones(4, 5)
    first = paths.contract_path("ab,bc,cd->ad", a, b, c)
    assert paths.contract_path("ab,bc,cd->ad", a, b, c) is first
    wide = paths.contract_path("ab,bc,cd->ad", torch.ones(2, 30), torch.ones(30, 4), c)
    assert len(paths.paths) == 2 and wide[1].size_dict["b"] == 30

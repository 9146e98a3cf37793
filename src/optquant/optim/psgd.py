"""PSGD Kron (Li 2015, arXiv 1512.04202; Kronecker-factored whitening, lixilinx/psgd_torch via kron_torch).

`pytorch_optimizer.Kron`, measured faithful to kron_torch (dependencies.md §1.2), called as the authors
did (paper.md §3): momentum (an EMA of the gradient), decoupled weight decay, max_size_triangular=12288
(our `max_precondition_dim`, the name SOAP's and Shampoo's configs use too), min_ndim_triangular=2,
memory_save_mode=None, and the library's preconditioner-update schedule
p(n) = clamp(exp(−0.001·(n − 500)), 0.03, 1) (every step for the first 500 steps).

Randomness, and why this file wraps the class: the schedule itself is a deterministic counter, but each
step draws `numpy.random.random()` (numpy's global RNG) to decide a factor re-balancing (probability
0.01) and, on update steps, `torch.randn_like` (torch's global RNG) for the probe vector. Reading and
advancing the global RNGs would make a run depend on whatever else draws from them (data order, dropout)
and make exact resume depend on the loop saving both RNG states. `Kron.step` here instead seeds both
from (seed, step) inside a fork of the RNG state and restores the global states afterwards: the same
distributions, a stream that is a function of the step (so a restored state dict resumes exactly), and
other code sees the global RNGs untouched. The param groups also hold a torch.dtype
(`precondition_dtype`); the state dict stores it as its name so it stays JSON-able.

Speed: the library's preconditioner updates call `torch.einsum` with three or more operands ~19 times a
step, and torch asks opt_einsum for the contraction path on every such call (docs/benchmarks.md;
benchmarks/train_step.py). A path depends only on the equation, the operand shapes and the strategy, so
`Kron.step` memoises them (`EinsumPaths`): the same path, hence bitwise the same update.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.backends.opt_einsum as torch_opt_einsum
from pytorch_optimizer import Kron as _LibKron

from optquant.optim.groups import LRGroup, ParamGroups, closure_loss
from optquant.ranges import Count, NonNegative, Positive, Probability, Seed, Unit

_DTYPE_KEYS = ("mu_dtype", "precondition_dtype")


def kron_step_seed(seed: int, step: int) -> int:
    """The torch seed of one Kron step (numpy gets `[seed, step]`)."""
    return (seed * 1_000_003 + step) % 2**63


class EinsumPaths:
    """opt_einsum as torch.einsum sees it, with `contract_path` memoised on (equation, shapes, strategy)."""

    def __init__(self, opt_einsum: Any):
        self.opt_einsum = opt_einsum
        self.paths: dict[tuple, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.opt_einsum, name)

    def contract_path(self, equation: str, *operands: Any, optimize: Any = "auto") -> Any:
        key = (equation, tuple(tuple(op.shape) for op in operands), optimize)
        if key not in self.paths:
            self.paths[key] = self.opt_einsum.contract_path(equation, *operands, optimize=optimize)
        return self.paths[key]


_PATHS: EinsumPaths | None = None


@contextmanager
def memoised_einsum_paths():
    """Within: torch.einsum takes opt_einsum's paths from one process-wide memo (torch.einsum asks
    `torch.backends.opt_einsum.get_opt_einsum()` for the package; a no-op where torch has none)."""
    global _PATHS
    getter = torch_opt_einsum.get_opt_einsum
    real = getter()
    if real is None or isinstance(real, EinsumPaths):
        yield
        return
    if _PATHS is None or _PATHS.opt_einsum is not real:
        _PATHS = EinsumPaths(real)
    memo = _PATHS
    torch_opt_einsum.get_opt_einsum = lambda: memo
    try:
        yield
    finally:
        torch_opt_einsum.get_opt_einsum = getter


class Kron(_LibKron):
    """`pytorch_optimizer.Kron` with a private RNG stream, memoised einsum paths and a JSON-able state
    dict."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)  # outside the forked RNG: the closure's randomness is the caller's
        first = self.param_groups[0]
        seed, step = first.get("rng_seed", 0), first.get("step", 0)
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        np_state = np.random.get_state()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(kron_step_seed(seed, step))
            np.random.seed([seed, step])
            try:
                with memoised_einsum_paths():
                    super().step()
            finally:
                np.random.set_state(np_state)
        return loss

    def state_dict(self) -> dict:
        sd = super().state_dict()
        for group in sd["param_groups"]:  # fresh dicts: the live groups keep their dtypes
            for key in _DTYPE_KEYS:
                if isinstance(group.get(key), torch.dtype):
                    group[key] = str(group[key]).removeprefix("torch.")
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        groups = [dict(g) for g in state_dict["param_groups"]]
        for group in groups:
            for key in _DTYPE_KEYS:
                if isinstance(group.get(key), str):
                    group[key] = getattr(torch, group[key])
        super().load_state_dict({**state_dict, "param_groups": groups})


@dataclass(frozen=True)
class PSGDConfig:
    """Defaults: the authors' call; lr and momentum are their CLI defaults (1e-3, 0.9), = the library's."""

    name: Literal["psgd"] = "psgd"
    lr: Positive = 1e-3
    momentum: Unit = 0.9
    weight_decay: NonNegative = 0.0  # decoupled
    max_precondition_dim: Count = 12288  # Kron's max_size_triangular; 8192 in the authors' June-2025 code
    min_ndim_triangular: Count = 2  # vectors get diagonal preconditioners
    memory_save_mode: Literal["none", "one_diag", "smart_one_diag", "all_diag"] = "none"
    update_prob: Probability | None = None  # None: the library's schedule above; a number: fixed probability
    precondition_lr: Positive = 0.1
    balance_prob: Probability = 0.01
    momentum_into_precondition_update: bool = True
    seed: Seed = 0  # of the optimizer's private RNG stream

    LEGACY_NAMES: ClassVar[dict[str, str]] = {"max_precondition_dim": "max_size_triangular"}  # in run ids

    def state_bytes(self, shape: tuple[int, ...], element_size: int, group: str) -> int:
        """pytorch_optimizer.Kron (`initialize_q_expressions`): a momentum buffer, and per dim a dense n×n
        factor (the triangular Q, stored full) or, for a size-1 dim, a dim above `max_precondition_dim`, a
        tensor with fewer than `min_ndim_triangular` dims or a diagonal `memory_save_mode` dim, a diagonal n.
        Factors are fp32 (`precondition_dtype`); a 0-d parameter has one scalar factor."""
        total = math.prod(shape) * element_size
        if not shape:
            return total + 4
        mode, s = self.memory_save_mode, sorted(shape)
        diag = [mode == "all_diag"] * len(shape)
        if mode == "one_diag" or (mode == "smart_one_diag" and len(shape) >= 2 and s[-1] > s[-2]):
            diag[int(np.argsort(shape)[::-1][0])] = True  # the largest dim as the library picks it (unstable sort)
        for n, d in zip(shape, diag, strict=True):
            tri = not (n == 1 or n > self.max_precondition_dim or len(shape) < self.min_ndim_triangular or d)
            total += (n * n if tri else n) * 4
        return total

    def lr_groups(self) -> list[LRGroup]:
        return [LRGroup(("embeddings", "vectors"), self.lr), LRGroup(("matrices",), self.lr)]

    def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]:
        params = [
            {"params": g, "precondition_lr": self.precondition_lr, "rng_seed": self.seed}
            for g in (groups.embeddings + groups.vectors, groups.matrices)
            if g
        ]
        return [
            Kron(
                params,
                lr=self.lr,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                weight_decouple=True,
                pre_conditioner_update_probability=self.update_prob,
                max_size_triangular=self.max_precondition_dim,
                min_ndim_triangular=self.min_ndim_triangular,
                memory_save_mode=None if self.memory_save_mode == "none" else self.memory_save_mode,
                momentum_into_precondition_update=self.momentum_into_precondition_update,
                balance_prob=self.balance_prob,
            )
        ]

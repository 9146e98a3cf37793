"""The cost and memory of one run, from shapes alone: parameters, tokens, FLOPs, peak memory, GPU-hours.

`run_cost(cfg, plan)` builds the model on the meta device (no memory, no compute) and reads off:
- parameters N (a tied embedding once) and tokens D = steps × batch × sequence length;
- training FLOPs 6·N_mm·D + 12·L·d·T·D (PaLM's count, appendix B: N_mm are the matmul weights — the
  head once, an untied input embedding is a lookup — and 12·L·d·T per token is attention's QKᵀ and AV,
  forward and backward, over the full T×T matrix as MFU is usually quoted);
- peak memory: fp32 weights and gradients, the optimizer's state with its real layout
  (`optimizer_state_bytes`), and the activations saved for backward at the micro-batch;
- GPU-hours on a named accelerator at its peak dense bf16 FLOP/s times an assumed MFU (both printed).

The optimizer state is computed per parameter by the optimizer config's `state_bytes`, which follows the
code that allocates it (each optimizer's file names it), so `state_bytes` of a really built optimizer
after a step matches it (tests/test_cost.py). Activations are an estimate (see `activation_bytes`);
everything else is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from optquant.errors import OptquantError
from optquant.optim import split_params
from optquant.ranges import Count, Probability


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_flops: float  # peak dense bf16 FLOP/s (no sparsity), from the vendor's data sheet
    memory: float  # bytes


ACCELERATORS = {
    "h100": Accelerator("H100 SXM 80GB", 989e12, 80e9),
    "h200": Accelerator("H200 SXM 141GB", 989e12, 141e9),
    "b200": Accelerator("B200 180GB", 2250e12, 180e9),
    "a100": Accelerator("A100 SXM 80GB", 312e12, 80e9),
    "a100-40gb": Accelerator("A100 SXM 40GB", 312e12, 40e9),
    "l40s": Accelerator("L40S 48GB", 362e12, 48e9),
    "a10g": Accelerator("A10G 24GB", 70e12, 24e9),
}


@dataclass(frozen=True)
class GPUConfig:
    """`--set plan.gpu=a100 --set plan.mfu=0.35` on `optquant train/study --dry-run`."""

    gpu: str = "h100"
    mfu: Probability = 0.4  # model FLOPs utilisation assumed for the GPU-hours
    gpus_per_run: Count = 1  # data-parallel replicas of one run (weights, grads and state replicated)

    def accelerator(self) -> Accelerator:
        if self.gpu not in ACCELERATORS:
            raise OptquantError(f"plan.gpu={self.gpu}: choose one of {', '.join(ACCELERATORS)}")
        return ACCELERATORS[self.gpu]


DEFAULT_GPU = GPUConfig()


def split_gpu_overrides(overrides: list) -> tuple[GPUConfig, list[tuple[str, Any]]]:
    """(GPUConfig from the `plan.*` settings, the other settings), of --set strings or TOML pairs (config.settings)."""
    from optquant.config import set_field, settings

    plan, rest = GPUConfig(), []
    for key, value in settings(overrides, "plan.gpu=a100"):
        if key.startswith("plan."):
            plan = set_field(plan, key.split(".")[1:], value, key)
        else:
            rest.append((key, value))
    plan.accelerator()
    return plan, rest


# ------------------------------------------------------------------------------------ optimizer state
def optimizer_state_bytes(model: nn.Module, optim: Any) -> int | None:
    """Bytes of optimizer state `optim` (an optimizer config) allocates for `model` (any device, meta
    included), after its first step: each parameter's `optim.state_bytes` (optquant.optim); None when
    the optimizer declares no layout (a plugin: its runs measure their state)."""
    groups = split_params(model)
    sizes = [optim.state_bytes(tuple(p.shape), p.element_size(), group)
             for group in ("embeddings", "vectors", "matrices") for p in getattr(groups, group)]
    return None if None in sizes else sum(sizes)


# ------------------------------------------------------------------------------------------ activations
def activation_bytes(cfg, micro: int, bf16: bool) -> int:
    """Peak activation memory of one micro-batch of `micro` sequences (an estimate).

    Per token and block, the tensors autograd saves for this model, with the coefficients measured by
    saved-tensor hooks on CPU (tests/test_cost.py checks them within 20 %): fp32 4·(14·d + 2·h) bytes,
    bf16 autocast 48·d + 6·h (h the MLP width; SwiGLU keeps twice as much per h). SDPA's fused kernels
    (flash / memory-efficient, used on CUDA and CPU alike) keep no T×T matrix. The head saves the
    logits (fp32 4·V; bf16 5·V) and the final norm (12–16·d), and the backward briefly adds the fp32
    gradient of the logits (4·V).
    """
    m = cfg.model
    d, h, L, V = m.d_model, m.mlp_hidden, m.n_layer, m.vocab_size
    gated = 2 if m.arch == "llama" else 1
    block = 48 * d + 6 * gated * h if bf16 else 4 * (14 * d + 2 * gated * h)
    head = 5 * V + 16 * d if bf16 else 4 * V + 12 * d
    return micro * m.seq_len * (L * block + head + 4 * V)


# -------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class RunCost:
    n_params: int
    n_params_non_embedding: int
    steps: int
    tokens: int
    flops: float
    micro_batch: int
    weights: int
    grads: int
    state: int | None  # None: unknown (a plugin), left out of `memory`
    activations: int
    gpu_hours: float
    fits: bool
    fix: str | None  # the setting that makes it fit, when it does not

    @property
    def memory(self) -> int:
        return self.weights + self.grads + (self.state or 0) + self.activations


def meta_model(cfg) -> nn.Module:
    """The run's model (QAT layers included) on the meta device: shapes without storage."""
    from unittest import mock

    from optquant.model import LM
    from optquant.train import build_model

    # no init on meta: torch's normal_ decomposition is slow there (docs/benchmarks.md), and shapes need none
    try:
        with torch.device("meta"), mock.patch.object(LM, "reset_parameters", lambda self: None):
            return build_model(cfg)
    except RuntimeError as e:  # model.d_model=10**9: "Storage size calculation overflowed", once a traceback
        if "overflow" not in str(e):
            raise
        raise OptquantError(f"model {cfg.model.d_model=}, {cfg.model.vocab_size=}: a weight of these shapes has more "
                            f"bytes than torch can address ({str(e).splitlines()[0]})") from None


def meta_models(cfg) -> tuple[nn.Module, nn.Module]:
    """The run's model with 1 and 2 blocks on the meta device, for `at_depth`: building all n_layer blocks costs
    ~1 ms of CPU each, so a dry run of model.n_layer=100000 took minutes; from these two, what n_layer=2 does."""
    return tuple(meta_model(replace(cfg, model=replace(cfg.model, n_layer=n))) for n in (1, 2))


def at_depth(cfg, models: tuple[nn.Module, nn.Module], measure: Callable[[nn.Module], int | None]) -> int | None:
    """measure(the run's model) from `meta_models`: every block is the same, so a count over the parameters
    (their number, bytes, optimizer state) is affine in the depth, one + (n_layer - 1)·(two - one)."""
    one, two = measure(models[0]), measure(models[1])
    return None if one is None or two is None else one + (cfg.model.n_layer - 1) * (two - one)


def training_flops(cfg, n_matmul: int, tokens: int) -> float:
    m = cfg.model
    return 6.0 * n_matmul * tokens + 12.0 * m.n_layer * m.d_model * m.seq_len * tokens


EVAL_FORWARDS = {"ptq": 12, "outliers": 2}  # over the eval batches: PTQ (FP, quantized, GPTQ, ABC); FP outliers


def eval_flops(cfg, n_params: int, forwards: int) -> float:
    """`forwards` passes of N parameters over the eval tokens (batches × micro-batch × T), 2·N FLOPs a token."""
    tc = cfg.train
    return 2.0 * n_params * tc.eval_batches * (tc.batch_size // tc.grad_accum) * cfg.model.seq_len * forwards


def run_cost(cfg, plan: GPUConfig = DEFAULT_GPU, models: tuple[nn.Module, nn.Module] | None = None) -> RunCost:
    """The cost and peak memory of training `cfg` (a RunConfig) as planned by `plan`; `models`: its
    `meta_models`, when already built."""
    from optquant.model import count_params
    from optquant.train import steps_for

    acc = plan.accelerator()
    models = models or meta_models(cfg)
    tc = cfg.train
    if tc.batch_size % (tc.grad_accum * plan.gpus_per_run):
        raise OptquantError(f"train.batch_size={tc.batch_size} is not divisible by grad_accum×gpus "
                            f"= {tc.grad_accum}×{plan.gpus_per_run}")
    n, n_ne = at_depth(cfg, models, count_params), at_depth(cfg, models, lambda m: count_params(m, embeddings=False))
    tied = models[0].lm_head.weight is models[0].embed.weight
    n_matmul = n if tied else n - models[0].embed.weight.numel()
    steps = steps_for(cfg, n if tc.budget_params == "total" else n_ne)
    tokens = steps * tc.batch_size * cfg.model.seq_len
    flops = training_flops(cfg, n_matmul, tokens)
    weights = at_depth(cfg, models, lambda m: sum(p.numel() * p.element_size() for p in m.parameters()))  # tied once
    state = at_depth(cfg, models, lambda m: optimizer_state_bytes(m, cfg.optim))
    bf16 = tc.precision != "fp32"  # auto = bf16 on every GPU with bf16 (the planner's targets)
    micro = tc.batch_size // (tc.grad_accum * plan.gpus_per_run)
    acts = activation_bytes(cfg, micro, bf16)
    hours = flops / (acc.bf16_flops * plan.mfu) / 3600
    budget = RunCost(n, n_ne, steps, tokens, flops, micro, weights, weights, state, acts, hours, True, None)
    return budget if budget.memory <= acc.memory else replace(budget, fits=False, fix=_fix(cfg, plan, models, budget))


def _fix(cfg, plan: GPUConfig, models: tuple[nn.Module, nn.Module], b: RunCost) -> str:
    """The smallest change that fits: a larger grad_accum (smaller micro-batch), else a lower cap."""
    acc, tc = plan.accelerator(), cfg.train
    bf16 = tc.precision != "fp32"
    fixed = 2 * b.weights + (b.state or 0)
    per_gpu = tc.batch_size // plan.gpus_per_run

    def accum_from(start: int, need: int) -> int | None:  # the first grad_accum whose micro-batch fits beside `need`
        return next((a for a in range(start, per_gpu + 1) if per_gpu % a == 0
                     and need + activation_bytes(cfg, per_gpu // a, bf16) <= acc.memory), None)

    if fixed < acc.memory and (accum := accum_from(tc.grad_accum + 1, fixed)):
        return f"train.grad_accum={accum} (micro-batch {per_gpu // accum})"
    if hasattr(cfg.optim, "max_precondition_dim"):  # an optimizer with a preconditioner size cap
        cap = cfg.optim.max_precondition_dim
        while cap > 128:
            cap //= 2
            capped = replace(cfg.optim, max_precondition_dim=cap)
            need = 2 * b.weights + at_depth(cfg, models, lambda m, o=capped: optimizer_state_bytes(m, o))
            if accum := accum_from(tc.grad_accum, need):
                extra = f" and train.grad_accum={accum}" if accum != tc.grad_accum else ""
                return f"optim.max_precondition_dim={cap}{extra}"
    return f"nothing on one {acc.name}: weights, gradients and optimizer state alone need {gb(fixed)}"


def gb(n: float | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def cost_lines(cfg, plan: GPUConfig = DEFAULT_GPU) -> list[str]:
    """`optquant train --dry-run`: the plan of one run, as printed lines."""
    acc, b = plan.accelerator(), run_cost(cfg, plan)
    lines = [
        f"run {cfg.name} ({cfg.optim.name}, lr {cfg.optim.lr:g}){' + QAT' if cfg.qat else ''}",
        f"  parameters {b.n_params:,} ({b.n_params_non_embedding:,} non-embedding)",
        f"  tokens {b.tokens:,} = {b.steps:,} steps × {cfg.train.batch_size} × {cfg.model.seq_len}",
        f"  training FLOPs {b.flops:.3g} (6·N·D + attention)",
        f"  peak memory {'≥ ' * (b.state is None)}{gb(b.memory)} per GPU at micro-batch {b.micro_batch}: "
        f"weights {gb(b.weights)}, "
        f"gradients {gb(b.grads)}, optimizer state {gb(b.state)}, activations ≈ {gb(b.activations)}",
        f"  {b.gpu_hours:.3g} GPU-hours on {plan.gpus_per_run}× {acc.name} "
        f"(peak bf16 {acc.bf16_flops / 1e12:g} TFLOP/s, assumed MFU {plan.mfu:g}), "
        f"{b.gpu_hours * 3600 / b.steps / plan.gpus_per_run:.3g} s per optimizer step",
    ]
    if not b.fits:
        lines.append(f"  WARNING: needs {gb(b.memory)} > {gb(acc.memory)} of the {acc.name}; fix: {b.fix}")
    return lines

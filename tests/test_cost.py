"""The planner (optquant.cost, study.budget, --dry-run) against really built models and optimizers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from optquant.cli import main
from optquant.config import apply_overrides, run_preset
from optquant.cost import (
    GPUConfig,
    activation_bytes,
    meta_model,
    optimizer_state_bytes,
    run_cost,
    split_gpu_overrides,
)
from optquant.errors import OptquantError
from optquant.model import LM, count_params, lm_loss
from optquant.optim import OPTIMIZERS, build_optimizers, state_bytes
from optquant.study.dryrun import stages
from optquant.study_spec import study_preset

# caps below the vocabulary (and, for Shampoo, below a hidden width) so every fallback path runs
CAPS = {"psgd": ("optim.max_precondition_dim=256",), "soap": ("optim.max_precondition_dim=256",),
        "shampoo": ("optim.max_precondition_dim=100",)}


def measured_state(cfg, steps: int = 1, batch: int = 2, seq: int = 16) -> int:
    torch.manual_seed(0)
    model = LM(cfg.model)
    optimizers = build_optimizers(model, cfg.optim)
    for _ in range(steps):
        x = torch.randint(0, cfg.model.vocab_size, (batch, seq))
        lm_loss(model, x, x).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return state_bytes(optimizers)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("capped", [False, True])
def test_state_estimate_matches_built_optimizer(opt, capped):
    extra = CAPS.get(opt, ()) if capped else ()
    cfg = apply_overrides(run_preset("femto"), [f"optim.name={opt}", "model.vocab_size=512", *extra])
    est, got = optimizer_state_bytes(meta_model(cfg), cfg.optim), measured_state(cfg)
    assert abs(est - got) <= 0.05 * got, (est, got)


@pytest.mark.parametrize("override", ["optim.precondition_1d=true", "optim.momentum=0.5", "optim.beta1=0"])
def test_shampoo_state_options(override):
    cfg = apply_overrides(run_preset("femto"), ["optim.name=shampoo", "model.vocab_size=300",
                                                "optim.max_precondition_dim=64", override])
    assert optimizer_state_bytes(meta_model(cfg), cfg.optim) == measured_state(cfg)


@pytest.mark.parametrize("mode", ["one_diag", "smart_one_diag", "all_diag"])
def test_psgd_memory_save_modes(mode):
    cfg = apply_overrides(run_preset("femto"), ["optim.name=psgd", "model.vocab_size=300",
                                                f"optim.memory_save_mode={mode}"])
    assert optimizer_state_bytes(meta_model(cfg), cfg.optim) == measured_state(cfg)


def test_shampoo_blocks_are_block_views():
    from optquant.optim.shampoo import block_views, shampoo_blocks

    for shape, cap in [((300, 32), 100), ((1, 4, 1, 1), 3), ((7,), 7), ((1,), 5), ((250, 250), 128)]:
        assert shampoo_blocks(shape, cap) == [tuple(b.shape) for b in block_views(torch.empty(shape), cap)]


def saved_bytes(cfg, micro: int, bf16: bool) -> int:
    """Bytes of the tensors autograd saves for backward (parameters excluded), one forward."""
    torch.manual_seed(0)
    model = LM(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (micro, cfg.model.seq_len))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        lm_loss(model, x, x)
    return sum(seen.values())


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("preset", ["micro", "tiny"])
def test_activation_estimate_near_saved_tensors(preset, bf16):
    cfg = apply_overrides(run_preset(preset), ["model.seq_len=64"])
    transient = 2 * cfg.model.seq_len * 4 * cfg.model.vocab_size  # the logits' gradient, not a saved tensor
    est, got = activation_bytes(cfg, 2, bf16) - transient, saved_bytes(cfg, 2, bf16)
    assert abs(est - got) <= 0.2 * got, (est, got)


def test_flops_tokens_and_memory_sum():
    cfg = apply_overrides(run_preset("nano"), ["train.steps=10", "model.tie_embeddings=false"])
    b = run_cost(cfg)
    m = cfg.model
    model = LM(m)
    n_matmul = count_params(model) - model.embed.weight.numel()  # the untied input embedding is a lookup
    tokens = 10 * cfg.train.batch_size * m.seq_len
    assert b.tokens == tokens and b.n_params == count_params(model)
    assert b.flops == 6 * n_matmul * tokens + 12 * m.n_layer * m.d_model * m.seq_len * tokens
    assert b.weights == b.grads == 4 * count_params(model)
    assert b.memory == b.weights + b.grads + b.state + b.activations
    hours = b.flops / (989e12 * 0.4) / 3600
    assert b.gpu_hours == pytest.approx(hours)


def test_warning_names_a_fix_that_fits():
    plan = GPUConfig(gpu="a10g")
    cfg = apply_overrides(run_preset("350m"), ["optim.name=adamw"])
    b = run_cost(cfg, plan)
    assert not b.fits and b.fix.startswith("train.grad_accum=")
    accum = int(b.fix.split("=")[1].split()[0])
    assert run_cost(apply_overrides(cfg, [f"train.grad_accum={accum}"]), plan).fits
    assert not run_cost(apply_overrides(cfg, [f"train.grad_accum={accum // 2}"]), plan).fits
    # PSGD at 1.5B with the cap above the vocabulary: a 4 GB vocabulary factor and 8192² MLP factors
    # that no micro-batch makes fit on 40 GB; a lower cap does
    psgd = apply_overrides(run_preset("1.5b"), ["optim.name=psgd", "optim.max_precondition_dim=40000"])
    b = run_cost(psgd, GPUConfig(gpu="a100-40gb"))
    assert not b.fits and b.fix.startswith("optim.max_precondition_dim="), b.fix
    cap = int(b.fix.split("=")[1].split()[0])
    fixed = apply_overrides(psgd, [f"optim.max_precondition_dim={cap}", f"train.grad_accum={b.fix.split('=')[-1]}"])
    assert run_cost(fixed, GPUConfig(gpu="a100-40gb")).fits
    for name in ("soap", "shampoo"):  # the one cap of every optimizer that has one, lowered the same way
        cfg = apply_overrides(run_preset("760m"), [f"optim.name={name}", "optim.max_precondition_dim=40000"])
        assert run_cost(cfg, GPUConfig(gpu="a100-40gb")).fix.startswith("optim.max_precondition_dim=20000 and ")


def test_plan_overrides_and_bad_gpu():
    plan, rest = split_gpu_overrides(["plan.gpu=a100", "plan.mfu=0.3", "optim.lr=1e-3"])
    assert plan == GPUConfig(gpu="a100", mfu=0.3) and rest == [("optim.lr", "1e-3")]
    with pytest.raises(OptquantError, match="plan.gpu=tpu"):
        split_gpu_overrides(["plan.gpu=tpu"])
    # the ranges in GPUConfig's annotations are checked as plan.* is set (config.set_field), a TOML value too
    for bad, message in ((["plan.mfu=2"], r"^plan.mfu=2.0: Expected `float` <= 1.0$"),
                         ([("plan.mfu", 0)], r"^plan.mfu=0.0: Expected `float` > 0.0$"),
                         (["plan.gpus_per_run=0"], r"^plan.gpus_per_run=0: Expected `int` >= 1$")):
        with pytest.raises(OptquantError, match=message):
            split_gpu_overrides(bad)


def test_stage_counts_follow_the_spec():
    spec = study_preset("cpu")
    by_name = {s.name.split(" (")[0]: s.jobs for s in stages(spec)}
    pairs, seeds = len(spec.optimizers) * len(spec.sizes), len(spec.seeds)
    assert by_name["fp sweep"] == pairs * spec.lr_points
    assert by_name["fp extensions"] == pairs * spec.lr_extensions
    assert by_name["fp seeds"] == pairs * (seeds - 1)
    assert by_name["common loss"] == pairs * seeds
    search = spec.lr_extensions + spec.lr_refine  # per 1-D search after its grid
    tied = len(spec.sizes) * 3  # Muon's AdamW group and Scion's embedding and vectors, at every size
    assert by_name["group lr searches"] == tied * (2 + search)  # a 3-point grid centred on a finished run
    again = len(spec.sizes) * 2 * (spec.lr_points - 1 + search)  # Muon's and Scion's LR once more, the same
    assert by_name["fp sweep again where a ratio moved"] == again
    fp_runs = pairs * (spec.lr_points + spec.lr_extensions + spec.lr_refine + seeds - 1) + again
    assert by_name["ptq + analysis"] == pairs * seeds * len(spec.ptq_schemes) + fp_runs * len(spec.sweep_ptq_schemes)
    assert by_name["qat"] == pairs * seeds * len(spec.qat_bits)
    assert "robust arm" not in by_name and "robust ptq" not in by_name  # no robust entries, no stage
    robust = {s.name.split(" (")[0]: s for s in stages(replace(spec, robust=("ema:0.9", "decay:0")))}
    assert robust["robust arm"].jobs == pairs * seeds * 2 and set(robust["robust arm"].train_runs.values()) == {6}
    # each seed's plain CL and final models and the 2 entries' (the plain CL models' PTQ read back, still jobs)
    assert robust["robust ptq"].jobs == pairs * seeds * 3 * (len(spec.ptq_schemes) + 1)


def test_cli_dry_runs(capsys):
    assert main(["study", "--preset", "paper", "--dry-run", "--set", "plan.gpu=a100"]) == 0
    out = capsys.readouterr().out
    assert "A100" in out and "GPU-h" in out and "1.5b" in out and "WARNING 1.5b" in out
    assert main(["train", "--preset", "nano", "--dry-run", "--set", "optim.name=soap"]) == 0
    assert "optimizer state" in capsys.readouterr().out
    assert main(["train", "--dry-run", "--set", "plan.gpu=tpu"]) == 2
    assert "plan.gpu=tpu" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_50m_paper_widths_train_and_match_the_planner(opt):
    """The `50m` preset (vocabulary 32000, the paper's caps of 12288): Shampoo blocks the vocabulary
    dimension, PSGD falls back to a diagonal factor for it, SOAP leaves it unpreconditioned. Two
    optimizer steps at a reduced batch and sequence length, finite, and the planner's state estimate."""
    cfg = apply_overrides(run_preset("50m"), [f"optim.name={opt}"])
    assert cfg.model.vocab_size == 32000
    torch.manual_seed(0)
    model = LM(cfg.model)
    before = model.blocks[0].mlp.inner.up_proj.weight.detach().clone()
    optimizers = build_optimizers(model, cfg.optim)
    for _ in range(2):
        x = torch.randint(0, cfg.model.vocab_size, (1, 32))
        loss = lm_loss(model, x, x)
        assert torch.isfinite(loss)
        loss.backward()
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(before, model.blocks[0].mlp.inner.up_proj.weight)  # SOAP moves on step 2
    got = state_bytes(optimizers)
    est = optimizer_state_bytes(meta_model(cfg), cfg.optim)
    assert abs(est - got) <= 0.05 * got, (est, got)


def test_1_5b_on_meta_counts_parameters_and_state():
    """The `1.5b` preset on the meta device: its parameter count and each optimizer's state in closed
    form (olmo2: q/k/v/o d×d, MLP 4d×d and d×4d, two gains per block, a final gain, a (1, H, 1, 1) QK
    scale per block, the tied V×d embedding; the paper's caps of 12288)."""
    cfg = apply_overrides(run_preset("1.5b"), [])
    m = cfg.model
    d, V, L, H = m.d_model, m.vocab_size, m.n_layer, m.n_head
    model = meta_model(cfg)
    n = V * d + L * (4 * d * d + 8 * d * d + 2 * d + H) + d
    assert count_params(model) == n and next(model.parameters()).is_meta
    n_tensors = 1 + L * (6 + 3) + 1
    vectors = L * (2 * d + H) + d

    def state(name: str, *over: str) -> int:
        return optimizer_state_bytes(model, apply_overrides(cfg, [f"optim.name={name}", *over]).optim)

    assert state("adamw") == 8 * n + 4 * n_tensors
    assert state("scion") == 4 * n
    assert state("muon") == 4 * (n - V * d - vectors) + 8 * (V * d + vectors) + 4 * (2 + 3 * L)
    per_layer_sq = 4 * 2 * d * d + 2 * (16 * d * d + d * d)  # Σ n² over the dims of the six matrices
    psgd = 4 * n + 4 * (V + d * d + L * (per_layer_sq + 2 * d + 3 + H * H) + d)
    assert state("psgd") == psgd
    soap = 8 * n + 8 * (d * d + L * (per_layer_sq + 3 + H * H))
    assert state("soap") == soap
    vocab_blocks = 2 * 12288**2 + (V - 2 * 12288) ** 2 + 3 * d * d
    shampoo = 8 * n + 8 * (vocab_blocks + L * (per_layer_sq + 2 * d * d + H * H) + d * d)
    assert state("shampoo") == shampoo
    assert state("psgd", "optim.max_precondition_dim=40000") == psgd + 4 * (V * V - V)

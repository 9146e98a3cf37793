"""Optimizer registry tests.

Strategy: one contract test (`check_contract`, which tests/test_new_optimizer.py runs on an optimizer
written there) per registered optimizer on the `nano` LM with a learnable token stream
(a fixed random cycle over 64 tokens, so the next token is a function of the current one): the loss
falls and stays finite at the default lr, and a second run saved at step 15 (state dict → safetensors
+ JSON, the way the training loop checkpoints) and resumed in a fresh model + optimizer is bitwise
equal at step 30 to the first run (so two runs are bitwise equal too: nondeterminism would show there).
Then reference tests: fused AdamW = foreach AdamW; our Muon step = a Muon written here from paper.md §3,
and with `ns_dtype=bf16` bitwise `torch.optim.Muon`; NS5's singular values lie in the band its quintic
gives; SOAP, Kron and Scion wrappers = direct library calls with the authors' arguments (Scion's
Newton–Schulz in bf16, as the library's); in fp32 Newton–Schulz follows the fp64 iteration ~1000× closer
than bf16; `ns_dtype=auto` follows the CPU's bf16 capability (monkeypatched) and the run summary records
the dtype. The optimizers written here keep torch's `step(closure)` contract and refuse complex parameters
in one line. Shampoo's closed forms are in test_shampoo.py. One torch thread: the machine's cores are shared.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from pytorch_optimizer import SCION, SOAP
from pytorch_optimizer import Kron as LibKron
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import optquant.device
from optquant.config import apply_overrides
from optquant.device import use_bf16
from optquant.errors import OptquantError
from optquant.model import LM, lm_loss, model_config
from optquant.optim import (
    OPTIMIZERS,
    AdamWConfig,
    MuonConfig,
    ParamGroups,
    PSGDConfig,
    ScionConfig,
    SOAPConfig,
    build_optimizers,
    ns_dtype,
    split_params,
    state_bytes,
)
from optquant.optim.newton_schulz import newton_schulz, newton_schulz_many
from optquant.optim.psgd import kron_step_seed
from optquant.optim.scion import Scion
from optquant.train import train as train_run

VOCAB, T, B = 64, 16, 8


def new_model(seed: int = 0) -> LM:
    torch.manual_seed(seed)
    return LM(model_config("micro", vocab_size=VOCAB, seq_len=T))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    cycle = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(123))
    start = torch.randint(0, VOCAB, (B, 1), generator=torch.Generator().manual_seed(step))
    idx = cycle[(start + torch.arange(T + 1)) % VOCAB]
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 10)  # a warm-up, so resumed runs must apply base_lr correctly


def train(model: LM, opts: list, steps: range) -> list[float]:
    losses = []
    for step in steps:
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * schedule(step)
        loss = lm_loss(model, *batch(step))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _no_objects(value):
    raise TypeError(f"state holds a {type(value).__name__}, which JSON cannot store")


def checkpoint_roundtrip(state_dict: dict) -> dict:
    """Tensors through safetensors, everything else through JSON (tuples come back as lists)."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(value):
        if isinstance(value, torch.Tensor):
            tensors[f"t{len(tensors)}"] = value.contiguous()
            return {"__tensor__": f"t{len(tensors) - 1}"}
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [strip(v) for v in value]
        return value

    meta = json.dumps(strip(state_dict), default=_no_objects)
    loaded = st_load(st_save(tensors))

    def fill(value):
        if isinstance(value, dict):
            return loaded[value["__tensor__"]] if "__tensor__" in value else {k: fill(v) for k, v in value.items()}
        return [fill(v) for v in value] if isinstance(value, list) else value

    restored = fill(json.loads(meta))
    restored["state"] = {int(k): v for k, v in restored["state"].items()}  # JSON keys are strings
    return restored


def params(model: LM) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def check_contract(cfg) -> None:
    """The contract of an optimizer config (optim/__init__.py), on the nano LM: the loss falls and stays
    finite, the state is tensors, and a run resumed from a JSON + safetensors checkpoint is bitwise the same."""
    straight = new_model()
    opts = build_optimizers(straight, cfg)
    losses = train(straight, opts, range(30))  # spans Shampoo's first roots (20), SOAP's QR (10, 20)
    at_30 = params(straight)
    losses += train(straight, opts, range(30, 100))
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses[::10]
    assert all(torch.isfinite(p).all() for p in straight.parameters())
    assert state_bytes(opts) > 0

    first = new_model()
    first_opts = build_optimizers(first, cfg)
    train(first, first_opts, range(15))
    saved = [checkpoint_roundtrip(opt.state_dict()) for opt in first_opts]
    resumed = new_model(seed=1)  # a different init: everything must come from the checkpoint
    resumed.load_state_dict(first.state_dict())
    resumed_opts = build_optimizers(resumed, cfg)
    for opt, sd in zip(resumed_opts, saved, strict=True):
        opt.load_state_dict(sd)
    train(resumed, resumed_opts, range(15, 30))
    assert all(torch.equal(a, b) for a, b in zip(at_30, params(resumed), strict=True))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_contract_loss_falls_and_resumes_bitwise(name):
    check_contract(OPTIMIZERS[name]())


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_contract_no_nan_over_hundreds_of_steps(name):
    model = new_model()
    losses = train(model, build_optimizers(model, OPTIMIZERS[name]()), range(400))
    assert all(math.isfinite(x) for x in losses) and np.mean(losses[-10:]) < 0.1


def test_registry_names_and_groups():
    for name, cls in OPTIMIZERS.items():
        cfg = cls()
        assert cfg.name == name and cfg.lr > 0
    model = new_model()
    groups = split_params(model)
    assert groups.embeddings == [model.embed.weight]  # the tied head is the same tensor
    assert all(p.ndim == 2 for p in groups.matrices) and all(p.ndim != 2 for p in groups.vectors)
    groups_of = {name: build_optimizers(model, cls()) for name, cls in OPTIMIZERS.items()}
    assert [type(o).__name__ for o in groups_of["muon"]] == ["Muon", "AdamW"]
    adam = groups_of["muon"][1].param_groups
    assert all(g["lr"] == g["base_lr"] == 3e-3 and g["betas"] == (0.9, 0.95) and g["eps"] == 1e-6 for g in adam)
    assert groups_of["muon"][0].param_groups[0]["weight_decay"] == 0.0  # not torch's default 0.1
    scion = groups_of["scion"][0].param_groups
    assert [(g["lr"], g["norm_type"]) for g in scion] == [(1.0, 4), (3e-3, 8), (50 * 2**-12, 2)]
    assert all(g["constraint"] is False and g["momentum"] == pytest.approx(0.1) for g in scion)


def same_grads(models: list[LM], step: int) -> None:
    for m in models:
        lm_loss(m, *batch(step)).backward()


def test_adamw_fused_equals_foreach():
    ours, ref = new_model(), new_model()
    opt = build_optimizers(ours, AdamWConfig(weight_decay=0.1))[0]
    assert opt.param_groups[0]["fused"]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    start = params(ours)
    for step in range(10):
        same_grads([ours, ref], step)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for a, b, a0 in zip(params(ours), params(ref), start, strict=True):
        # kernels round differently, nothing more: within 1e-5 of the update, or a few ulps of a parameter that
        # barely moved (the QK scales of ~5.66 move by 4e-3 in 10 steps; one fp32 ulp there is 4.8e-7, which
        # AVX512's fused kernel and the foreach one differ by)
        ulps = 4 * torch.finfo(a.dtype).eps * a.norm()
        assert (a - b).norm() <= 1e-5 * (a - a0).norm() + ulps


def newton_schulz5(G: torch.Tensor) -> torch.Tensor:
    """paper.md §3: X = G/‖G‖_F, then 5 × X ← aX + b(XXᵀ)X + c(XXᵀ)²X (on the wide side). In fp64: the
    exact math, which Muon's bf16 iteration follows to about 1.5% (bf16 rounding compounded 5 times)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return (X.T if tall else X).float()


def paper_muon_step(W, g, m, lr, beta=0.95, nesterov=True, scaled=True):
    m.mul_(beta).add_(g, alpha=1 - beta)
    u = (1 - beta) * g + beta * m if nesterov else m
    scale = math.sqrt(max(1.0, W.shape[0] / W.shape[1])) if scaled else 1.0
    return W - lr * scale * newton_schulz5(u)


@pytest.mark.parametrize("ns", [("bf16", 3e-2), ("fp32", 3e-5)])  # (dtype, bound on the error from rounding)
@pytest.mark.parametrize("shape", [(256, 64), (64, 64), (64, 256)])
def test_muon_equals_paper_reference(shape, ns):
    dtype, bound = ns
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(shape) * 0.02)
    opt = MuonConfig(ns_dtype=dtype).build(ParamGroups([], [], [W]))[0]
    variants = {"paper": (True, True), "no_nesterov": (False, True), "unscaled": (True, False)}
    refs = {k: (W.detach().clone(), torch.zeros(shape)) for k in variants}
    errors = {k: 0.0 for k in variants}
    for step in range(6):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(step))
        W.grad = g.clone()
        before = W.detach().clone()
        opt.step()
        for k, (nesterov, scaled) in variants.items():
            w_ref, m = refs[k]
            new = paper_muon_step(before, g, m, lr=3e-2, nesterov=nesterov, scaled=scaled)
            errors[k] = max(errors[k], ((W.detach() - new).norm() / (new - before).norm()).item())
    assert errors["paper"] < bound, errors  # rounding only
    assert errors["no_nesterov"] > 0.1
    if shape[0] > shape[1]:
        assert errors["unscaled"] > 0.3


def test_ns5_singular_values_in_quintic_band():
    gen = torch.Generator().manual_seed(0)
    for m, n in [(64, 64), (256, 64), (64, 256), (128, 96)]:
        k = min(m, n)
        U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen))
        V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen))
        G = U @ torch.diag(torch.logspace(-1.3, 0, k)) @ V.T  # condition number 20
        W = torch.nn.Parameter(torch.zeros(m, n))
        opt = MuonConfig(momentum=0.0, lr=1.0).build(ParamGroups([], [], [W]))[0]
        W.grad = G
        opt.step()
        S = torch.linalg.svdvals(-W.detach() / math.sqrt(max(1, m / n)))
        # 5 steps of x ↦ 3.4445x − 4.7750x³ + 2.0315x⁵ map (0.0015, 1] into [0.68, 1.20]; bf16 adds ~1%
        assert 0.65 < S.min() and S.max() < 1.23, (m, n, S.min(), S.max())


def clone_pair(seed: int = 0) -> tuple[LM, LM]:
    return new_model(seed), new_model(seed)


def authors_groups(model: LM) -> tuple[list, list]:
    g = split_params(model)
    return g.embeddings + g.vectors, g.matrices


def run_pair(ours, ours_opts, ref, ref_step, steps: int) -> None:
    for step in range(steps):
        same_grads([ours, ref], step)
        for opt in ours_opts:
            opt.step()
            opt.zero_grad()
        ref_step(step)
    for a, b in zip(params(ours), params(ref), strict=True):
        assert torch.equal(a, b)


def test_soap_equals_library_call():
    ours, ref = clone_pair()
    opts = build_optimizers(ours, SOAPConfig(weight_decay=0.01))
    lib = SOAP(
        [{"params": p} for p in authors_groups(ref)],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.01,
        precondition_frequency=10,
        max_precondition_dim=12288,
        precondition_1d=False,
        correct_bias=True,
    )
    run_pair(ours, opts, ref, lambda _: (lib.step(), lib.zero_grad()), steps=22)


def test_kron_equals_library_call_and_keeps_global_rng():
    ours, ref = clone_pair()
    opts = build_optimizers(ours, PSGDConfig(seed=7, balance_prob=0.5))  # balance often, to exercise numpy
    lib = LibKron(
        [{"params": p} for p in authors_groups(ref)],
        lr=1e-3,
        momentum=0.9,
        weight_decay=0.0,
        weight_decouple=True,
        max_size_triangular=12288,
        min_ndim_triangular=2,
        memory_save_mode=None,
        balance_prob=0.5,
    )

    def ref_step(step):  # the library reads the global RNGs; give them the wrapper's stream
        torch.manual_seed(kron_step_seed(7, step))
        np.random.seed([7, step])
        lib.step()
        lib.zero_grad()

    run_pair(ours, opts, ref, ref_step, steps=12)


def test_kron_leaves_global_rng_alone():
    model = new_model()
    opt = build_optimizers(model, PSGDConfig(balance_prob=1.0))[0]
    same_grads([model], 0)
    torch.manual_seed(99)
    np.random.seed(99)
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()
    opt.step()  # draws from numpy (balance) and torch (probe vectors), privately
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.random.get_state()[1].tolist() == np_state[1].tolist()


def test_scion_equals_library_call():
    ours, ref = clone_pair()
    opts = build_optimizers(ours, ScionConfig(weight_decay=0.01, ns_dtype="bf16"))
    g = split_params(ref)
    common = dict(momentum=0.1, constraint=False, scale=1.0, weight_decay=0.01, weight_decouple=True)
    lib = SCION(
        [
            {"params": g.embeddings, "lr": 1.0, "norm_type": 4},
            {"params": g.matrices, "lr": 50 * 2**-12, "norm_type": 2},
        ],
        **common,
    )
    moments = [torch.zeros_like(p) for p in g.vectors]

    def ref_step(step):
        lib.step()
        with torch.no_grad():  # gains: d ← (1−α)d + αg; W ← W(1 − lr·λ) − lr·sign(d)
            for p, d in zip(g.vectors, moments, strict=True):
                d.lerp_(p.grad, 0.1)
                p.mul_(1 - 3e-3 * 0.01).add_(torch.sign(d), alpha=-3e-3)
        ref.zero_grad()

    run_pair(ours, opts, ref, ref_step, steps=8)


def test_scion_identity_vectors_equal_upstream_norm_type_8():
    ours, ref = clone_pair()
    opts = build_optimizers(ours, ScionConfig(vector_lmo="identity", ns_dtype="bf16"))
    g = split_params(ref)
    lib = SCION(
        [
            {"params": g.embeddings, "lr": 1.0, "norm_type": 4},
            {"params": g.vectors, "lr": 3e-3, "norm_type": 8},  # the authors' call, upstream library
            {"params": g.matrices, "lr": 50 * 2**-12, "norm_type": 2},
        ],
        momentum=0.1,
        constraint=False,
    )
    run_pair(ours, opts, ref, lambda _: (lib.step(), lib.zero_grad()), steps=5)


def test_state_bytes_counts_moments():
    model = new_model()
    opts = build_optimizers(model, AdamWConfig())
    same_grads([model], 0)
    opts[0].step()
    n = sum(p.numel() for p in model.parameters())  # the tied weight once
    assert state_bytes(opts) == 2 * 4 * n + 4 * len(list(model.parameters()))  # m, v, and a step each


@pytest.mark.parametrize("kw", [{}, {"nesterov": False, "adjust_lr": "match_rms_adamw", "weight_decay": 0.1}])
def test_muon_bf16_equals_torch_muon(kw):
    ours, ref = clone_pair()  # micro: 64×64, 256×64 (tall) and 64×256 (wide) matrices
    cfg = MuonConfig(ns_dtype="bf16", **kw)
    opts = build_optimizers(ours, cfg)
    g = split_params(ref)
    muon = torch.optim.Muon(g.matrices, lr=3e-2, weight_decay=cfg.weight_decay, momentum=0.95,
                            nesterov=cfg.nesterov, adjust_lr_fn=cfg.adjust_lr)
    adamw = torch.optim.AdamW([{"params": g.embeddings}, {"params": g.vectors}], lr=3e-3, betas=(0.9, 0.95),
                              eps=1e-6, weight_decay=cfg.weight_decay, fused=True)
    run_pair(ours, opts, ref, lambda _: (muon.step(), adamw.step(), ref.zero_grad()), steps=8)


@pytest.mark.parametrize("foreach", [None, False])  # the library's batched and per-parameter paths
def test_scion_bf16_newton_schulz_equals_library_on_any_shape(foreach):
    shapes = [(48, 48), (48, 48), (192, 48), (48, 192), (33, 7)]
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.05, momentum=0.1, constraint=False, foreach=foreach)
    opt = Scion([{"params": ours, "norm_type": 2}], ns_dtype="bf16", **kw)
    lib = SCION([{"params": ref, "norm_type": 2}], **kw)
    for step in range(5):
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn(a.shape, generator=gen) * 10.0 ** (step - 2)
            b.grad = a.grad.clone()
        opt.step(), lib.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


def test_fp32_newton_schulz_follows_the_exact_iteration():
    gen = torch.Generator().manual_seed(0)
    for shape in [(64, 64), (256, 64), (64, 256)]:
        G = torch.randn(shape, generator=gen)
        exact = newton_schulz5(G).double()
        err = {d: ((newton_schulz(G, 5, t).double() - exact).norm() / exact.norm()).item()
               for d, t in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
        assert err["fp32"] < 1e-5 and err["bf16"] > 1e-3, err
        assert newton_schulz(G, 5, torch.float32).dtype == torch.float32


def test_scion_fp32_spectral_step_is_fp32_newton_schulz():
    W = torch.nn.Parameter(torch.randn(256, 64) * 0.02)
    start = W.detach().clone()
    (opt,) = ScionConfig(ns_dtype="fp32").build(ParamGroups([], [], [W]))
    W.grad = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    opt.step()  # d = α·g; W ← W − lr·√(d_out/d_in)·NS(d)
    expected = start.double() - 50 * 2**-12 * 2.0 * newton_schulz5(0.1 * W.grad).double()
    assert ((W.detach().double() - expected).norm() / (expected - start).norm()).item() < 1e-5


@pytest.mark.parametrize("flags", [{"avx2", "avx512_bf16"}, {"avx2", "amx_bf16"}, {"avx2"}, set()])
def test_auto_follows_the_cpus_bf16_capability(monkeypatch, flags):
    monkeypatch.setattr(optquant.device, "cpu_flags", lambda: flags)
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    cpu = torch.device("cpu")
    assert use_bf16("auto", cpu) is native  # the rule of train.precision=auto
    assert use_bf16("bf16", cpu) and not use_bf16("fp32", cpu)  # explicit settings ignore the hardware
    model = new_model()
    for cls in (MuonConfig, ScionConfig):
        assert ns_dtype(build_optimizers(model, cls())) == ("bf16" if native else "fp32")
        assert ns_dtype(build_optimizers(model, cls(ns_dtype="bf16"))) == "bf16"
        assert ns_dtype(build_optimizers(model, cls(ns_dtype="fp32"))) == "fp32"
    assert ns_dtype(build_optimizers(model, AdamWConfig())) is None


@pytest.mark.parametrize("supported", [True, False])
def test_auto_on_cuda_asks_torch(monkeypatch, supported):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    monkeypatch.setattr(optquant.device, "cpu_flags", lambda: {"avx512_bf16"})  # must not be consulted
    assert use_bf16("auto", torch.device("cuda")) is supported


def test_bad_ns_dtype_is_a_clear_error():
    with pytest.raises(OptquantError, match="ns_dtype"):
        MuonConfig(ns_dtype="fp16").build(ParamGroups([], [], [torch.nn.Parameter(torch.zeros(4, 4))]))


@pytest.mark.parametrize("name, dtype", [("muon", "fp32"), ("scion", "bf16"), ("adamw", None)])
def test_summary_records_the_newton_schulz_dtype(nano_cfg, tmp_path, name, dtype):
    sets = [f"optim.name={name}", "train.steps=2", "train.eval_every=2"]
    cfg = apply_overrides(nano_cfg, sets + ([f"optim.ns_dtype={dtype}"] if dtype else []))
    summary = train_run(cfg, tmp_path / "run")
    assert summary["ns_dtype"] == dtype
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["ns_dtype"] == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_newton_schulz_equals_one_call_per_matrix(dtype):
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(s, generator=gen) for s in [(48, 48)] * 3 + [(192, 48)] * 2 + [(48, 192), (33, 7)]]
    for layout in (torch.preserve_format, torch.contiguous_format):
        stacked = newton_schulz_many(mats, 5, dtype, memory_format=layout)
        assert all(torch.equal(a, newton_schulz(m, 5, dtype, memory_format=layout))
                   for a, m in zip(stacked, mats, strict=True))


@pytest.mark.parametrize("name", ["muon", "psgd", "shampoo"])
def test_step_with_closure_returns_its_loss_computed_with_grad(name):
    model = new_model()
    opts = build_optimizers(model, OPTIMIZERS[name]())
    seen = []

    def closure():
        for opt in opts:
            opt.zero_grad()
        loss = lm_loss(model, *batch(0))
        loss.backward()  # fails if the step ran the closure under its own no_grad
        seen.append(loss)
        return loss

    assert opts[0].step(closure) is seen[0] and len(seen) == 1


def test_complex_parameters_are_refused_in_one_line():
    from optquant.optim.muon import Muon
    from optquant.optim.shampoo import Shampoo

    for cls in (Muon, Shampoo):
        p = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.complex64))
        p.grad = torch.ones_like(p)
        with pytest.raises(OptquantError, match=f"{cls.__name__} supports dense real parameters only"):
            cls([p]).step()

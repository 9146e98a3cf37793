"""A per-module bit plan: the bits of each quantized linear at an average budget (issue 31), its scores, and its
export to the tools people deploy with (an llm-compressor recipe, a torchao snippet).

The rule. Linear m has n_m weights and gets b_m from `choices`; the plan's average Σ n_m b_m / Σ n_m must not
exceed `avg_bits`. Each (m, b) has a gain g_m(b), the damage removed by running m at b instead of the lowest
choice b₀ (g_m(b₀) = 0). `solve` maximizes Σ g_m(b_m) under the budget exactly: a multiple-choice knapsack by
dynamic programming over the budget in units of the gcd of the costs n_m (b − b₀); among plans of equal gain
it takes the one that uses more of the budget (the exact final fill). Only when the table would exceed
MAX_CELLS is the unit coarsened (costs rounded up: the budget still holds, the optimum may not).

The decomposition's score (`abc_gains`, the default), from one ABC walk with every linear at b₀ (§7). With
A_ℓ = G_ℓ R_in,ℓ and R_in,ℓ = R_{ℓ−1}, R_ℓ = G_ℓ R_{ℓ−1} + B_ℓ + C_ℓ telescopes to
    R_L = Σ_ℓ (B_ℓ + C_ℓ) Π_{k>ℓ} G_k,
each chain module's added error carried to the logits by the gains downstream (token norm, exact). A module's
share is split among its linears in proportion to their own B (tensor norm, the linear rows); a negative
share counts as 0. Moving a linear from b₀ to b removes the fraction 1 − (q(b₀)/q(b))² of it, q(b) = 2^(b−1) − 1
the integer grid's largest level (the rounding error's power goes as the step²; 16 bits removes all of it).
That is an estimate from the one walk at b₀, not a re-measurement at b.

The measured oracle (`measured_gains`): g_m(b) = damage(all at b₀) − damage(all at b₀ but m at b), one
damage evaluation per (module, higher choice), then the same knapsack. Exact when the damages add up.

The standard alternatives, for comparison (`perturbation_gains`): HAWQ-v2's (arXiv 1911.03852) Ω_m = tr(H_m)/n_m ·
‖Q(W_m) − W_m‖², H_m the loss Hessian's diagonal block of W_m, its trace by Hutchinson's estimator E[vᵀHv] over
Rademacher v (`hessian_traces`); and the empirical Fisher's, tr(F_m) = the mean over samples of ‖∇_m ℓ‖² in place
of tr(H_m) (`fisher_traces`). The gain of b is Ω_m(b₀) − Ω_m(b); Q is the weights' RTN at each bit width (the
activations, and GPTQ's updates, are not in these scores, as in HAWQ).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from fractions import Fraction
from functools import reduce

import numpy as np
import torch
from torch import Tensor

from optquant.errors import OptquantError
from optquant.quant.layers import model_name
from optquant.quant.primitives import OFF, QuantSpec, fake_quant

MAX_CELLS = 20_000_000  # knapsack table cells (modules × budget units) before the unit is coarsened


def check_choices(choices: Iterable[int], fmt: str = "int") -> tuple[int, ...]:
    out = tuple(sorted(set(choices)))
    bad = [b for b in out if type(b) is not int or not 2 <= b <= OFF or (fmt != "int" and b not in (4, OFF))]
    if len(out) < 2 or bad:
        raise OptquantError(f"bits: choices {list(choices)} must be two or more of 2..16 (16 = FP; 4 or 16 for "
                            f"{fmt}){f', not {bad[0]}' if bad else ''}")
    return out


def budget_units(params: dict[str, int], avg_bits: float, choices: tuple[int, ...]) -> Fraction:
    """Σ n_m (avg − b₀): the weight-bits a plan may add over all at b₀; an impossible average is an error."""
    avg = Fraction(str(avg_bits)) if math.isfinite(avg_bits) else Fraction(-1)
    if not choices[0] <= avg <= choices[-1]:
        raise OptquantError(f"bits: --avg-bits {avg_bits} is impossible with choices {list(choices)}: it must lie "
                            f"in [{choices[0]}, {choices[-1]}]")
    return avg * sum(params.values()) - choices[0] * sum(params.values())


def solve(params: dict[str, int], gains: dict[str, dict[int, float]], avg_bits: float,
          choices: Iterable[int]) -> dict[str, int]:
    """The bits of each module maximizing Σ gains under the average (see the module docstring)."""
    choices = check_choices(choices)
    budget, names, b0 = budget_units(params, avg_bits, choices), list(params), choices[0]
    costs = {m: {b: params[m] * (b - b0) for b in choices} for m in names}
    unit = reduce(math.gcd, (c for cs in costs.values() for c in cs.values() if c), 0) or 1
    cap = int(budget // unit)
    if len(names) * (cap + 1) > MAX_CELLS:
        scale = math.ceil(len(names) * (cap + 1) / MAX_CELLS)
        unit, cap = unit * scale, int(budget // (unit * scale))
    best = np.full(cap + 1, -np.inf)  # best[c]: the largest gain using exactly c units
    best[0] = 0.0
    pick = np.zeros((len(names), cap + 1), dtype=np.int8)
    for i, m in enumerate(names):
        new = best.copy()  # b₀: no cost, no gain
        for j, b in enumerate(choices[1:], start=1):
            c = -(-costs[m][b] // unit)
            if c > cap:
                continue
            cand = np.full(cap + 1, -np.inf)
            cand[c:] = best[: cap + 1 - c] + gains[m].get(b, 0.0)
            better = cand > new
            new[better], pick[i, better] = cand[better], j
        best = new
    c = int(max(np.flatnonzero(best == best.max())))  # the largest gain, then the fullest budget
    plan = {}
    for i in range(len(names) - 1, -1, -1):
        b = choices[pick[i, c]]
        plan[names[i]] = b
        c -= -(-costs[names[i]][b] // unit)
    return {m: plan[m] for m in names}


def error_fraction(b0: int, b: int) -> float:
    """1 − (q(b₀)/q(b))²: the share of b₀'s rounding-error power that b bits remove."""
    return 1.0 if b >= OFF else 1.0 - ((2 ** (b0 - 1) - 1) / (2 ** (b - 1) - 1)) ** 2


def abc_gains(rows: Iterable, linears: Iterable[str], choices: Iterable[int]) -> dict[str, dict[int, float]]:
    """Each linear's gains from ABC rows (metrics.propagation.ABCRow, granularity="linear") of a walk at b₀."""
    rows, choices = list(rows), check_choices(choices)
    chain = [r for r in rows if r.norm == "token" and r.kind != "linear"]
    gain = [0.0 if not math.isfinite(r.G) else r.G for r in chain]
    down = [math.prod(gain[i + 1 :]) for i in range(len(chain))]  # Π_{k>ℓ} G_k
    share = {r.index: max(r.B + r.C, 0.0) * d for r, d in zip(chain, down, strict=True)}
    own = {model_name(r.name): (r.index, max(r.B, 0.0)) for r in rows if r.norm == "tensor" and r.kind == "linear"}
    missing = sorted(n for n in linears if model_name(n) not in own)
    if missing:
        raise OptquantError(f"bits: the ABC walk has no linear row for {missing[0]} (walk with granularity=linear)")
    per_module = {}
    for idx in {i for i, _ in own.values()}:
        total = sum(b for i, b in own.values() if i == idx)
        per_module |= {n: share.get(idx, 0.0) * (b / total if total else 0.0) for n, (i, b) in own.items() if i == idx}
    return {n: {b: per_module[model_name(n)] * error_fraction(choices[0], b) for b in choices} for n in linears}


def measured_gains(linears: Iterable[str], choices: Iterable[int],
                   damage: Callable[[dict[str, int]], float]) -> dict[str, dict[int, float]]:
    """The oracle's gains: `damage(plan)` of every plan with one module above b₀ against all at b₀."""
    linears, choices = list(linears), check_choices(choices)
    low = {n: choices[0] for n in linears}
    base = damage(low)
    return {n: {choices[0]: 0.0, **{b: base - damage(low | {n: b}) for b in choices[1:]}} for n in linears}


def hessian_traces(loss_of: Callable[[object], Tensor], batches: Iterable, weights: dict[str, Tensor],
                   samples: int = 4, seed: int = 0) -> dict[str, float]:
    """tr(H_m) of each weight's block of the Hessian of the mean loss over `batches`, by Hutchinson's estimator:
    one Rademacher v over all weights per sample (the cross-block terms of vᵀHv have mean 0), `samples` per batch.
    `loss_of` runs in math attention (the fused CPU kernel has no double backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen, names, acc, n = torch.Generator().manual_seed(seed), list(weights), dict.fromkeys(weights, 0.0), 0
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        for batch in batches:
            grads = torch.autograd.grad(loss_of(batch), [weights[m] for m in names], create_graph=True)
            for _ in range(samples):
                vs = [torch.randint(0, 2, w.shape, generator=gen).to(w) * 2 - 1 for w in grads]
                hvs = torch.autograd.grad(grads, [weights[m] for m in names], grad_outputs=vs, retain_graph=True)
                for m, v, hv in zip(names, vs, hvs, strict=True):
                    acc[m] += (v * hv).sum().item()
            n += samples
    if not n:
        raise OptquantError("bits: no batches for the Hessian trace")
    return {m: a / n for m, a in acc.items()}


def fisher_traces(loss_of: Callable[[object], Tensor], samples: Iterable,
                  weights: dict[str, Tensor]) -> dict[str, float]:
    """tr(F_m) of the empirical Fisher: the mean over `samples` of ‖∇_{W_m} loss_of(sample)‖²."""
    acc, n = dict.fromkeys(weights, 0.0), 0
    with torch.enable_grad():
        for sample in samples:
            grads = torch.autograd.grad(loss_of(sample), list(weights.values()))
            for m, g in zip(weights, grads, strict=True):
                acc[m] += g.double().square().sum().item()
            n += 1
    if not n:
        raise OptquantError("bits: no samples for the Fisher trace")
    return {m: a / n for m, a in acc.items()}


def perturbation_gains(traces: dict[str, float], weights: dict[str, Tensor], spec_of: Callable[[int], QuantSpec | None],
                       choices: Iterable[int]) -> dict[str, dict[int, float]]:
    """HAWQ-v2's gains: g_m(b) = tr_m/n_m · (‖Q_{b₀}(W) − W‖² − ‖Q_b(W) − W‖²), Q_b the RTN of `spec_of(b)`
    (None: FP, no error)."""
    choices = check_choices(choices)

    def err(w: Tensor, b: int) -> float:
        spec = spec_of(b)
        return 0.0 if spec is None else (fake_quant(w.detach(), spec) - w.detach()).double().square().sum().item()

    out = {}
    for m, w in weights.items():
        errs = {b: err(w, b) for b in choices}
        out[m] = {b: traces[m] / w.numel() * (errs[choices[0]] - errs[b]) for b in choices}
    return out


def average_bits(plan: dict[str, int], params: dict[str, int]) -> Fraction:
    return Fraction(sum(params[m] * b for m, b in plan.items()), sum(params[m] for m in plan))


def plan_record(plan: dict[str, int], params: dict[str, int], gains: dict[str, dict[int, float]], ptq: dict,
                avg_bits: float, choices: Iterable[int], score: str) -> dict:
    """The plan as plan.json holds it."""
    return {"ptq": ptq, "choices": list(check_choices(choices)), "avg_bits": avg_bits,
            "plan_avg_bits": float(average_bits(plan, params)), "score": score,
            "modules": {m: {"bits": b, "params": params[m], "gain": gains[m].get(b, 0.0),
                          "gains": {str(c): gains[m].get(c, 0.0) for c in check_choices(choices)}}
                      for m, b in plan.items()}}


def check_record(record, where: str) -> tuple[dict, tuple[int, ...], dict[str, int]]:
    """(the scheme's fields, the choices, the bits per module) of a plan.json record, or one error line."""
    if not isinstance(record, dict) or not isinstance(record.get("modules"), dict) or not isinstance(
            record.get("ptq"), dict) or not isinstance(record.get("choices"), list):
        raise OptquantError(f"{where}: not a bit plan (a JSON object with ptq, choices, modules: optquant bits)")
    choices = check_choices(record["choices"], record["ptq"].get("format", "int"))
    bits = {}
    for m, v in record["modules"].items():
        b = v.get("bits") if isinstance(v, dict) else None
        if b not in choices or type(b) is not int:
            raise OptquantError(f"{where}: module {m} has bits {b!r}, not one of the plan's choices {list(choices)}")
        bits[m] = b
    return record["ptq"], choices, bits


def hf_names(bits: dict[str, int]) -> dict[str, str]:
    """Our module names (and optquant.hf's, which read like ours) under Hugging Face Llama-family names."""
    subs = ((r"^blocks\.(\d+)\.attn\.inner\.", r"model.layers.\1.self_attn."),
            (r"^blocks\.(\d+)\.mlp\.inner\.", r"model.layers.\1.mlp."))
    return {m: reduce(lambda n, s: re.sub(*s, n), subs, m) for m in bits}


def yaml_text(recipe: dict) -> str:
    """The recipe as YAML: JSON is YAML (1.2), so llm-compressor reads it and no YAML writer is needed."""
    return json.dumps(recipe, indent=2) + "\n"


def _group(bits: int, targets: list[str], a_bits: int, grid: str, group_size: int) -> dict:
    quant = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group" if group_size else "channel",
             "dynamic": False, **({"group_size": group_size} if group_size else {})}
    acts = None if a_bits >= OFF else {"num_bits": max(bits, a_bits), "type": "int", "symmetric": True,
                                       "strategy": "token", "dynamic": True}
    return {"targets": [f"re:^{t.replace('.', '[.]')}$" for t in targets], "weights": quant,
            "input_activations": acts}


def _by_bits(bits: dict[str, int], names: dict[str, str] | None) -> dict[int, list[str]]:
    """{bits: the quantized modules' exported names, sorted} per bit width below 16, widths ascending."""
    return {b: sorted((names or {}).get(m, m) for m, x in bits.items() if x == b) for b in sorted(set(bits.values()))
            if b < OFF}


def llmcompressor_recipe(bits: dict[str, int], ptq: dict, names: dict[str, str] | None = None) -> dict:
    """An llm-compressor recipe (as the dict of its YAML): one config group per bit width, targets the modules'
    names (`names` maps ours to the exported model's, e.g. optquant.hf.export), GPTQ or RTN (QuantizationModifier).
    Weights symmetric int per channel (or group); activations, when quantized, dynamic per token. Modules at
    16 bits are left out (llm-compressor leaves unmatched linears in FP), as is the head (`ignore`)."""
    groups = {f"group_w{b}": _group(b, ts, ptq.get("a_bits", OFF), ptq.get("grid", "sym"), ptq.get("w_group_size", 0))
              for b, ts in _by_bits(bits, names).items()}
    modifier = "GPTQModifier" if ptq.get("method") == "gptq" else "QuantizationModifier"
    return {"quant_stage": {"quant_modifiers": {modifier: {"ignore": ["lm_head"], "config_groups": groups}}}}


def torchao_snippet(bits: dict[str, int], names: dict[str, str] | None = None) -> str:
    """Python that applies the plan's weight bits with torchao's quantize_ and a filter_fn per bit width: weights
    only, on --grid full's scales (torchao rounds a row's −absmax to −7, not −8: tests/test_bit_plan.py)."""
    lines = ["from torchao.quantization import quantize_, Int8WeightOnlyConfig, IntxWeightOnlyConfig",
             "from torchao.quantization.granularity import PerAxis", "import torch", "", "PLAN = {"]
    lines += [f"    {b}: {ts!r}," for b, ts in _by_bits(bits, names).items()]
    lines += ["}", "", "def apply_plan(model):", "    for bits, names in PLAN.items():",
              "        config = Int8WeightOnlyConfig() if bits == 8 else IntxWeightOnlyConfig(",
              "            weight_dtype=getattr(torch, f'int{bits}'), granularity=PerAxis(0))",
              "        quantize_(model, config, filter_fn=lambda m, fqn, names=set(names): fqn in names)",
              "    return model", ""]
    return "\n".join(lines)

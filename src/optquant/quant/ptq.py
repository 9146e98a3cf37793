"""Post-training quantization of a model: `quantize_(model, PTQConfig(...), calib=None)`.

The paper's PTQ (arXiv 2509.23500, paper.md §5): W4A4 symmetric AbsMax RTN of every linear layer in
the transformer blocks, weights per output channel, activations per token, dynamic (computed on the
fly for each input). That is `PTQConfig()`. Beyond it, as settings: GPTQ weights, a Hadamard
rotation first (`optquant.quant.rotate.rotate_model_`), weight-only (a_bits=16), groups, other
integer grids, MXFP4/NVFP4, and quantizing the LM head.

Each chosen nn.Linear becomes a `QuantLinear` holding its dequantized weight Ŵ (so ε^W = Ŵ − W can be
read off `.weight`) and the activation spec: forward(x) = x̂ Ŵᵀ with x̂ = fake_quant(x).

GPTQ is sequential, as in the gptq/QuaRot references: the calibration data runs through the model
with the already-quantized earlier layers in place, so each layer's Hessian comes from the inputs it
will really see. Layers are processed in the order the forward pass actually calls them; layers that
read the very same input tensor (q/k/v, gate/up) form one group: one Hessian, and one GPTQ solve of
their stacked rows (rows are independent given H; not for NVFP4, whose scale is per tensor).
On a chain model (`embed`, `sublayers()`, `head`: ours and optquant.hf's) the calibration inputs of
each residual sublayer are cached, as IST-DASLab/gptq and llm-compressor's sequential pipeline cache a
block's: a group's pass runs that sublayer alone on them and stops (via an exception from a hook) once
the group is captured, and the sublayer, quantized, then maps them to the next one's inputs. The
numbers are those of the whole-model pass (each group sees every earlier layer quantized: IST-DASLab's
true-sequential order), at about 2.3 forward passes in all. Other module trees take the generic pass
from the model's input, stopping likewise, about L/2 forward passes for L groups. During calibration
activations stay unquantized (QuaRot's order: GPTQ weights first, then activation quantizers are on).

Left out on purpose: static activation scales, KV-cache / attention-matmul quantization (the paper
keeps them FP).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.quant.choices import METHODS, ROTATIONS, Method, Rotation
from optquant.quant.gptq import accumulate_hessian, gptq_quantize
from optquant.quant.layers import QuantLinear, linear_layers, model_name, replace_module
from optquant.quant.primitives import FORMATS, GRIDS, OFF, Format, Grid, QuantSpec, fake_quant

log = logging.getLogger(__name__)

GPTQ_BLOCK_SIZE = 128  # lazy-batch width: a speed knob only (exact arithmetic gives the same result)
_CALIB_BATCH = 8  # calibration sequences per forward when calib is one (N, T) tensor, at most
_CALIB_TOKENS = 1024  # ... and at most this many tokens per forward (one at least): an MLP's activations bounded


@dataclass(frozen=True)
class PTQConfig:
    """A PTQ scheme. Defaults = the paper: W4A4 RTN, symmetric [−7, 7], per channel / per token."""

    method: Method = "rtn"
    w_bits: int = 4  # 16 = weights not quantized
    a_bits: int = 4  # 16 = activations not quantized (weight-only)
    format: Format = "int"  # "mxfp4" / "nvfp4" fix 4 bits and their own blocks
    grid: Grid = "sym"  # integer grid, see primitives.py: "sym" [−7,7], "sym8"/"full" [−8,7], "odd", "asym"
    w_group_size: int = 0  # 0 = one scale per output channel
    a_group_size: int = 0  # 0 = one scale per token
    quantize_head: bool = False  # a tied head gets its own quantized weight; the embedding stays FP
    rotation: Rotation = "none"
    damp: float = 0.01  # GPTQ: λ in H + λ·mean(diag H)·I
    act_order: bool = False  # GPTQ: columns by decreasing diag H
    n_calib: int = 128  # GPTQ: calibration sequences
    plan: tuple[tuple[str, int], ...] = ()  # per-module bits (quant/bit_plan.py): (linear's model_name, bits)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise OptquantError(f"ptq.method must be 'rtn' or 'gptq', got {self.method!r}")
        if self.rotation not in ROTATIONS:
            raise OptquantError(f"ptq.rotation must be 'none' or 'hadamard', got {self.rotation!r}")
        if self.format not in FORMATS or self.grid not in GRIDS:
            raise OptquantError(f"ptq.format must be in {FORMATS} and ptq.grid in {GRIDS}")
        for field in ("w_bits", "a_bits"):
            bits = getattr(self, field)
            if not 2 <= bits <= OFF or (self.format != "int" and bits not in (4, OFF)):
                raise OptquantError(f"ptq.{field}={bits} is not 2..16 (16 = off; 4 or 16 for {self.format})")
        if self.w_group_size < 0 or self.a_group_size < 0:
            raise OptquantError("ptq group sizes must be >= 0 (0 = per channel / per token)")
        for name, bits in self.plan:
            if type(bits) is not int or not 2 <= bits <= OFF or (self.format != "int" and bits not in (4, OFF)):
                raise OptquantError(f"ptq.plan: {name} at {bits} bits is not 2..16 (4 or 16 for {self.format})")
        if self.damp <= 0 or self.n_calib < 1:
            raise OptquantError(f"ptq.damp must be > 0 and ptq.n_calib >= 1, got {self.damp}, {self.n_calib}")

    @property
    def weight_spec(self) -> QuantSpec | None:
        """How weights are quantized; None when w_bits = 16."""
        return _spec(self.w_bits, self.grid, self.format, self.w_group_size, "channel")

    @property
    def act_spec(self) -> QuantSpec | None:
        """How layer inputs are quantized (dynamically); None when a_bits = 16."""
        return _spec(self.a_bits, self.grid, self.format, self.a_group_size, "token")

    @property
    def name(self) -> str:
        """A stable results key, e.g. "w4a16-gptq-g128-ao-had"; GPTQ's damp and n_calib are not in it."""
        parts = [f"w{self.w_bits}a{self.a_bits}", self.method]
        if self.format != "int":
            parts.append(self.format)
        elif self.grid != "sym":
            parts.append(self.grid)
        if self.format == "int" and self.w_group_size and self.w_bits < OFF:
            parts.append(f"g{self.w_group_size}")
        if self.format == "int" and self.a_group_size and self.a_bits < OFF:
            parts.append(f"ag{self.a_group_size}")
        if self.method == "gptq" and self.act_order:
            parts.append("ao")
        if self.rotation == "hadamard":
            parts.append("had")
        if self.quantize_head:
            parts.append("head")
        if self.plan:  # the plan's bits, hashed: one directory per plan
            parts.append("plan-" + hashlib.sha256(repr(sorted(self.plan)).encode()).hexdigest()[:8])
        return "-".join(parts)

    def for_module(self, name: str) -> PTQConfig:
        """The scheme of one linear: its planned bits for the weights and, when activations are quantized, the
        larger of those and the scheme's for its inputs (a plan's 8 turns W4A4 and W4A8 into W8A8, W4A16 into
        W8A16; its 4 leaves W4A8 as it is); else the scheme itself."""
        bits = {model_name(n): b for n, b in self.plan}.get(model_name(name))
        if bits is None:
            return self
        return replace(self, w_bits=bits, a_bits=max(bits, self.a_bits), plan=())


def _spec(bits: int, grid: str, fmt: str, group: int, per_row: str) -> QuantSpec | None:
    if bits >= OFF:
        return None
    return QuantSpec(bits, grid, "group" if group else per_row, group or 128, fmt)


# Named schemes for sweeps; keys are the configs' own names.
SCHEMES: dict[str, PTQConfig] = {
    c.name: c
    for c in (
        PTQConfig(),
        PTQConfig(rotation="hadamard"),
        PTQConfig(method="gptq"),
        PTQConfig(method="gptq", rotation="hadamard"),
        PTQConfig(a_bits=16, method="gptq", w_group_size=128),
        PTQConfig(a_bits=16),
        PTQConfig(format="mxfp4"),
        PTQConfig(format="nvfp4"),
        PTQConfig(w_bits=8, a_bits=8),
        PTQConfig(grid="full"),  # the paper's scheme on llm-compressor's / torchao's int4 grid
        PTQConfig(a_bits=16, method="gptq", w_group_size=128, grid="full"),  # llm-compressor's W4A16 scheme, our GPTQ
    )
}


@torch.no_grad()
def quantize_(model: nn.Module, cfg: PTQConfig, calib: Tensor | Iterable | None = None) -> nn.Module:
    """Quantize `model` in place with `cfg`; returns it.

    `calib` (GPTQ only): model inputs, either one tensor whose first axis is sequences, or an iterable
    of batches (each a tensor or a tuple whose first item is the input); the first `cfg.n_calib`
    sequences are used.
    """
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise OptquantError("the model is already quantized; quantize a fresh copy")
    if cfg.method == "gptq" and (cfg.w_bits < OFF or cfg.plan) and calib is None:
        raise OptquantError("ptq.method='gptq' needs calibration data (calib=...)")
    if cfg.rotation == "hadamard":
        from optquant.quant.rotate import rotate_model_  # only the rotated schemes need it

        rotate_model_(model)
    layers = quantized_layers(model, cfg)
    names = [n for n, _ in layers]
    if cfg.method == "gptq" and any(cfg.for_module(n).w_bits < OFF for n in names):
        del layers  # each FP linear is freed once its quantized one replaces it (quantize_unit_)
        _gptq_(model, names, cfg, calib)
    else:  # RTN, as quantize_unit_ does it without calibration inputs
        quantize_unit_(model, model, dict(layers), cfg)
    log.info("quantized %d linear layers with %s", len(names), cfg.name)
    return model


def quantized_layers(model: nn.Module, cfg: PTQConfig) -> list[tuple[str, nn.Linear]]:
    """The linear layers `cfg` quantizes (the LM head only with quantize_head), group sizes and plan checked."""
    layers = linear_layers(model, skip=() if cfg.quantize_head else ("lm_head",))
    check_group_sizes(layers, cfg)
    check_plan(cfg, [n for n, _ in layers])
    return layers


def rtn_linear(lin: nn.Module, cfg: PTQConfig) -> QuantLinear:
    """The QuantLinear of one layer under RTN (weights rounded to nearest, activations as cfg says)."""
    spec = cfg.weight_spec
    W = lin.weight.detach().clone() if spec is None else fake_quant(lin.weight.detach(), spec)
    return QuantLinear(W, lin.bias, cfg.act_spec, cfg.name)


def check_plan(cfg: PTQConfig, names: list[str]) -> None:
    """Every module a plan names must be one of the linears quantized here (by its model_name: a rotated o_proj
    is o_proj)."""
    names = [model_name(n) for n in names]
    unknown = sorted(set(map(model_name, dict(cfg.plan))) - set(names))
    if unknown:
        raise OptquantError(f"ptq.plan: module {unknown[0]!r} is not a quantized linear of this model "
                            f"({len(unknown)} such; e.g. {', '.join(names[:3])} are)")


def check_group_sizes(layers: list[tuple[str, nn.Linear]], cfg: PTQConfig) -> None:
    """A weight or activation group must tile each layer's input width exactly: no ragged last group.
    A group at least as wide as a layer is one group per row (the zero padding never changes a scale). With a
    plan, each layer at its planned bits: a layer it keeps in FP has no groups, one it quantizes has."""
    for what, group in (("w_group_size", cfg.w_group_size), ("a_group_size", cfg.a_group_size)):
        if cfg.format != "int" or not group:
            continue
        bits = {n: getattr(cfg.for_module(n), what[0] + "_bits") for n, _ in layers}
        bad = sorted({lin.in_features for n, lin in layers if bits[n] < OFF and group < lin.in_features
                      and lin.in_features % group})
        if bad:
            raise OptquantError(f"ptq.{what}={group} does not divide the input width(s) {bad} of this model's "
                                "linear layers; choose a divisor")


def quantized_copy(model: nn.Module, cfg: PTQConfig, calib: Tensor | Iterable | None = None) -> nn.Module:
    """A quantized deep copy of `model`; the original is untouched."""
    return quantize_(copy.deepcopy(model), cfg, calib)


def _calib_batches(calib: Tensor | Iterable, n: int, device: torch.device) -> list[Tensor]:
    if isinstance(calib, Tensor):
        calib = calib[:n].split(max(1, min(_CALIB_BATCH, _CALIB_TOKENS // max(1, calib[0].numel()))))
    batches, seen = [], 0
    for item in calib:
        x = item[0] if isinstance(item, tuple | list) else item
        x = x[: n - seen]
        batches.append(x.to(device))
        seen += x.shape[0]
        if seen >= n:
            break
    if not batches:
        raise OptquantError("GPTQ: the calibration data is empty")
    return batches


class _Stop(Exception):
    """Raised by a hook to end a calibration forward once the current input group is captured."""


def _capture_group(model, pending: dict[str, nn.Module], batches: list[Tensor]) -> dict[str, Tensor]:
    """The shared Hessian of the first pending layers `model` calls, all reading the same input tensor; the
    first batch's pass finds them, stopping at the next pending layer with another input or once every pending
    layer is captured; the other batches' passes stop as soon as that input arrives (the group is known)."""
    H: list = [None, 0]  # the group's running (H, N)
    group: list[str] = []
    state: dict[str, Tensor | None] = {"input": None, "known": False}

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            if state["input"] is None:
                state["input"] = x
                H[:] = accumulate_hessian(*H, x)
                if state["known"]:
                    raise _Stop
            elif x is not state["input"]:
                raise _Stop
            if name not in group:
                group.append(name)
            if len(group) == len(pending):
                raise _Stop

        return hook

    handles = [m.register_forward_pre_hook(hook_for(name)) for name, m in pending.items()]
    try:
        for batch in batches:
            state["input"] = None
            try:
                model(batch)
            except _Stop:
                pass
            state["known"] = bool(group)
    finally:
        for h in handles:
            h.remove()
    return {name: H[0] for name in group}


def _solve_group(model: nn.Module, pending: dict[str, nn.Module], hessians: dict[str, Tensor], cfg: PTQConfig,
                 done: dict[str, QuantLinear]) -> None:
    """GPTQ of one captured group: the layers' weights stacked by rows (one column loop per weight format of a
    plan), then split back; a layer planned at 16 bits keeps its weight."""
    H = next(iter(hessians.values()))
    by_spec: dict = {}
    for name in hessians:
        by_spec.setdefault(cfg.for_module(name).weight_spec, []).append((name, pending.pop(name)))
    for spec, members in by_spec.items():
        if spec is None:
            done.update((n, replace_module(model, n, rtn_linear(lin, cfg.for_module(n)))) for n, lin in members)
            continue
        stack = spec.format != "nvfp4" and len({lin.weight.dtype for _, lin in members}) == 1
        for part in [[m] for m in members] if not stack else [members]:
            W = torch.cat([lin.weight.detach() for _, lin in part]) if len(part) > 1 else part[0][1].weight
            Q = gptq_quantize(W, H, spec, damp=cfg.damp, block_size=GPTQ_BLOCK_SIZE, act_order=cfg.act_order)
            for (name, lin), Qi in zip(part, Q.split([lin.out_features for _, lin in part]), strict=True):
                q = QuantLinear(Qi.contiguous(), lin.bias, None, cfg.for_module(name).name)
                done[name] = replace_module(model, name, q)
                log.debug("GPTQ quantized %s", name)


def _chain_units(model: nn.Module, names: list[str]) -> list[tuple]:
    """(unit, the names of its layers) of a chain model: each residual sublayer, then the head (norm + LM
    head); empty for other module trees, or when a layer lies outside every unit."""
    if not all(hasattr(model, a) for a in ("embed", "sublayers", "head")):
        return []
    where = {id(m): n for n, m in model.named_modules()}
    prefixes = [where[id(sub)] + "." for sub in model.sublayers()] + ["norm.", "lm_head"]
    units = [(sub, []) for sub in model.sublayers()] + [(model.head, [])]
    for name in names:
        i = next((i for i, p in enumerate(prefixes) if name == p or name.startswith(p)), None)
        if i is None:
            return []
        units[min(i, len(units) - 1)][1].append(name)
    return units


@torch.no_grad()
def quantize_unit_(root: nn.Module, unit, layers: dict[str, nn.Module], cfg: PTQConfig,
                   xs: list[Tensor] | None = None, outputs: bool = True) -> list[Tensor] | None:
    """Quantize `layers` (named as in `root`) of one chain unit (a callable that runs them; or the whole model)
    in place: RTN, or GPTQ from the unit's calibration inputs `xs` in true-sequential groups, which empties
    `layers` as it goes (each FP linear is freed once its quantized one replaces it: no second copy of the
    model). Returns the unit's outputs on `xs`, its weights quantized and activations not (the next unit's
    calibration inputs; None without `xs` or `outputs`). Afterwards the activation quantizers are on."""
    if cfg.method != "gptq" or all(cfg.for_module(n).w_bits >= OFF for n in layers) or xs is None:
        for name, lin in layers.items():
            replace_module(root, name, rtn_linear(lin, cfg.for_module(name)))
        return [unit(x) for x in xs] if xs is not None and outputs else None
    pending, done = layers, {}
    while pending and (hessians := _capture_group(unit, pending, xs)):
        _solve_group(root, pending, hessians, cfg, done)
    if pending:
        log.warning("GPTQ: %d layers never ran on the calibration data; using RTN", len(pending))
        done.update((n, replace_module(root, n, rtn_linear(lin, cfg.for_module(n)))) for n, lin in pending.items())
    ys = [unit(x) for x in xs] if outputs else None
    for name, layer in done.items():  # activations stayed FP during calibration; switch their quantizers on now
        layer.act = cfg.for_module(name).act_spec
    return ys


def _gptq_(model: nn.Module, names: list[str], cfg: PTQConfig, calib) -> None:
    batches = _calib_batches(calib, cfg.n_calib, next(model.parameters()).device)
    units = _chain_units(model, names)
    if not units:  # another module tree: the whole model is the one unit, run from its inputs
        quantize_unit_(model, model, {n: model.get_submodule(n) for n in names}, cfg, batches, outputs=False)
        return
    xs = [model.embed(b) for b in batches]  # each unit's inputs cached, moved through the model once
    for i, (unit, mine) in enumerate(units):  # a unit's layers looked up when it is reached
        xs = quantize_unit_(model, unit, {n: model.get_submodule(n) for n in mine}, cfg, xs,
                            outputs=any(m for _, m in units[i + 1 :]))

"""The chain the ABC analysis walks, as links: each residual sublayer, then the final module (§7), with its
FP function f and quantized f^q, from two whole models (`model_links`) or built one module at a time from
the FP model alone (`quantized_links`).

`quantized_links` is what bounds the analysis's memory by the weights: the quantized sublayer is a copy
that shares every tensor with the FP one except its quantized linears (`shared_copy`), made when the walk
reaches it and dropped when it moves on, so the FP model is held once and the quantized one never whole.
GPTQ runs in the same walk: its calibration inputs (train-split sequences, not the ABC's batches) follow the
quantized chain, module by module (quant.ptq.quantize_unit_), exactly as in `quantize_` of the whole model.
The link's numbers equal those of `model_links(fp, quantized_copy(fp))`.

The head read-out: when the final module is the same in both models (lm_head left in FP, as PTQ does by
default) and bias-free, ‖W x‖ = ‖R x‖ with RᵀR = WᵀW, so the logits' row norms come from d-wide products;
R is the Cholesky factor of the Gram matrix, summed over chunks of the vocabulary (syrk, in the rows'
dtype), so the (V × d) head is never copied (a QR of it would be) and costs V·d² flops, half a QR's.
Left out on purpose: rotation inside the walk (the rotated FP model is made whole first, `ptq_pair`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from optquant.device import resident
from optquant.errors import OptquantError
from optquant.metrics.gains import rows2d, syrk
from optquant.quant.layers import QuantLinear, linear_layers
from optquant.quant.ptq import PTQConfig, _calib_batches, quantize_unit_, quantized_layers

GRAM_ROWS = 8192  # vocabulary rows per chunk of the head's Gram matrix


@dataclass
class Link:
    name: str
    kind: str
    f: Callable[[Tensor], Tensor]
    fq: Callable[[Tensor], Tensor]
    same: bool  # fq computes exactly f (nothing quantized inside): f^q(x) = f(x) is not evaluated again
    fp_lin: dict[str, nn.Module] = field(default_factory=dict)  # the linear rows inside: qualified name → layer
    q_lin: dict[str, nn.Module] = field(default_factory=dict)
    readout: tuple[nn.Module, Tensor] | None = None  # (norm, R) when f = f^q = W∘norm, RᵀR = WᵀW

    @property
    def linears(self) -> list[str]:
        return list(self.fp_lin)


def shared_copy(module: nn.Module) -> nn.Module:
    """New module objects holding the very parameter and buffer tensors of `module` (no weight is copied)."""
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


def _check_lm(*models: nn.Module) -> None:
    for m, role in zip(models, ("fp", "q"), strict=False):
        if not all(hasattr(m, a) for a in ("embed", "sublayers", "head", "norm")):
            raise OptquantError(f"propagation: the {role} model lacks embed/sublayers/norm/head (an LM)")


def _final(cfg, fp: nn.Module, q_head, q_norm, q_lm_head) -> Link:
    if cfg.final == "logits":
        return Link("head", "final", fp.head, q_head, _same((fp.norm, fp.lm_head), (q_norm, q_lm_head)))
    if cfg.final == "norm":
        return Link("norm", "final", fp.norm, q_norm, _same((fp.norm,), (q_norm,)))
    raise OptquantError(f"propagation: final must be logits|norm|none, got {cfg.final!r}")


def _assign_linears(fp: nn.Module, links: list[Link], cfg, q_of: Callable[[str], nn.Module]) -> None:
    """The linear rows (granularity="linear"): each linear of `fp` under its chain module's name."""
    if cfg.granularity == "sublayer":
        return
    if cfg.granularity != "linear":
        raise OptquantError(f"propagation: granularity must be sublayer|linear, got {cfg.granularity!r}")
    prefixes = {"head": ("norm", "lm_head"), "norm": ("norm",)}
    for name, lin in linear_layers(fp, skip=cfg.skip):
        for link in links:
            if any(name == p or name.startswith(p + ".") for p in prefixes.get(link.name, (link.name,))):
                link.fp_lin[name], link.q_lin[name] = lin, q_of(name)
                break


def _with_readout(fp: nn.Module, link: Link) -> Link:
    if link.name == "head" and link.same and not link.fp_lin and _bias_free(fp.lm_head):
        link.readout = fp.norm, gram_factor(fp.lm_head.weight.detach())
    return link


def model_links(fp: nn.Module, q: nn.Module, cfg) -> list[Link]:
    """The links of an FP model and its quantized copy (two whole models of one architecture)."""
    _check_lm(fp, q)
    subs, subs_q = fp.sublayers(), q.sublayers()
    if len(subs) != len(subs_q):
        raise OptquantError(f"propagation: fp has {len(subs)} sublayers but q has {len(subs_q)}")
    names = {id(m): n for n, m in fp.named_modules()}
    links = [Link(names[id(s)], "sublayer", s, sq, _same((s,), (sq,))) for s, sq in zip(subs, subs_q, strict=True)]
    if cfg.final != "none":
        links.append(_final(cfg, fp, q.head, q.norm, q.lm_head))
    _assign_linears(fp, links, cfg, q.get_submodule)
    links[-1] = _with_readout(fp, links[-1])
    return links


def quantized_links(model: nn.Module, qcfg: PTQConfig, cfg, calib: Iterable | None = None) -> Iterator[Link]:
    """The links of `model` and its quantized copy under `qcfg` (no rotation), each quantized sublayer made
    as the walk reaches it; `calib`: GPTQ's calibration batches (token ids), moved along the quantized chain."""
    _check_lm(model)
    if qcfg.rotation != "none":
        raise OptquantError("quantized_links: rotate the FP model first (ptq_pair), then walk it unrotated")
    layers = dict(quantized_layers(model, qcfg))
    names = {id(m): n for n, m in model.named_modules()}
    gptq = qcfg.method == "gptq" and calib is not None
    device = next(model.parameters()).device
    xs = [model.embed(b) for b in _calib_batches(calib, qcfg.n_calib, device)] if gptq else None
    subs = model.sublayers()
    for i, sub in enumerate(subs):
        prefix = names[id(sub)]
        with resident(sub, device):  # a lazily loaded sublayer is read now, released when the walk moves on
            q_sub = shared_copy(sub)
            mine = [n[len(prefix) + 1 :] for n in layers if n.startswith(prefix + ".")]
            more = i + 1 < len(subs) or qcfg.quantize_head
            local = dataclasses.replace(qcfg, plan=tuple((n[len(prefix) + 1 :], b) for n, b in qcfg.plan
                                                         if n.startswith(prefix + ".")))  # names inside q_sub
            xs = quantize_unit_(q_sub, q_sub, {r: q_sub.get_submodule(r) for r in mine}, local, xs, outputs=more)
            link = Link(prefix, "sublayer", sub, q_sub, not mine)
            _assign_linears(model, [link], cfg, lambda n, q=q_sub, p=prefix: q.get_submodule(n[len(p) + 1 :]))
            yield link
    if cfg.final == "none":
        return
    q_lm_head = model.lm_head
    if "lm_head" in layers:  # the quantized head: its own weight, a tied embedding stays FP
        holder = nn.ModuleDict({"lm_head": model.lm_head})
        head = {"lm_head": model.lm_head}
        quantize_unit_(holder, lambda x: holder.lm_head(_to(model.norm(x), holder.lm_head)), head, qcfg, xs, False)
        q_lm_head = holder.lm_head
    link = _final(cfg, model, lambda x: q_lm_head(_to(model.norm(x), q_lm_head)), model.norm, q_lm_head)
    _assign_linears(model, [link], cfg, lambda n: q_lm_head if n == "lm_head" else model.get_submodule(n))
    yield _with_readout(model, link)


def _to(x: Tensor, layer: nn.Module) -> Tensor:
    """x in `layer`'s weight dtype (an fp32-computing chain over a bf16-stored head, hf/lazy.py)."""
    return x.to(layer.weight.dtype)


def gram_factor(W: Tensor) -> Tensor:
    """Upper R with RᵀR = WᵀW, in the dtype the rows compute in (fp32 for fp32 and 16-bit weights, fp64 for
    fp64): the Gram matrix summed over chunks of rows (BLAS syrk on CPU, half a matmul's flops), factored in
    fp64 by Cholesky, or by eigenvalues where WᵀW is singular (fewer rows than columns)."""
    dtype = rows2d(W[:1]).dtype
    G = torch.zeros(W.shape[1], W.shape[1], dtype=dtype, device=W.device)
    for i in range(0, W.shape[0], GRAM_ROWS):
        chunk = W[i : i + GRAM_ROWS].to(dtype)
        G += torch.from_numpy(syrk(chunk)) if W.device.type == "cpu" else chunk.T @ chunk
    G = (G.triu() + G.triu(1).T).double() if W.device.type == "cpu" else G.double()
    L, info = torch.linalg.cholesky_ex(G)
    if info == 0:
        return L.T.to(dtype)
    lam, U = torch.linalg.eigh(G)
    return (lam.clamp_min(0).sqrt()[:, None] * U.T).to(dtype)


def _bias_free(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear | QuantLinear) and m.bias is None


def _same(fp_parts: tuple[nn.Module, ...], q_parts: tuple[nn.Module, ...]) -> bool:
    """Whether the quantized module computes exactly the FP one: the same layer types, none quantized,
    and equal parameters and buffers (the head when lm_head is left in FP, as PTQ does by default)."""
    mods = [[m for part in parts for m in part.modules()] for parts in (fp_parts, q_parts)]
    if [type(m) for m in mods[0]] != [type(m) for m in mods[1]] or any(isinstance(m, QuantLinear) for m in mods[1]):
        return False
    ts = [[t for part in parts for t in (*part.parameters(), *part.buffers())] for parts in (fp_parts, q_parts)]
    return len(ts[0]) == len(ts[1]) and all(a is b or torch.equal(a, b) for a, b in zip(*ts, strict=True))

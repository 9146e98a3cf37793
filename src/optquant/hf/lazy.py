"""A Hugging Face checkpoint loaded lazily: the decoder layers' weights stay in their safetensors files
(memory-mapped, read one chain module at a time), the rest is read at once.

`load_lazy(path, dtype)` builds the HF model on the meta device (no memory), reads the embedding, final
norm and LM head (what every pass needs at its ends), and gives each residual sublayer of the HFLM chain a
`LazyWeights` handle: `with device.resident(sublayer):` reads that sublayer's tensors from the shards (one
`safe_open` per file, which maps it) onto the embedding's device and puts them back on the meta device on
exit, so a walk over the chain (metrics/chain.py, metrics/outliers.py) holds one sublayer at a time. On a
GPU the embedding is on the GPU and each block is read onto it: the same code runs offloaded.

The compute dtype: a bf16 checkpoint computes in bf16 where the CPU multiplies bf16 natively
(`device.fast_bf16`: AVX512-BF16 or AMX); elsewhere torch emulates bf16 matmuls, many times slower (a 0.5B
analyze ran > 33 min on an EPYC without them, 147 s with AMX), so there each sublayer is read as fp32 (the
upcast of one sublayer at a time) and the final norm too, while the embedding (and the head tied to it)
stays stored in bf16 and hands fp32 activations on: the numbers are then those of `dtype="float32"`.

The checkpoint is checked as `load_hf_model` checks it (names and shapes against the model built from
config.json; a missing or extra tensor is an error). Left out on purpose: quantized checkpoints, and
passes that need every block at once (the Hadamard rotation, lm-eval): they load the model whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from optquant import device
from optquant.errors import OptquantError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_index(path: Path) -> dict[str, Path]:
    """{tensor name: its safetensors file} of an HF folder (one file, or an index of shards)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise OptquantError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise OptquantError(f"{path}: lazy loading needs safetensors weights (model.safetensors or an index)")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


class LazyWeights:
    """The checkpoint tensors of one module: {attribute path inside it: (file, tensor name)}. `names` holds the
    checkpoint name of each HF submodule by id: a residual sublayer's inner module and norm sit apart in it."""

    def __init__(self, module: nn.Module, names: dict[int, str], index: dict[str, Path], dtype: torch.dtype):
        self.where = {}
        for path, m in module.named_modules():
            for n, _ in m.named_parameters(recurse=False):
                key = f"{names[id(m)]}.{n}"
                self.where[f"{path}.{n}" if path else n] = (index[key], key)
        self.dtype = dtype

    def load_(self, module: nn.Module, device: torch.device) -> None:
        from safetensors import safe_open

        files = {f for f, _ in self.where.values()}
        for file in files:
            with safe_open(file, "pt", device=str(device)) as f:
                for attr, (fi, key) in self.where.items():
                    if fi == file:  # a copy: a tensor on the file's mapping would keep every page read resident
                        t = f.get_tensor(key)
                        _set(module, attr, t.to(self.dtype) if t.dtype != self.dtype else t.clone())

    def release_(self, module: nn.Module) -> None:
        for attr in self.where:
            p = module.get_parameter(attr)
            _set(module, attr, torch.empty(p.shape, dtype=p.dtype, device="meta"))


def _set(module: nn.Module, attr: str, t: torch.Tensor) -> None:
    parent, _, name = attr.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    owner._parameters[name] = nn.Parameter(t, requires_grad=False)


def load_lazy(path: Path, dtype: str, seq_len: int):
    """The HFLM chain of the checkpoint at `path`, its residual sublayers lazily loaded (see the module
    docstring); everything else read now, in `dtype` ("auto": config.json's torch dtype)."""
    from optquant.hf import check_hf_config, require_transformers
    from optquant.hf.adapter import HFLM

    transformers = require_transformers()
    check_hf_config(path)
    try:  # transformers and safetensors over files from elsewhere: any failure is bad input
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        want = _DTYPES.get(dtype) or (config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32)
        index = shard_index(path)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=want)
        _check_names(path, hf, index, config)
    except OptquantError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise OptquantError(f"{path}: transformers could not load it ({type(e).__name__}: {first})") from None
    base = hf.model
    base.rotary_emb = type(base.rotary_emb)(config=config)  # its buffers are computed, not stored
    model = HFLM(hf, seq_len=seq_len)
    names = {id(m): n for n, m in hf.named_modules()}
    compute = torch.float32 if want == torch.bfloat16 and not device.fast_bf16(torch.device("cpu")) else want
    for sub in model.sublayers():
        object.__setattr__(sub, "_lazy_weights", LazyWeights(sub, names, index, compute))
    try:
        for m, dt in ((base.embed_tokens, want), (base.norm, compute),
                      *(() if config.tie_word_embeddings else ((hf.lm_head, want),))):
            LazyWeights(m, names, index, dt).load_(m, torch.device("cpu"))
    except Exception as e:  # a shard that the index names but that is not safetensors
        raise OptquantError(f"{path}: unreadable weights ({type(e).__name__}: {str(e).splitlines()[:1]})") from None
    if config.tie_word_embeddings:
        hf.lm_head.weight = base.embed_tokens.weight
    if compute != want:  # bf16 storage, fp32 compute: the embedding's rows upcast, the head's input downcast
        base.embed_tokens.register_forward_hook(lambda m, args, out: out.to(compute))
        hf.lm_head.register_forward_pre_hook(lambda m, args: tuple(a.to(m.weight.dtype) for a in args))
    return model.eval()


def materialize_(model: nn.Module) -> nn.Module:
    """Read every lazily loaded sublayer of `model` for good (its handles dropped), each tensor copied out of the
    file's mapping: a weight replaced later (PTQ's quantized linears) gives its memory back, which a mapping held
    by the tensors left (transformers' whole-file one, or a sublayer's biases) would not."""
    for sub in model.sublayers():
        lazy = sub.__dict__.pop("_lazy_weights", None)
        if lazy is not None:
            lazy.load_(sub, next(model.embed.parameters()).device)
            for p in sub.parameters():
                p.data = p.data.clone()  # the mapping goes with the last view of it: one sublayer at a time
    return model


def _check_names(path: Path, hf: nn.Module, index: dict[str, Path], config) -> None:
    """The checkpoint holds exactly the model's tensors, each of its shape (a tied head may be absent)."""
    from safetensors import safe_open

    shapes = {}
    for file in set(index.values()):
        with safe_open(file, "pt") as f:
            shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    want = {n: tuple(p.shape) for n, p in hf.named_parameters(remove_duplicate=False)}
    if config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    missing = sorted(set(want) - set(shapes))
    wrong = sorted(set(shapes) - set(want) - {"lm_head.weight"}) + sorted(
        n for n in set(want) & set(shapes) if want[n] != shapes[n])
    if missing or wrong:
        raise OptquantError(f"{path}: the weights do not match config.json (model_type {config.model_type!r}): "
                            f"missing {missing[:3]}, unexpected or mis-shaped {wrong[:3]}")

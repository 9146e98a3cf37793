"""Checkpoints and weights in safetensors (never pickle), and RNG states.

A training checkpoint is ONE safetensors file: the model's tensors under `model.`, every nested tensor of
the optimizer states and RNG states under `state.<n>`, and the non-tensor structure (numbers, strings,
dict keys that are ints) as JSON in the file's metadata. One file means one atomic `os.replace`
(files.atomic_write): a killed process leaves either the previous checkpoint or the new one, never half
of each.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from optquant.compiled import strip_prefix
from optquant.errors import OptquantError
from optquant.files import atomic_write


def _save_file(tensors: dict[str, Tensor], tmp: Path, metadata: dict[str, str]) -> None:
    try:
        save_file(tensors, str(tmp), metadata=metadata)
    except SafetensorError as e:  # safetensors wraps the OS error (e.g. ENOSPC) in its own type
        code = re.search(r"(?:os error|code:) (\d+)", str(e))
        code = int(code.group(1)) if code else errno.EIO
        raise OSError(code, os.strerror(code), str(tmp)) from None


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG a training step draws from (torch, the data generator, Python, numpy), as checkpoint data."""
    return {"torch": torch.get_rng_state(), "data": generator.get_state(),
            "python": list(random.getstate()[1]) + [random.getstate()[2]],
            "numpy": list(np.random.get_state()[1].tolist()) + [int(np.random.get_state()[2])]}


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    generator.set_state(state["data"])
    py = state["python"]
    random.setstate((3, tuple(py[:-1]), py[-1]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", np.array(npy[:-1], dtype=np.uint32), npy[-1]))


def _flatten(obj: Any, tensors: dict[str, Tensor]) -> Any:
    """Replace every tensor in a nested structure by a reference; keep key types and tuples."""
    if isinstance(obj, Tensor):
        key = f"state.{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def _unflatten(obj: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj


def model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict with tied tensors stored once (the first name wins)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen and t.numel() > 0:
            continue
        seen.add(t.data_ptr())
        out[strip_prefix(name)] = t.detach().cpu().contiguous()  # the same names compiled or not
    return out


def save_checkpoint(path: Path, model: nn.Module, state: dict[str, Any]) -> None:
    """Model tensors plus an arbitrary nested `state` (optimizer state dicts, RNG, step) in one file."""
    tensors: dict[str, Tensor] = {}
    try:
        structure = _flatten(state, tensors)
    except TypeError as e:  # e.g. a plugin optimizer keeping an object of its own in its state
        raise OptquantError(f"{path}: {e} in the training state; an optimizer's state may hold only tensors, "
                            "numbers, strings, bools, None, lists and dicts") from None
    tensors.update({f"model.{k}": v for k, v in model_tensors(model).items()})
    atomic_write(path, lambda tmp: _save_file(tensors, tmp, {"structure": json.dumps(structure)}))


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        return load_file(str(path)), metadata
    except FileNotFoundError:
        raise OptquantError(f"{path}: checkpoint not found") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise OptquantError(f"{path}: truncated or corrupt checkpoint ({e})") from None


def load_checkpoint(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load model tensors into `model` (strictly) and return the saved `state`."""
    tensors, metadata = _read(path)
    load_model_tensors(model, {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, path)
    if "structure" not in metadata:
        raise OptquantError(f"{path}: not an optquant training checkpoint (no state metadata)")
    try:
        state = _unflatten(json.loads(metadata["structure"]), tensors)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise OptquantError(f"{path}: the checkpoint's state metadata is corrupt ({type(e).__name__}: {e}); "
                            "delete it to train this run from scratch") from None
    return state


def load_model_tensors(model: nn.Module, tensors: dict[str, Tensor], source: Path | str) -> None:
    expected = {strip_prefix(k): v for k, v in model.state_dict().items()}  # compiled or not, either way
    tensors = {strip_prefix(k): v for k, v in tensors.items()}
    missing = [k for k in expected if k not in tensors and not _is_tied_alias(expected, k, tensors)]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise OptquantError(
            f"{source}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    with torch.no_grad():
        for name, t in expected.items():
            if name in tensors:
                if tensors[name].shape != t.shape:
                    raise OptquantError(f"{source}: {name} has shape {tuple(tensors[name].shape)}, "
                                        f"the model expects {tuple(t.shape)}")
                t.copy_(tensors[name])


def _is_tied_alias(state: dict[str, Tensor], name: str, tensors: dict[str, Tensor]) -> bool:
    ptr = state[name].data_ptr()
    return any(k in tensors and state[k].data_ptr() == ptr for k in state if k != name)


def save_weights(path: Path, model: nn.Module, metadata: dict[str, str] | None = None) -> None:
    """The model's weights alone (final or CL model), atomically."""
    tensors = model_tensors(model)
    atomic_write(path, lambda tmp: _save_file(tensors, tmp, metadata or {}))


def load_weights(path: Path, model: nn.Module) -> nn.Module:
    tensors, _ = _read(path)
    load_model_tensors(model, tensors, path)
    return model

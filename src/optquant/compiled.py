"""`train.compile=auto|on|off`: torch.compile for the training loop's forward/backward and evaluation.

auto = on for CUDA (where every anchor trains compiled) and off on CPU, where a small run is shorter
than its compilation (benchmarks/train_throughput.py measures both). The compiled module shares its
parameters with the eager one, so the optimizers, checkpoints and weights use the eager module's names;
checkpoint.py strips the `_orig_mod.` prefix a compiled module's state dict carries, so weights load
either way. Study workers are processes of one user with the study's environment, so they share
inductor's on-disk compile cache (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER): a size
compiles once per worker process, and later processes load the cached kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from optquant.errors import OptquantError

PREFIX = "_orig_mod."


def use_compile(setting: str, device: torch.device) -> bool:
    if setting not in ("auto", "on", "off"):
        raise OptquantError(f"train.compile={setting}: choose auto, on or off")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def maybe_compile(module: nn.Module, setting: str, device: torch.device) -> nn.Module:
    """`torch.compile(module)` when the setting asks for it on this device, else the module itself."""
    return torch.compile(module) if use_compile(setting, device) else module


def strip_prefix(name: str) -> str:
    """A state-dict key without torch.compile's wrapper prefix (at any depth)."""
    return name.replace(PREFIX, "")

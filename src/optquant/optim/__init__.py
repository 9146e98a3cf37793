"""The optimizer registry: name -> frozen config class whose `build(groups)` returns torch optimizers.

A new optimizer is one file, its entry in OPTIMIZERS (and the import) and a passing contract test: no code
outside optim/ branches on an optimizer's name (tests/test_optimizer_names.py). The file's config, a frozen
dataclass (`OptimConfig`), has
- `name` (its registry key) and `lr: Positive` (the peak learning rate the schedule scales);
- `build(groups)`: torch optimizers over the three parameter groups (optim/groups.py);
- `state_bytes(shape, element_size, group)`: the bytes of state it allocates for one parameter of that group
  after a step, which the planner sums (optquant.cost; tests/test_cost.py compares it with a real step);
- `lr_groups()`: its param groups as `build` packs them (optim/groups.py's LRGroup), which a study's tuning
  table reads without building anything (tests/test_tuning.py compares them with a real build);
- each field's range in its annotation (`momentum: Unit`, optquant/ranges.py), checked on every config;
- optional ClassVars: `GROUP_LRS` (group step sizes a study can tie to lr, study/tuning.py) and
  `LEGACY_NAMES` (a renamed field -> its old name, under which run ids hash it and old config.json files and
  overrides may spell it);
- optional fields read by name elsewhere: `max_precondition_dim` (a preconditioner's size cap, which the
  planner lowers to make a run fit and the study presets scale to the model) and `ns_dtype` (Newton–Schulz's
  dtype, pinned to fp32 by the CPU studies).
The contract is `check_contract` in tests/test_optim.py (the loss falls, stays finite, and resumes bit for
bit from a JSON + safetensors checkpoint); tests/test_new_optimizer.py adds an optimizer from scratch that
way and runs it through the config, the planner and training. Defaults are the paper's (paper.md §3; each
file says where a default comes from).

Every param group records its `base_lr`; the training loop sets `group["lr"] = group["base_lr"] *
schedule(step)` for every group of every optimizer, so fixed-lr groups (Muon's AdamW, Scion's embedding
and vector groups) follow the schedule too, as in the authors' code. State dicts hold only tensors,
numbers, strings, bools, None, lists and dicts; after a JSON round trip (tuples become lists) they load
back and resume bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from optquant.errors import OptquantError
from optquant.optim.adamw import AdamWConfig
from optquant.optim.groups import ParamGroups, split_params
from optquant.optim.muon import MuonConfig
from optquant.optim.plugin import PluginConfig, is_plugin
from optquant.optim.psgd import PSGDConfig
from optquant.optim.scion import ScionConfig
from optquant.optim.shampoo import ShampooConfig
from optquant.optim.soap import SOAPConfig

OPTIMIZERS: dict[str, type] = {
    "adamw": AdamWConfig,
    "muon": MuonConfig,
    "psgd": PSGDConfig,
    "scion": ScionConfig,
    "shampoo": ShampooConfig,
    "soap": SOAPConfig,
}


class OptimConfig(Protocol):
    """What every optimizer config provides (the module docstring)."""

    name: str
    lr: float

    def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]: ...

    def state_bytes(self, shape: tuple[int, ...], element_size: int, group: str) -> int: ...


def is_optimizer(name: str) -> bool:
    """A built-in optimizer's name or a loadable plugin's (optquant.optim.plugin)."""
    return name in OPTIMIZERS or is_plugin(name)


def optimizer_config(name: str) -> OptimConfig | PluginConfig:
    """The default config of a built-in optimizer or a plugin; one clear error for an unknown name."""
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]()
    if is_plugin(name):
        return PluginConfig(name)
    raise OptquantError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}, or name a plugin "
                        "as module:function, file.py:function or an 'optquant.optimizers' entry point")


def build_optimizers(model: nn.Module, cfg: OptimConfig) -> list[torch.optim.Optimizer]:
    """The optimizers for `model` under `cfg`; every param group also records its `base_lr`,
    which the schedule multiplies."""
    optimizers = cfg.build(split_params(model))
    for opt in optimizers:
        for group in opt.param_groups:
            group.setdefault("base_lr", group["lr"])
    return optimizers


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def ns_dtype(optimizers: Iterable[torch.optim.Optimizer]) -> str | None:
    """The dtype Muon's/Scion's Newton–Schulz ran in ("bf16" or "fp32"); None if no optimizer has one."""
    found = sorted({g["ns_dtype"] for opt in optimizers for g in opt.param_groups if "ns_dtype" in g})
    return "/".join(found) or None


def state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of optimizer state (moments, factors, preconditioners) over all optimizers."""
    return sum(_tensor_bytes(state) for opt in optimizers for state in opt.state.values())


__all__ = ["OPTIMIZERS", "AdamWConfig", "MuonConfig", "OptimConfig", "PSGDConfig", "ParamGroups", "PluginConfig",
           "SOAPConfig", "ScionConfig", "ShampooConfig", "build_optimizers", "ns_dtype", "is_optimizer",
           "optimizer_config", "split_params", "state_bytes"]

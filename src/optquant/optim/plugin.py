"""Optimizer plugins: the user's own optimizer, run exactly like the six built-in ones.

`optim.name` names a factory in one of three ways:
- `mypkg.mymodule:make_optimizer`  an importable module (the current directory is searched too);
- `path/to/file.py:make_optimizer` a Python file (relative to the current directory);
- `lion`                           an entry point of group `optquant.optimizers` of an installed package.

The contract is small:

    def make_optimizer(groups: ParamGroups, lr: float) -> torch.optim.Optimizer | list[torch.optim.Optimizer]
    make_optimizer.default_lr = 1e-4   # optional: the centre of a study's LR grid

`groups` are the paper's three parameter groups (optquant.optim.groups: embeddings, vectors, hidden
matrices) and `lr` the peak learning rate (the value `optim.lr` sets and a study sweeps). The factory
puts the parameters into param groups with whatever lr it likes (e.g. lr for the matrices and a fixed
lr elsewhere); every group's lr becomes its `base_lr`, which the training schedule multiplies, as for
the built-in optimizers. Every trainable parameter must be in exactly one group; the optimizer's state
must hold only tensors, numbers, strings, bools, None, lists and dicts (checkpoints store it as JSON +
safetensors). Without `default_lr` a run needs `optim.lr=...` and a study `lrs.<name>=...`. A study's tuning
table, which builds no optimizer, shows a plugin's three groups each in its own param group at lr (searched), as
examples/lion.py packs them: the stated default (`PluginConfig.lr_groups`), whatever the factory does.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from optquant.errors import OptquantError
from optquant.optim.groups import LRGroup, ParamGroups
from optquant.ranges import Positive

ENTRY_POINT_GROUP = "optquant.optimizers"


def _import_module(spec: str):
    if spec.endswith(".py") or "/" in spec or os.sep in spec:
        path = Path(spec).resolve()
        if not path.is_file():
            raise OptquantError(f"optimizer plugin {spec!r}: no such file (relative to {Path.cwd()})")
        name = "optquant_plugin_" + re.sub(r"\W", "_", str(path))
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # the user's code, not ours: whatever it raises is bad input
            del sys.modules[name]
            raise OptquantError(f"optimizer plugin {spec!r} failed to import: {_describe(e)}") from None
        return module
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a console script does not search the current directory
    try:
        return importlib.import_module(spec)
    except (Exception, SystemExit) as e:  # the user's code, not ours; but the module itself missing is said so
        if isinstance(e, ModuleNotFoundError) and e.name and (spec == e.name or spec.startswith(e.name + ".")):
            raise OptquantError(f"optimizer plugin {spec!r}: module {e.name!r} not found (on sys.path or in "
                                f"{Path.cwd()})") from None
        raise OptquantError(f"optimizer plugin {spec!r} failed to import: {_describe(e)}") from None


def _describe(e: BaseException) -> str:
    """An exception from the user's code in one line, with where it happened when Python knows."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    return f"{type(e).__name__}: {e}"


@functools.cache
def load_factory(name: str) -> Callable:
    """The factory named by `name` (`module:attr`, `file.py:attr` or an entry point name)."""
    if ":" in name:
        module_name, _, attr = name.rpartition(":")
        module = _import_module(module_name)
        factory = getattr(module, attr, None)
        if factory is None:
            raise OptquantError(f"optimizer plugin {name!r}: {module_name} has no attribute {attr!r}")
    else:
        points = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not points:
            return None
        try:
            factory = points[0].load()
        except (Exception, SystemExit) as e:  # the installed package's code, not ours
            raise OptquantError(f"optimizer plugin {name!r} failed to load: {_describe(e)}") from None
    if not callable(factory):
        raise OptquantError(f"optimizer plugin {name!r} is not callable")
    return factory


def is_plugin(name: str) -> bool:
    """Whether `name` names a loadable plugin (raises OptquantError if it looks like one but fails)."""
    return load_factory(name) is not None


def default_lr(name: str) -> float:
    """The plugin's declared `default_lr`, or nan when it declares none."""
    lr = getattr(load_factory(name), "default_lr", None)
    if lr is None:
        return math.nan
    if not isinstance(lr, int | float) or isinstance(lr, bool) or not (math.isfinite(lr) and lr > 0):
        raise OptquantError(f"optimizer plugin {name!r}: default_lr must be a positive finite number, got {lr!r}")
    return float(lr)


def safe_name(name: str) -> str:
    """A file-name-safe short form of a plugin name (for run directories): `lion.make_optimizer`."""
    if ":" not in name:
        return name
    module, _, attr = name.rpartition(":")
    stem = Path(module).stem if module.endswith(".py") else module.rpartition(".")[2]
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{stem}.{attr}")


@dataclass(frozen=True)
class PluginConfig:
    """A plugin optimizer: its name (see the module docstring) and peak lr (nan = the plugin's default)."""

    name: str
    lr: Positive = math.nan

    def __post_init__(self) -> None:
        if math.isnan(self.lr):
            object.__setattr__(self, "lr", default_lr(self.name))

    def state_bytes(self, shape: tuple[int, ...], element_size: int, group: str) -> None:
        """Unknown: a plugin declares no state layout (a dry run says so; a real run measures its state)."""
        return None

    def lr_groups(self) -> list[LRGroup]:
        """Not the factory's (nothing is built to learn them): the stated default, each group at lr (module doc)."""
        return [LRGroup((kind,), self.lr) for kind in ("embeddings", "vectors", "matrices")]

    def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]:
        try:  # a nan lr (no default_lr, none set) never gets here: every config is validated (config._decode)
            out = load_factory(self.name)(groups, self.lr)
        except (Exception, SystemExit) as e:  # the user's factory, not ours
            raise OptquantError(f"optimizer plugin {self.name!r} raised in its factory: {_describe(e)}") from None
        optimizers = list(out) if isinstance(out, list | tuple) else [out]
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise OptquantError(f"optimizer plugin {self.name!r} must return a torch.optim.Optimizer or a list "
                                f"of them, got {type(out).__name__}")
        seen = [id(p) for o in optimizers for g in o.param_groups for p in g["params"]]
        wanted = {id(p) for p in groups.all()}
        if len(seen) != len(set(seen)) or set(seen) != wanted:
            raise OptquantError(f"optimizer plugin {self.name!r} must put every parameter of the three groups "
                                f"in exactly one param group ({len(wanted)} parameters, got {len(seen)} "
                                f"entries, {len(set(seen) & wanted)} of them distinct and known)")
        return optimizers

"""RunConfig: one training run, composed of frozen per-component configs; presets, TOML and dotted overrides.

Overrides are dotted paths checked against field types (`optim.lr=3e-3`, `model.n_layer=4`).
`optim.name=muon` swaps the optimizer config for that optimizer's defaults (applied before the other
`optim.*` overrides); `qat.method=quest` creates a QAT section; `qat=none` removes it. A TOML file is the
same thing written as tables (`[optim] name = "muon"`), plus an optional top-level `preset`.
No YAML, no exec: every value is parsed by the type of the field it sets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

from optquant.data import DataConfig
from optquant.errors import OptquantError
from optquant.model import MODEL_PRESETS, ModelConfig, model_config
from optquant.optim import OPTIMIZERS, AdamWConfig
from optquant.quant.qat_config import QATConfig


@dataclass(frozen=True)
class TrainConfig:
    """The training loop's own settings (paper.md §2.3 for the defaults)."""

    batch_size: int = 16  # sequences per optimizer step (global), split into grad_accum micro-batches
    grad_accum: int = 1
    tokens_per_param: float = 20.0  # the paper's Chinchilla ratio; used when steps == 0
    budget_params: Literal["total", "non_embedding"] = "total"  # which N the ratio multiplies
    steps: int = 0  # explicit optimizer steps; 0 = from tokens_per_param
    schedule: Literal["wsd", "cosine"] = "wsd"  # WSD: linear warm-up, constant, linear decay to 0
    warmup_frac: float = 0.05
    decay_frac: float = 0.20
    eval_every: int = 100  # steps between evaluations; a checkpoint is written at each evaluation
    eval_batches: int = 8
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto = bf16 autocast where it is fast
    cl_threshold: float | None = None  # Common Loss: keep the model that first reaches this val loss
    stop_at_cl: bool = False  # end the run at that first crossing (a study's CL re-run needs no more)
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile; auto = on for CUDA (not in the run id)
    cl_eval_every: int = 0  # while the CL is not reached: also evaluate every this many steps (0 = off)
    cl_eval_from: int = 0  # ... from this step on (the last regular evaluation before the crossing)
    keep_history: bool = False  # keep the checkpoint of every evaluation in history/ (a study's LR sweep)


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: Any = field(default_factory=AdamWConfig)  # one of the OPTIMIZERS config classes
    train: TrainConfig = field(default_factory=TrainConfig)
    qat: QATConfig | None = None  # quantization-aware training from scratch when set
    seed: int = 0


# Run presets: a model size and the batch settings that suit it. The budget follows from
# train.tokens_per_param unless train.steps is set.
RUN_PRESETS: dict[str, dict[str, Any]] = {
    "zepto": {"train.batch_size": 16, "train.eval_every": 25},
    "atto": {"train.batch_size": 16, "train.eval_every": 25},
    "femto": {"train.batch_size": 16, "train.eval_every": 25},
    "pico": {"train.batch_size": 16, "train.eval_every": 25},
    "nano": {"train.batch_size": 16, "train.eval_every": 25},
    "micro": {"train.batch_size": 16, "train.eval_every": 50},
    "tiny": {"train.batch_size": 16, "train.eval_every": 100},
    "small": {"train.batch_size": 32, "train.eval_every": 200},
    **{p: {"train.batch_size": 512, "train.grad_accum": 16, "train.eval_every": 200}
       for p in MODEL_PRESETS if p[0].isdigit()},
}


def run_preset(name: str) -> RunConfig:
    """A RunConfig for a size preset (`nano`, `micro`, `tiny`, `small`, `50m`, ..., `1.5b`)."""
    if name not in RUN_PRESETS:
        raise OptquantError(f"unknown preset {name!r}; choose one of {', '.join(RUN_PRESETS)}")
    cfg = RunConfig(name=name, model=model_config(name))
    return apply_overrides(cfg, [f"{k}={v}" for k, v in RUN_PRESETS[name].items()])


def config_hash(cfg: Any) -> str:
    """The run id's hash. `train.compile` is left out: how a run executes is not which run it is (and
    run ids from before the setting existed stay valid)."""
    data = to_dict(cfg)
    if isinstance(data.get("train"), dict):
        data["train"].pop("compile", None)
    return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def run_id(cfg: RunConfig) -> str:
    return f"{cfg.name}-{cfg.optim.name}-{config_hash(cfg)}"


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


# --- parsing values by type -------------------------------------------------------------------


def parse_value(value: str, tp: Any, path: str) -> Any:
    """`value` (a string from --set or TOML) as type `tp`; errors name the dotted `path`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null") and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return parse_value(value, arg, path)
            except OptquantError:
                continue
        raise OptquantError(f"--set {path}={value}: not a valid {tp}")
    if origin is Literal:
        for choice in args:
            if str(choice) == value:
                return choice
        raise OptquantError(f"--set {path}={value}: choose one of {', '.join(map(str, args))}")
    if tp is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise OptquantError(f"--set {path}={value}: expected true or false")
    if tp in (int, float):
        try:
            return tp(float(value)) if tp is int and float(value).is_integer() else tp(value)
        except ValueError:
            raise OptquantError(f"--set {path}={value}: expected a number ({tp.__name__})") from None
    if tp is str:
        return value
    if origin in (tuple, list):
        return tp(parse_value(v.strip(), args[0], path) for v in value.strip("()[]").split(",") if v.strip())
    raise OptquantError(f"--set {path}: cannot set a field of type {tp}")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def set_field(cfg: Any, keys: list[str], value: str, path: str) -> Any:
    """A copy of dataclass `cfg` with the field at `keys` (a dotted path, split) set to `value`, parsed."""
    if not is_dataclass(cfg):
        raise OptquantError(f"--set {path}: {'.'.join(keys[:-1]) or path} has no fields")
    key, types_ = keys[0], _field_types(type(cfg))
    if key not in types_:
        known = ", ".join(f.name for f in fields(cfg))
        raise OptquantError(f"--set {path}: unknown field {key!r} (known: {known})")
    if len(keys) == 1:
        return replace(cfg, **{key: parse_value(value, types_[key], path)})
    return replace(cfg, **{key: set_field(getattr(cfg, key), keys[1:], value, path)})




def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `a.b=value` overrides in order (optimizer and QAT switches first)."""
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise OptquantError(f"--set {item}: expected key=value, e.g. optim.lr=3e-3")
        key, value = item.split("=", 1)
        pairs.append((key.strip(), value.strip()))
    for key, value in pairs:
        if key == "optim.name":
            if value not in OPTIMIZERS:
                raise OptquantError(f"--set optim.name={value}: choose one of {', '.join(OPTIMIZERS)}")
            cfg = replace(cfg, optim=OPTIMIZERS[value]())
        elif key == "qat":
            if value.lower() not in ("none", "off", "null"):
                raise OptquantError("--set qat=...: only qat=none; set qat.method=quest to enable QAT")
            cfg = replace(cfg, qat=None)
    for key, value in pairs:
        if key in ("optim.name", "qat"):
            continue
        if key.startswith("qat.") and cfg.qat is None:
            cfg = replace(cfg, qat=QATConfig())
        cfg = set_field(cfg, key.split("."), value, key)
    return cfg


def _flatten_toml(table: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in table.items():
        if isinstance(v, dict):
            out += _flatten_toml(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={','.join(map(str, v)) if isinstance(v, list) else v}")
    return out


def load_toml(path: Path) -> tuple[str | None, list[str]]:
    """(preset, overrides) from a TOML run file."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise OptquantError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise OptquantError(f"{path}: invalid TOML ({e})") from None
    preset = table.pop("preset", None)
    return preset, _flatten_toml(table)


def resolve(preset: str | None, toml_path: Path | None, overrides: list[str]) -> RunConfig:
    """preset → TOML file → --set overrides, each later one winning."""
    toml_preset, toml_overrides = load_toml(toml_path) if toml_path else (None, [])
    name = preset or toml_preset or "tiny"
    cfg = run_preset(name)
    return apply_overrides(cfg, toml_overrides + list(overrides))


def _build(cls: type, data: dict, path: str) -> Any:
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in types_:
            raise OptquantError(f"{path}: unknown field {key!r} for {cls.__name__}")
        tp = types_[key]
        kwargs[key] = tuple(value) if isinstance(value, list) else value
        if isinstance(value, dict) and isinstance(tp, type) and is_dataclass(tp):
            kwargs[key] = _build(tp, value, path)
    return cls(**kwargs)


def from_dict(data: dict, path: str = "config") -> RunConfig:
    """Rebuild a RunConfig from `to_dict` output (e.g. a run's config.json)."""
    data = dict(data)
    optim = data.pop("optim", None) or {}
    qat = data.pop("qat", None)
    cfg = _build(RunConfig, data, path)
    name = optim.get("name", "adamw")
    if name not in OPTIMIZERS:
        raise OptquantError(f"{path}: unknown optimizer {name!r}")
    return replace(
        cfg,
        optim=_build(OPTIMIZERS[name], optim, path),
        qat=None if qat is None else _build(QATConfig, qat, path),
    )

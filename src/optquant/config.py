"""RunConfig: one training run, composed of frozen per-component configs; presets, TOML and dotted overrides.

Overrides are dotted paths checked against field types (`optim.lr=3e-3`, `model.n_layer=4`).
`optim.name=muon` swaps the optimizer config for that optimizer's defaults (applied before the other
`optim.*` overrides); `qat.method=quest` creates a QAT section; `qat=none` removes it; `robust.method=penalty`
(quant/robust_config.py) switches on a quantization-robust training method. A TOML file is the
same thing written as tables (`[optim] name = "muon"`), plus an optional top-level `preset`, its values
checked as TOML typed them. No YAML, no exec: every --set string is parsed by the type of the field it sets.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

from optquant.data import DataConfig
from optquant.errors import OptquantError
from optquant.files import read_text
from optquant.model import MODEL_PRESETS, ModelConfig, model_config
from optquant.optim import OPTIMIZERS, AdamWConfig, optimizer_config, optimizer_config_class
from optquant.optim.plugin import PluginConfig, safe_name
from optquant.optim.ranges import NONNEG, ONE_UP, POSITIVE, UNIT, Range
from optquant.quant.qat_config import QATConfig
from optquant.quant.robust_config import RobustConfig
from optquant.tracking import LogConfig


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
    # Diverged: a NaN/inf loss, or a train or validation loss above diverge_factor × ln(vocab_size), the loss
    # of a uniform guess (where every run starts). 0 = only NaN/inf counts.
    diverge_factor: float = 3.0


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: Any = field(default_factory=AdamWConfig)  # one of the OPTIMIZERS config classes
    train: TrainConfig = field(default_factory=TrainConfig)
    qat: QATConfig | None = None  # quantization-aware training from scratch when set
    robust: RobustConfig = field(default_factory=RobustConfig)  # method "none": not part of the hash
    seed: int = 0
    log: LogConfig = field(default_factory=LogConfig)  # experiment tracking; not part of the config hash
    preset: str = ""  # the size preset it was built from (a study's size): a label, not part of the hash


# Run presets: a model size and the batch settings that suit it. The budget follows from
# train.tokens_per_param unless train.steps is set.
RUN_PRESETS: dict[str, dict[str, Any]] = {
    **dict.fromkeys(("zepto", "atto", "femto", "pico", "nano"), {"train.batch_size": 16, "train.eval_every": 25}),
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
    cfg = RunConfig(name=name, model=model_config(name), preset=name)
    return apply_overrides(cfg, [f"{k}={v}" for k, v in RUN_PRESETS[name].items()])


def config_hash(cfg: Any) -> str:
    """The run id's hash. Left out: `log` (where a run is logged), `preset` (a label), `train.compile` (how
    it executes) and `data.max_epochs` (a guard) are not which run it is, and run ids from before those settings
    existed stay valid; so does `robust` with method "none" (the plain run, as before the section existed) and
`model.norm`/`model.embed_proj` at their defaults. A
    renamed optimizer field is hashed under its old name (the config's LEGACY_NAMES), so the rename kept every
    run id."""
    data = to_dict(cfg)
    for new, old in getattr(getattr(cfg, "optim", None), "LEGACY_NAMES", {}).items():
        data["optim"][old] = data["optim"].pop(new)
    if isinstance(cfg, RunConfig):
        data.pop("log", None)
        data.pop("preset", None)
        if cfg.robust.method == "none":
            data.pop("robust", None)
        for name, default in (("norm", "rms"), ("embed_proj", False)):  # OSP's options, off: as before them
            if data["model"].get(name) == default:
                data["model"].pop(name)
    if isinstance(data.get("train"), dict):
        data["train"].pop("compile", None)
    if isinstance(data.get("data"), dict):
        data["data"].pop("max_epochs", None)  # a guard on the run, not which run it is
    return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def run_id(cfg: RunConfig) -> str:
    return f"{cfg.name}-{safe_name(cfg.optim.name)}-{config_hash(cfg)}"


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
            number = tp(float(value)) if tp is int and float(value).is_integer() else tp(value)
        except (ValueError, OverflowError):
            raise OptquantError(f"--set {path}={value}: expected a number ({tp.__name__})") from None
        if isinstance(number, float) and not math.isfinite(number):
            raise OptquantError(f"--set {path}={value}: must be a finite number")
        return number
    if tp is str:
        return value
    if origin in (tuple, list):
        return tp(parse_value(v.strip(), args[0], path) for v in value.strip("()[]").split(",") if v.strip())
    raise OptquantError(f"--set {path}: cannot set a field of type {tp}")


# --- validation: every field's type and range, checked whenever a config is built ----------------

# (low, high, low inclusive, high inclusive) by field name (optim/ranges.py); a config's own RANGES (every
# optimizer's) win, then a `<section>.<field>` entry, then the bare name. `lr` is every optimizer's peak
# learning rate. Fields not listed only have their type checked.
_RANGES: dict[str, Range] = {
    **dict.fromkeys(("lr", "rope_base", "init_std", "cl_threshold"), POSITIVE),
    **dict.fromkeys(("tokens_per_param", "steps", "diverge_factor", "split_seed", "cl_eval_every", "cl_eval_from"),
                    NONNEG),
    **dict.fromkeys(("batch_size", "grad_accum", "eval_every", "eval_batches", "n_layer", "d_model", "n_head",
                     "n_kv_head", "mlp_ratio"), ONE_UP),
    **dict.fromkeys(("warmup_frac", "decay_frac"), UNIT),
    "seed": (0, 2**31 - 1, True, True),  # numpy seeds must fit 32 bits; offsets are added to it
    "seq_len": (2, math.inf, True, False),
    "vocab_size": (257, 2**31 - 1, True, True),
    "robust.every": ONE_UP,
}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # a run's or a study's name: it names a directory
MAX_NAME = 128  # a run directory's name adds the optimizer and a hash; file names stop at 255 bytes


def _check_type(value: Any, tp: Any, path: str) -> None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(value, arg, path)
            except OptquantError as e:
                errors.append(str(e))
        raise OptquantError(errors[0] if errors else f"{path}: None is not allowed")
    if origin is Literal:
        if value not in args or type(value) is not type(args[args.index(value)]):
            raise OptquantError(f"{path}={value!r}: choose one of {', '.join(map(str, args))}")
        return
    if origin in (tuple, list):
        if not isinstance(value, tuple | list):
            raise OptquantError(f"{path}={value!r}: expected a list")
        for v in value:
            _check_type(v, args[0], path)
        return
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and not (math.isfinite(value) if isinstance(value, float) else abs(value) < 2**1000):
            raise OptquantError(f"{path}={value}: must be a finite number")
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
        if ok and "\0" in value:
            raise OptquantError(f"{path}: contains a NUL character")
    elif tp is bool:
        ok = isinstance(value, bool)
    elif is_dataclass(tp):
        ok = isinstance(value, tp)
    else:
        ok = True
    if not ok:
        raise OptquantError(f"{path}={value!r}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__}")


def field_range(owner: type, section: str, name: str) -> Range | None:
    """The rule `validate` applies to field `name` of config class `owner` at dotted `section` ("" at the top
    level): the class's own RANGES (every optimizer's), then `<section>.<name>` or `name` in _RANGES; None = its
    type only. docs/configuration.py documents every field's range with it."""
    own = getattr(owner, "RANGES", {})
    return own.get(name) or next((_RANGES[k] for k in (f"{section}.{name}", name) if k in _RANGES), None)


def _check_range(value: Any, rule: Range | None, path: str) -> None:
    if rule is None or value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return
    lo, hi, lo_in, hi_in = rule
    if (value < lo or (value == lo and not lo_in)) or (value > hi or (value == hi and not hi_in)):
        interval = f"{'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"
        raise OptquantError(f"{path}={value}: must be in {interval}")


def _check_fields(obj: Any, section: str) -> None:
    for f in fields(obj):
        value, tp = getattr(obj, f.name), _field_types(type(obj))[f.name]
        path = f"{section}.{f.name}" if section else f.name
        if f.name == "optim" and not section:
            if type(value) not in (*OPTIMIZERS.values(), PluginConfig):
                raise OptquantError(f"optim: not an optimizer config ({type(value).__name__})")
        else:
            _check_type(value, tp, path)
        if is_dataclass(value):
            _check_fields(value, path)
        else:
            _check_range(value, field_range(type(obj), section, f.name), path)


def validate(cfg: RunConfig) -> RunConfig:
    """Check every field of `cfg` for type and range, and the fields' mutual constraints; returns it.

    Runs whenever a config is built (presets, TOML, --set, config.json), so bad input fails before a run
    directory exists."""
    if isinstance(cfg.optim, PluginConfig) and math.isnan(cfg.optim.lr):
        raise OptquantError(f"optimizer plugin {cfg.optim.name!r} declares no default_lr: set optim.lr=... "
                            f"(in a study: lrs.{cfg.optim.name}=...)")
    _check_fields(cfg, "")
    if not NAME.fullmatch(cfg.name) or len(cfg.name) > MAX_NAME:
        raise OptquantError(f"name={cfg.name[:40]!r}{'…' if len(cfg.name) > 40 else ''}: use at most {MAX_NAME} "
                            "letters, digits and . _ + - (it names the run directory)")
    if cfg.preset and not NAME.fullmatch(cfg.preset):
        raise OptquantError(f"preset={cfg.preset!r}: use letters, digits and . _ + - (it labels the run's size)")
    tc = cfg.train
    if tc.batch_size % tc.grad_accum:
        raise OptquantError(f"train.batch_size={tc.batch_size} is not divisible by train.grad_accum={tc.grad_accum}")
    if tc.steps == 0 and tc.tokens_per_param == 0:
        raise OptquantError("train.steps=0 and train.tokens_per_param=0: set a step count or a token budget")
    if tc.warmup_frac + tc.decay_frac > 1:
        raise OptquantError(f"train.warmup_frac + train.decay_frac = {tc.warmup_frac + tc.decay_frac} exceeds 1")
    if 0 < tc.diverge_factor <= 1:
        raise OptquantError(f"train.diverge_factor={tc.diverge_factor}: must be above 1 (× ln vocab), or 0 = off")
    if not cfg.data.source or not cfg.data.text_field:
        raise OptquantError("data.source and data.text_field must not be empty")
    try:
        cfg.model.validate()
    except ValueError as e:
        raise OptquantError(str(e)) from None
    cfg.robust.check()
    if cfg.robust.method != "none" and cfg.qat is not None:
        raise OptquantError(f"robust.method={cfg.robust.method} trains a plain model: unset qat (qat=none)")
    return cfg


# get_type_hints re-evaluates every annotation: a large share of a smoke study's time uncached (docs/benchmarks.md)
@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_type(cfg: Any, keys: list[str], path: str) -> Any:
    """The type of the field at `keys` (a dotted path, split) of dataclass `cfg`."""
    if not is_dataclass(cfg):
        raise OptquantError(f"--set {path}: {'.'.join(keys[:-1]) or path} has no fields")
    key, types_ = _current_name(type(cfg), keys[0]), _field_types(type(cfg))
    if key not in types_:
        known = ", ".join(f.name for f in fields(cfg))
        raise OptquantError(f"--set {path}: unknown field {key!r} (known: {known})")
    if len(keys) == 1:
        return types_[key]
    inner = getattr(cfg, key)
    return field_type(QATConfig() if inner is None and key == "qat" else inner, keys[1:], path)


def set_field(cfg: Any, keys: list[str], value: str, path: str) -> Any:
    """A copy of dataclass `cfg` with the field at `keys` (a dotted path, split) set to `value`, parsed."""
    return _set(cfg, keys, parse_value(value, field_type(cfg, keys, path), path))


def _set(cfg: Any, keys: list[str], value: Any) -> Any:
    key = _current_name(type(cfg), keys[0])
    return replace(cfg, **{key: value if len(keys) == 1 else _set(getattr(cfg, key), keys[1:], value)})


def _switched(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """`cfg` with the switches of `values` applied: `optim.name` (that optimizer's defaults), `qat` (None
    removes QAT) and a `qat.*` key (creates a QATConfig)."""
    if "optim.name" in values:
        if not isinstance(name := values["optim.name"], str):
            raise OptquantError(f"optim.name={name!r}: expected str, got {type(name).__name__}")
        cfg = replace(cfg, optim=optimizer_config(name))
    if "qat" in values:
        if values["qat"] is not None:
            raise OptquantError("--set qat=...: only qat=none; set qat.method=quest to enable QAT")
        cfg = replace(cfg, qat=None)
    if cfg.qat is None and any(k.startswith("qat.") for k in values):
        cfg = replace(cfg, qat=QATConfig())
    return cfg


def override(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """A copy of `cfg` with each dotted field of `values` set to its (typed) value, then validated: the
    switches first (`optim.name`, `qat`: see `_switched`), then every other field."""
    cfg = _switched(cfg, values)
    for key, value in values.items():
        if key not in ("optim.name", "qat"):
            tp = field_type(cfg, key.split("."), key)  # an unknown field is one error naming it
            _check_type(value := _widened(value, tp), tp, key)  # before a class's __post_init__ compares it
            cfg = _set(cfg, key.split("."), value)
    return validate(cfg)


def _widened(value: Any, tp: Any) -> Any:
    """A typed value (TOML's) as its field holds it: an int where a float belongs as that float (so that the
    run id is the one `--set` gives), a list as a tuple. Nothing else is converted: validate checks the type."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if type(value) is int and float in args and int not in args:
        return float(value)
    inner = [typing.get_args(a)[0] for a in args if typing.get_origin(a) in (tuple, list)]
    return tuple(_widened(v, inner[0]) for v in value) if isinstance(value, list) and inner else value


def parse_overrides(cfg: RunConfig, overrides: list[str]) -> dict[str, Any]:
    """`a.b=value` strings (--set, TOML, a study's settings) as {dotted key: value parsed by its field's type};
    a key given twice keeps its last value."""
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise OptquantError(f"--set {item}: expected key=value, e.g. optim.lr=3e-3")
        key, value = item.split("=", 1)
        pairs.append((key.strip(), value.strip()))
    switches = {k: v for k, v in pairs if k in ("optim.name", "qat")}
    if switches.get("qat", "").lower() in ("none", "off", "null"):
        switches["qat"] = None  # anything else is _switched's error
    shape = _switched(cfg, {**dict.fromkeys(k for k, _ in pairs), **switches})  # the fields the values go to
    values: dict[str, Any] = {}
    for key, value in pairs:
        values.pop(key, None)  # the last one wins, in its place
        values[key] = switches[key] if key in switches else \
            parse_value(value, field_type(shape, key.split("."), key), key)
    return values


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `a.b=value` overrides (optimizer and QAT switches first)."""
    return override(cfg, parse_overrides(cfg, overrides))


def _flatten_toml(table: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        out.update(_flatten_toml(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def read_toml(path: Path) -> tuple[str | None, dict[str, Any]]:
    """(preset, {dotted key: value as TOML typed it}) from a TOML run or study file."""
    try:
        table = tomllib.loads(read_text(path, "TOML"))
    except tomllib.TOMLDecodeError as e:
        raise OptquantError(f"{path}: not valid TOML ({e})") from None
    preset = table.pop("preset", None)
    if preset is not None and not isinstance(preset, str):
        raise OptquantError(f"{path}: preset must be a string, got {preset!r}")
    return preset, _flatten_toml(table)


def load_toml(path: Path) -> tuple[str | None, list[str]]:
    """(preset, `k=v` overrides) from a TOML study file, whose settings the study spec parses as strings."""
    preset, values = read_toml(path)
    return preset, [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in values.items()]


def resolve(preset: str | None, toml_path: Path | None, overrides: list[str]) -> RunConfig:
    """preset → TOML file → --set overrides, each later one winning (the switches first, wherever they are).
    TOML values keep TOML's types: a list or a string where a number belongs is an error naming the key."""
    toml_preset, toml_values = read_toml(toml_path) if toml_path else (None, {})
    if isinstance(toml_values.get("qat"), str) and toml_values["qat"].lower() in ("none", "off", "null"):
        toml_values["qat"] = None  # `qat = "none"`: TOML has no null
    cfg = run_preset(preset or toml_preset or "tiny")
    try:
        shape = _switched(cfg, toml_values)  # the TOML's optimizer and QAT section, which --set values go to
    except OptquantError as e:
        raise OptquantError(f"{toml_path}: {e}") from None
    values = dict(toml_values)
    for key, value in parse_overrides(shape, list(overrides)).items():
        values.pop(key, None)  # the last one wins, in its place
        values[key] = value
    return override(cfg, values)


def _current_name(cls: type, key: str) -> str:
    """A field's name now, for `key` that may be its old name (an optimizer config's LEGACY_NAMES)."""
    return next((new for new, old in getattr(cls, "LEGACY_NAMES", {}).items() if old == key), key)


def _build(cls: type, data: dict, path: str) -> Any:
    types_ = _field_types(cls)
    kwargs = {}
    for given, value in data.items():
        key = _current_name(cls, given)  # an old config.json spells a renamed field by its old name
        if key != given and key in data:
            raise OptquantError(f"{path}: both {key!r} and its old name {given!r}")
        if key not in types_:
            raise OptquantError(f"{path}: unknown field {key!r} for {cls.__name__}")
        tp = types_[key]
        kwargs[key] = tuple(value) if isinstance(value, list) else value
        if isinstance(value, dict) and isinstance(tp, type) and is_dataclass(tp):
            kwargs[key] = _build(tp, value, path)
    return cls(**kwargs)


def _check_plugin_record(name: Any, optim: dict, path: str) -> None:
    """A plugin optimizer in a record is kept as its name and lr, never imported: a run directory may come
    from someone else, and only training needs the optimizer (it loads the plugin the user names)."""
    if not isinstance(name, str) or not name:
        raise OptquantError(f"{path}: optim.name must be an optimizer's name, got {name!r}")
    lr = optim.get("lr")
    if name not in OPTIMIZERS and (not isinstance(lr, int | float) or isinstance(lr, bool) or not math.isfinite(lr)):
        raise OptquantError(f"{path}: optimizer plugin {name!r} has no finite optim.lr in the record")


def from_dict(data: dict, path: str = "config") -> RunConfig:
    """Rebuild a RunConfig from `to_dict` output (e.g. a run's config.json). Never imports a plugin it names."""
    if not isinstance(data, dict):
        raise OptquantError(f"{path}: not a run config (a JSON object)")
    data = dict(data)
    optim = data.pop("optim", None) or {}
    qat = data.pop("qat", None)
    if not isinstance(optim, dict) or not (qat is None or isinstance(qat, dict)):
        raise OptquantError(f"{path}: optim and qat must be tables")
    try:
        cfg = _build(RunConfig, data, path)
        name = optim.get("name", "adamw")
        _check_plugin_record(name, optim, path)
        cfg = replace(cfg,
                      optim=_build(optimizer_config_class(name), optim, path),
                      qat=None if qat is None else _build(QATConfig, qat, path))
    except (TypeError, ValueError) as e:
        raise OptquantError(f"{path}: not a valid run config ({e})") from None
    try:
        return validate(cfg)
    except OptquantError as e:
        raise OptquantError(f"{path}: {e}") from None

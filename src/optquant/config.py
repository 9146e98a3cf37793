"""RunConfig: one training run, composed of frozen per-component configs; presets, TOML and dotted overrides.

Overrides are dotted paths (`optim.lr=3e-3`, `model.n_layer=4`). `optim.name=muon` swaps the optimizer config
for that optimizer's defaults (applied before the other `optim.*` overrides); `qat.method=quest` creates a QAT
section; `qat=none` removes it; `robust.method=penalty` (quant/robust_config.py) switches on a
quantization-robust training method. A TOML file is the same thing written as tables (`[optim] name = "muon"`),
plus an optional top-level `preset`. Every config is checked by msgspec, as a dict of typed values, against the
dataclasses' annotations: types as TOML and JSON give them (no string is read as a number), and each field's
range where the field is declared (optquant.ranges); a --set string is first parsed by its field's type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from optquant.data import DataConfig
from optquant.errors import OptquantError
from optquant.files import read_text
from optquant.model import MODEL_PRESETS, ModelConfig, model_config
from optquant.optim import OPTIMIZERS, AdamWConfig, PluginConfig, optimizer_config
from optquant.optim.plugin import safe_name
from optquant.quant.qat_config import QATConfig
from optquant.quant.robust_config import RobustConfig
from optquant.ranges import Count, Natural, NonNegative, Positive, Seed, Unit
from optquant.tracking import LogConfig

MAX_NAME = 128  # a run directory's name adds the optimizer and a hash; file names stop at 255 bytes
NAME = r"[A-Za-z0-9][A-Za-z0-9._+-]*"  # letters, digits and . _ + -, not starting with a mark: it names a directory


@dataclass(frozen=True)
class TrainConfig:
    """The training loop's own settings (paper.md §2.3 for the defaults)."""

    batch_size: Count = 16  # sequences per optimizer step (global), split into grad_accum micro-batches
    grad_accum: Count = 1
    tokens_per_param: NonNegative = 20.0  # the paper's Chinchilla ratio; used when steps == 0
    budget_params: Literal["total", "non_embedding"] = "total"  # which N the ratio multiplies
    steps: Natural = 0  # explicit optimizer steps; 0 = from tokens_per_param
    schedule: Literal["wsd", "cosine"] = "wsd"  # WSD: linear warm-up, constant, linear decay to 0
    warmup_frac: Unit = 0.05
    decay_frac: Unit = 0.20
    eval_every: Count = 100  # steps between evaluations; a checkpoint is written at each evaluation
    eval_batches: Count = 8
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto = bf16 autocast where it is fast
    cl_threshold: Positive | None = None  # Common Loss: keep the model that first reaches this val loss
    stop_at_cl: bool = False  # end the run at that first crossing (a study's CL re-run needs no more)
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile; auto = on for CUDA (not in the run id)
    cl_eval_every: Natural = 0  # while the CL is not reached: also evaluate every this many steps (0 = off)
    cl_eval_from: Natural = 0  # ... from this step on (the last regular evaluation before the crossing)
    keep_history: bool = False  # keep the checkpoint of every evaluation in history/ (a study's LR sweep)
    # Diverged: a NaN/inf loss, or a train or validation loss above diverge_factor × ln(vocab_size), the loss
    # of a uniform guess (where every run starts). 0 = only NaN/inf counts.
    diverge_factor: NonNegative = 3.0


@dataclass(frozen=True)
class RunConfig:
    name: Annotated[str, Meta(pattern=f"^{NAME}\\Z", max_length=MAX_NAME)] = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: Any = field(default_factory=AdamWConfig)  # one of the OPTIMIZERS config classes
    train: TrainConfig = field(default_factory=TrainConfig)
    qat: QATConfig | None = None  # quantization-aware training from scratch when set
    robust: RobustConfig = field(default_factory=RobustConfig)  # method "none": not part of the hash
    seed: Seed = 0
    log: LogConfig = field(default_factory=LogConfig)  # experiment tracking; not part of the config hash
    # the size preset it was built from (a study's size): a label, not part of the hash
    preset: Annotated[str, Meta(pattern=f"^({NAME})?\\Z")] = ""


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
    return override(cfg, RUN_PRESETS[name])


def config_hash(cfg: RunConfig) -> str:
    """The run id's hash. Left out: `log` (where a run is logged), `preset` (a label), `train.compile` (how
    it executes) and `data.max_epochs` (a guard) are not which run it is, and run ids from before those settings
    existed stay valid; so does `robust` with method "none" (the plain run, as before the section existed) and
`model.norm`/`model.embed_proj`/`model.block`/`model.attn_gate` at their defaults. A
    renamed optimizer field is hashed under its old name (the config's LEGACY_NAMES), so the rename kept every
    run id."""
    data = to_dict(cfg)
    for new, old in getattr(cfg.optim, "LEGACY_NAMES", {}).items():
        data["optim"][old] = data["optim"].pop(new)
    for key in ("log", "preset", *(["robust"] if cfg.robust.method == "none" else [])):
        del data[key]
    for name, default in (("norm", "rms"), ("embed_proj", False), ("block", "standard"), ("attn_gate", False)):
        if data["model"][name] == default:
            del data["model"][name]
    del data["train"]["compile"], data["data"]["max_epochs"]  # how it executes, a guard: not which run it is
    return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def run_id(cfg: RunConfig) -> str:
    return f"{cfg.name}-{safe_name(cfg.optim.name)}-{config_hash(cfg)}"


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


# --- building a config: a dict of typed values, checked by msgspec against the dataclasses' annotations ------


def validate(cfg: RunConfig) -> RunConfig:
    """`cfg` checked as every config is built (presets, TOML, --set, config.json): each field's type and range,
    then the fields' mutual constraints; bad input fails before a run directory exists. Returns `cfg` itself."""
    _decode(to_dict(cfg))
    return cfg


def _decode(data: dict) -> RunConfig:
    optim = data.get("optim", {})
    if not isinstance(optim, dict) or not isinstance(name := optim.get("name", "adamw"), str) or not name:
        raise OptquantError(f"optim={optim!r}: expected a table with an optimizer's name")
    if name not in OPTIMIZERS and (not isinstance(lr := optim.get("lr"), int | float) or math.isnan(lr)):
        raise OptquantError(f"optimizer plugin {name!r} declares no default_lr: set optim.lr=... "
                            f"(in a study: lrs.{name}=...)")
    cls = OPTIMIZERS.get(name, PluginConfig)  # never imports a plugin: its record or its defaults carry its lr
    cfg = _convert(RunConfig, {**data, "optim": _convert(cls, optim, "optim.")})
    for path, value in _leaves(to_dict(cfg)):
        if isinstance(value, float) and not math.isfinite(value):
            raise OptquantError(f"{path}={value}: must be a finite number")
    tc = cfg.train
    if tc.batch_size % tc.grad_accum:
        raise OptquantError(f"train.batch_size={tc.batch_size} is not divisible by train.grad_accum={tc.grad_accum}")
    if tc.steps == 0 and tc.tokens_per_param == 0:
        raise OptquantError("train.steps=0 and train.tokens_per_param=0: set a step count or a token budget")
    if tc.warmup_frac + tc.decay_frac > 1:
        raise OptquantError(f"train.warmup_frac + train.decay_frac = {tc.warmup_frac + tc.decay_frac} exceeds 1")
    if 0 < tc.diverge_factor <= 1:
        raise OptquantError(f"train.diverge_factor={tc.diverge_factor}: must be above 1 (× ln vocab), or 0 = off")
    try:
        cfg.model.validate()
    except ValueError as e:
        raise OptquantError(str(e)) from None
    cfg.robust.check()
    if cfg.robust.method != "none" and cfg.qat is not None:
        raise OptquantError(f"robust.method={cfg.robust.method} trains a plain model: unset qat (qat=none)")
    return cfg


def _convert(cls: type, data: Any, prefix: str = "") -> Any:
    """msgspec's conversion of `data` to dataclass `cls`, its error as one line naming the dotted key and value
    (msgspec ignores a dataclass's unknown fields: `_known` refuses them first)."""
    try:
        return msgspec.convert(_known(cls, data, prefix) if isinstance(data, dict) else data, cls)
    except msgspec.ValidationError as e:
        message, _, at = str(e).partition(" - at `$.")
        if not at:
            raise OptquantError(message) from None
        keys, value, tp = at.rstrip("`").split("."), data, cls
        for key in (k.partition("[")[0] for k in keys):
            value = value.get(key) if isinstance(value, dict) else None
            tp = _field_types(tp).get(key) if is_dataclass(tp) else None
        raise OptquantError(f"{prefix}{'.'.join(keys)}={value!r}: {message}{_choices(tp)}") from None


def _choices(tp: Any) -> str:
    return f" (choose one of {', '.join(map(str, typing.get_args(tp)))})" if typing.get_origin(tp) is Literal else ""


def _known(cls: type, data: dict, prefix: str) -> dict:
    """`data` with old field names renamed (an optimizer's LEGACY_NAMES); an unknown field, or one given under
    both names, is an error naming it."""
    types_, out = _field_types(cls), {}
    for given, value in data.items():
        key = _current_name(cls, given)
        if key != given and key in data:
            raise OptquantError(f"{prefix}{given}: both {key!r} and its old name {given!r}")
        if key not in types_:
            raise OptquantError(f"{prefix}{given}: unknown field {key!r} for {cls.__name__}")
        inner = [a for a in (types_[key], *typing.get_args(types_[key])) if is_dataclass(a)]
        out[key] = _known(inner[0], value, f"{prefix}{key}.") if inner and isinstance(value, dict) else value
    return out


def _leaves(data: dict, prefix: str = ""):
    for key, value in data.items():
        yield from _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]


def _current_name(cls: type, key: str) -> str:
    """A field's name now, for `key` that may be its old name (an optimizer config's LEGACY_NAMES)."""
    return next((new for new, old in getattr(cls, "LEGACY_NAMES", {}).items() if old == key), key)


# get_type_hints re-evaluates every annotation: a large share of a smoke study's time uncached (docs/benchmarks.md)
@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(data: dict, path: str = "config") -> RunConfig:
    """Rebuild a RunConfig from `to_dict` output (e.g. a run's config.json). Never imports a plugin it names."""
    if not isinstance(data, dict):
        raise OptquantError(f"{path}: not a run config (a JSON object)")
    try:
        return _decode(data)
    except OptquantError as e:
        raise OptquantError(f"{path}: {e}") from None


# --- overrides: dotted keys, typed values or --set strings --------------------------------------------------

_WORDS = {"none": None, "null": None, "yes": True, "on": True, "no": False, "off": False}


def field_type(cfg: Any, keys: list[str], path: str) -> tuple[list[str], Any]:
    """The current names along `keys` (a dotted path, split) of dataclass `cfg`, and the type of their field."""
    if not is_dataclass(cfg):
        raise OptquantError(f"--set {path}: {'.'.join(keys[:-1]) or path} has no fields")
    key, types_ = _current_name(type(cfg), keys[0]), _field_types(type(cfg))
    if key not in types_:
        raise OptquantError(f"--set {path}: unknown field {key!r} (known: {', '.join(types_)})")
    if len(keys) == 1:
        return [key], types_[key]
    names, tp = field_type(getattr(cfg, key), keys[1:], path)
    return [key, *names], tp


def typed(value: Any, tp: Any, path: str) -> Any:
    """`value` as type `tp`, a finite number where it is one. A --set string (SetText) is parsed by `tp`: msgspec's
    lax conversion (numbers, true/false/1/0, null), with none, yes/no and on/off as words and a list as
    comma-separated values; a TOML or JSON value is checked as it is typed (no string is read as a number; an int
    is a float where a float belongs)."""
    lax = isinstance(value, SetText)
    text = value.strip() if lax else value
    if lax and typing.get_origin(tp) in (tuple, list):
        text = [v.strip() for v in text.strip("()[]").split(",") if v.strip()]
    try:
        out = msgspec.convert(text, tp, strict=not lax)
    except msgspec.ValidationError as e:
        error = e
        if lax and isinstance(text, str) and text.lower() in _WORDS:
            with contextlib.suppress(msgspec.ValidationError):
                out, error = msgspec.convert(_WORDS[text.lower()], tp), None
        if error:
            shown = f"--set {path}={value}" if lax else f"{path}={value!r}"
            raise OptquantError(f"{shown}: {error}{_choices(tp)}") from None
    if any(isinstance(v, float) and not math.isfinite(v) for v in (out if isinstance(out, tuple | list) else [out])):
        raise OptquantError(f"{'--set ' * lax}{path}={value}: must be a finite number")
    return out


def set_field(cfg: Any, keys: list[str], value: Any, path: str) -> Any:
    """A copy of dataclass `cfg` (a study spec, a GPU plan) with the field at `keys` set to `value` (`typed`),
    checked by msgspec against its annotations (each field's range), as a RunConfig is."""
    names, tp = field_type(cfg, keys, path)
    changed = to_dict(_set(cfg, names, typed(value, tp, path)))
    return _convert(type(cfg), changed, path.removesuffix(".".join(keys)))


def _set(cfg: Any, keys: list[str], value: Any) -> Any:
    return replace(cfg, **{keys[0]: value if len(keys) == 1 else _set(getattr(cfg, keys[0]), keys[1:], value)})


class SetText(str):
    """A --set string, which `override` parses by the type of the field it sets (TOML's values keep theirs)."""


def _switched(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """`cfg` with the switches of `values` applied: `optim.name` (that optimizer's defaults), `qat` (none
    removes QAT) and a `qat.*` key (creates a QATConfig)."""
    if "optim.name" in values:
        if not isinstance(name := values["optim.name"], str):
            raise OptquantError(f"optim.name={name!r}: expected str, got {type(name).__name__}")
        cfg = replace(cfg, optim=optimizer_config(str(name)))
    if "qat" in values:
        if str(values["qat"]).lower() not in ("none", "off", "null"):  # `qat = "none"`: TOML has no null
            raise OptquantError("--set qat=...: only qat=none; set qat.method=quest to enable QAT")
        cfg = replace(cfg, qat=None)
    if cfg.qat is None and any(k.startswith("qat.") for k in values):
        cfg = replace(cfg, qat=QATConfig())
    return cfg


def override(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """A copy of `cfg` with each dotted field of `values` set to its value (typed, or a --set string parsed by
    the field's type), then validated: the switches first (`optim.name`, `qat`: see `_switched`), wherever they
    are, then every other field."""
    cfg = _switched(cfg, values)
    data = to_dict(cfg)
    for key, value in values.items():
        if key not in ("optim.name", "qat"):
            (*sections, name), tp = field_type(cfg, key.split("."), key)  # an unknown field: one error naming it
            if is_dataclass(tp) or tp is Any:  # a section (optim: any optimizer's)
                raise OptquantError(f"{key}={value!r}: a section; set its fields ({key}.FIELD=...)")
            value = typed(value, tp, key) if isinstance(value, SetText) else value
            functools.reduce(dict.__getitem__, sections, data)[name] = value
    return _decode(data)


def settings(items: list, example: str = "optim.lr=3e-3") -> list[tuple[str, Any]]:
    """(dotted key, value) pairs from `a.b=value` strings (--set: the value a string that its field's type parses)
    and pairs given as they are (a TOML file's, typed)."""
    out = []
    for item in items:
        if isinstance(item, str) and "=" in item:
            key, value = item.split("=", 1)
            item = (key.strip(), SetText(value.strip()))
        elif not isinstance(item, tuple):
            raise OptquantError(f"--set {item}: expected key=value, e.g. {example}")
        out.append(item)
    return out


def typed_overrides(overrides: list, optim: str = "adamw") -> dict[str, Any]:
    """`settings` as {dotted key: value typed by its field} in a run of optimizer `optim`: a study's settings,
    typed once when its spec is built; `override` takes them as they are."""
    shape = RunConfig(optim=optimizer_config(optim), qat=QATConfig())
    return {key: typed(value, str if key in ("optim.name", "qat") else field_type(shape, key.split("."), key)[1],
                       key) for key, value in settings(overrides)}


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `a.b=value` overrides (optimizer and QAT switches first)."""
    return override(cfg, dict(settings(overrides)))  # a key given twice: its last value


def read_toml(path: Path) -> tuple[str | None, dict[str, Any]]:
    """(preset, {dotted key: value as TOML typed it}) from a TOML run or study file."""
    try:
        table = tomllib.loads(read_text(path, "TOML"))
    except tomllib.TOMLDecodeError as e:
        raise OptquantError(f"{path}: not valid TOML ({e})") from None
    preset = table.pop("preset", None)
    if preset is not None and not isinstance(preset, str):
        raise OptquantError(f"{path}: preset must be a string, got {preset!r}")
    return preset, dict(_leaves(table))


def resolve(preset: str | None, toml_path: Path | None, overrides: list) -> RunConfig:
    """preset → TOML file → --set overrides (`settings`), each later one winning (the switches first, wherever).
    TOML values keep TOML's types: a list or a string where a number belongs is an error naming the key."""
    toml_preset, values = read_toml(toml_path) if toml_path else (None, {})
    return override(run_preset(preset or toml_preset or "tiny"), dict(settings([*values.items(), *overrides])))

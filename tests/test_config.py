"""Config tests: overrides are typed and checked, switches build the right sections, records round-trip."""

import pytest

from optquant.config import (
    RunConfig,
    apply_overrides,
    config_hash,
    from_dict,
    override,
    resolve,
    run_id,
    run_preset,
    to_dict,
)
from optquant.errors import OptquantError
from optquant.optim import OPTIMIZERS


def test_typed_overrides():
    cfg = apply_overrides(run_preset("nano"), ["optim.lr=3e-3", "model.n_layer=3", "train.precision=fp32",
                                               "train.cl_threshold=4.5", "data.source=/x"])
    assert cfg.optim.lr == 3e-3 and cfg.model.n_layer == 3 and cfg.train.precision == "fp32"
    assert cfg.train.cl_threshold == 4.5 and cfg.data.source == "/x"
    assert apply_overrides(cfg, ["train.cl_threshold=none"]).train.cl_threshold is None


def test_typed_values_give_the_config_their_strings_give():
    """`override` takes typed values (the study's own settings); the strings of --set and TOML are parsed into
    the same values, so both build the same run (the same run id)."""
    strings = ["optim.name=muon", "optim.lr=0.02", "optim.adam_lr_ratio=0.1", "seed=3", "train.keep_history=true",
               "train.cl_threshold=4.25", "qat.method=quest", "qat.w_bits=4"]
    values = {"optim.name": "muon", "optim.lr": 0.02, "optim.adam_lr_ratio": 0.1, "seed": 3,
              "train.keep_history": True, "train.cl_threshold": 4.25, "qat.method": "quest", "qat.w_bits": 4}
    typed, parsed = override(run_preset("nano"), values), apply_overrides(run_preset("nano"), strings)
    assert typed == parsed and config_hash(typed) == config_hash(parsed)
    with pytest.raises(OptquantError, match="unknown field 'lrr'"):
        override(run_preset("nano"), {"optim.lrr": 1.0})
    with pytest.raises(OptquantError, match="optim.lr=-1.0: Expected `float` > 0.0"):  # typed values: ranges
        override(run_preset("nano"), {"optim.lr": -1.0})
    with pytest.raises(OptquantError, match="optim.lr"):  # ... and type-checked
        override(run_preset("nano"), {"optim.lr": "fast"})


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_switch_uses_its_defaults(name):
    cfg = apply_overrides(run_preset("nano"), ["optim.lr=0.5", f"optim.name={name}"])  # order-free
    assert cfg.optim.name == name and cfg.optim.lr == 0.5
    assert type(cfg.optim) is OPTIMIZERS[name]


def test_qat_section_is_created_and_removed():
    cfg = apply_overrides(run_preset("nano"), ["qat.method=quest", "qat.w_bits=4", "qat.a_bits=8"])
    assert cfg.qat.method == "quest" and cfg.qat.a_bits == 8
    assert apply_overrides(cfg, ["qat=none"]).qat is None


@pytest.mark.parametrize("bad, message", [
    (["optim.lrr=1"], "unknown field 'lrr'"),
    (["optim.lr=fast"], "optim.lr=fast: Expected `float`, got `str`"),
    (["train.precision=fp8"], "choose one of auto, bf16, fp32"),
    (["optim.name=sgd"], "choose one of"),
    (["train.steps"], "expected key=value"),
    (["nothing.here=1"], "unknown field 'nothing'"),
])
def test_bad_overrides_are_one_line_errors(bad, message):
    with pytest.raises(OptquantError, match=message) as err:
        apply_overrides(run_preset("nano"), bad)
    assert "\n" not in str(err.value)


# Run ids of representative configs, printed by main's config.py at 5da5949 (before TOML values kept their types)
# with `run_id(apply_overrides(run_preset(preset), overrides))`: a change to how configs are parsed, built or
# hashed must leave every existing run directory findable.
HELD_IDS = [
    ("tiny", [], "tiny-adamw-a59aa3dccd"),
    ("nano", ["optim.name=muon", "optim.lr=0.01"], "nano-muon-d69e2aecd3"),
    ("pico", ["optim.name=shampoo", "optim.max_precondition_dim=256", "seed=3"], "pico-shampoo-df1a2d4b24"),
    ("micro", ["qat.method=quest", "qat.w_bits=4"], "micro-adamw-81e8dbbb9a"),
    ("nano", ["robust.method=penalty"], "nano-adamw-1acdd4c15f"),
    ("zepto", ["optim.name=psgd", "train.steps=50", "train.schedule=cosine"], "zepto-psgd-606aed474b"),
]


@pytest.mark.parametrize("preset, overrides, held", HELD_IDS)
def test_run_ids_are_held(tmp_path, preset, overrides, held):
    assert run_id(apply_overrides(run_preset(preset), overrides)) == held
    # the same run written as a TOML file (dotted keys; TOML's own types: 0.01 a float, 3 an int): the same id
    def toml(value: str) -> str:
        return value if value[0].isdigit() else f'"{value}"'

    lines = [f'preset = "{preset}"', *(f"{k} = {toml(v)}" for k, v in (o.split("=") for o in overrides))]
    (tmp_path / "run.toml").write_text("\n".join(lines) + "\n")
    assert run_id(resolve(None, tmp_path / "run.toml", [])) == held


@pytest.mark.parametrize("toml, message", [
    ('[optim]\nname = ["muon"]\n', "optim.name=['muon']: expected str, got list"),
    ('[qat]\nw_bits = "4"\n', "qat.w_bits='4': Expected `int`, got `str`"),
    ('[optim]\nlr = "0.01"\n', "optim.lr='0.01': Expected `float`, got `str`"),
    ('[model]\nn_layer = 2.5\n', "model.n_layer=2.5: Expected `int`, got `float`"),
    ('[train]\nwarmup_frac = 2.0\n', "train.warmup_frac=2.0: Expected `float` < 1.0"),
    ('[train]\nprecision = ["fp32"]\n', "train.precision=['fp32']: Expected `str`, got `array` (choose one of auto"),
])
def test_toml_values_keep_their_types(tmp_path, toml, message):
    """A TOML value is checked as TOML typed it, never re-read from its text: `name = ["muon"]` trained Muon and
    `w_bits = "4"` trained 4 bits when TOML was flattened into `k=v` strings."""
    (tmp_path / "run.toml").write_text(toml)
    with pytest.raises(OptquantError) as err:
        resolve(None, tmp_path / "run.toml", [])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_toml_ints_are_floats_where_floats_belong(tmp_path):
    (tmp_path / "run.toml").write_text("[optim]\nlr = 1\n[train]\ncl_threshold = 4\n")
    cfg = resolve(None, tmp_path / "run.toml", [])
    assert type(cfg.optim.lr) is float and type(cfg.train.cl_threshold) is float
    assert run_id(cfg) == run_id(resolve(None, None, ["optim.lr=1", "train.cl_threshold=4"]))


def test_set_switches_apply_before_toml_fields(tmp_path):
    """--set optim.name=muon with the TOML's optim.lr: the switch comes first, the lr goes to Muon."""
    (tmp_path / "run.toml").write_text("[optim]\nlr = 0.03\n[qat]\nw_bits = 3\n")
    cfg = resolve(None, tmp_path / "run.toml", ["optim.name=muon"])
    assert cfg.optim.name == "muon" and cfg.optim.lr == 0.03 and cfg.qat.w_bits == 3
    (tmp_path / "off.toml").write_text('qat = "none"\n')
    assert resolve(None, tmp_path / "off.toml", []).qat is None


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "micro"\nseed = 3\n[optim]\nname = "muon"\nlr = 0.01\n[train]\nsteps = 7\n')
    cfg = resolve(None, path, ["optim.lr=0.02"])
    assert cfg.model.d_model == 64 and cfg.seed == 3 and cfg.train.steps == 7
    assert cfg.optim.name == "muon" and cfg.optim.lr == 0.02
    (tmp_path / "bad.toml").write_text("[optim\n")
    with pytest.raises(OptquantError, match="not valid TOML"):
        resolve(None, tmp_path / "bad.toml", [])
    with pytest.raises(OptquantError, match="not found"):
        resolve(None, tmp_path / "missing.toml", [])


def test_record_round_trip_and_stable_hash():
    cfg = apply_overrides(run_preset("tiny"), ["optim.name=shampoo", "qat.method=quest"])
    again = from_dict(to_dict(cfg))
    assert again == cfg and config_hash(again) == config_hash(cfg)
    assert config_hash(apply_overrides(cfg, ["seed=1"])) != config_hash(cfg)


def test_preset_is_a_label_not_part_of_the_run_id():
    cfg = run_preset("nano")
    assert cfg.preset == "nano" and apply_overrides(cfg, ["name=study-x"]).preset == "nano"
    old = to_dict(cfg)
    del old["preset"]  # a config.json written before the field existed
    assert from_dict(old).preset == "" and config_hash(from_dict(old)) == config_hash(cfg)


# Regression fixture: the ids computed by the code before PSGD's `max_size_triangular` and Shampoo's
# `max_preconditioner_dim` were renamed `max_precondition_dim` (SOAP's name), at commit 425bb21. Studies
# resume by run id and results.parquet holds run ids, so the rename must not change any.
PRE_RENAME_IDS = {  # run_id of the tiny preset with optim.name=...
    "adamw": "tiny-adamw-a59aa3dccd", "muon": "tiny-muon-348d2e1553", "psgd": "tiny-psgd-94a778de93",
    "scion": "tiny-scion-a52512fa82", "shampoo": "tiny-shampoo-a7350f3037", "soap": "tiny-soap-399664f64a",
}
PRE_RENAME_CAPPED = {"psgd": "tiny-psgd-1288c4f118", "shampoo": "tiny-shampoo-72226100bc",
                     "soap": "tiny-soap-4459c4af80"}  # ... with the cap at 512
PRE_RENAME_HASHES = {"adamw": "aa4bbce625", "muon": "e06be105c9", "psgd": "4995d409bf", "scion": "ed997449a1",
                     "shampoo": "da292d80b0", "soap": "97109187cb"}  # config_hash(RunConfig(optim=<defaults>))
OLD_CAP_NAMES = {"psgd": "max_size_triangular", "shampoo": "max_preconditioner_dim"}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_run_ids_are_those_from_before_the_cap_rename(name):
    assert config_hash(RunConfig(optim=OPTIMIZERS[name]())) == PRE_RENAME_HASHES[name]
    cfg = apply_overrides(run_preset("tiny"), [f"optim.name={name}"])
    assert run_id(cfg) == PRE_RENAME_IDS[name]
    if name in PRE_RENAME_CAPPED:
        capped = apply_overrides(cfg, ["optim.max_precondition_dim=512"])
        assert run_id(capped) == PRE_RENAME_CAPPED[name]
        old = OLD_CAP_NAMES.get(name, "max_precondition_dim")
        assert apply_overrides(cfg, [f"optim.{old}=512"]) == capped  # a recorded study spec's override
        record = to_dict(capped)
        record["optim"][old] = record["optim"].pop("max_precondition_dim")  # an old config.json
        assert from_dict(record) == capped


def test_a_field_under_both_names_is_an_error():
    record = to_dict(apply_overrides(run_preset("nano"), ["optim.name=psgd"]))
    record["optim"]["max_size_triangular"] = 64
    with pytest.raises(OptquantError, match="both 'max_precondition_dim' and its old name 'max_size_triangular'"):
        from_dict(record)


@pytest.mark.parametrize("name, override, message", [
    ("muon", "optim.momentum=1", "optim.momentum=1.0: Expected `float` < 1.0"),
    ("scion", "optim.momentum=0", "optim.momentum=0.0: Expected `float` > 0.0"),  # Scion's α = 1 − β
    ("scion", "optim.momentum=1", None),
    ("psgd", "optim.update_prob=0", "optim.update_prob=0.0: Expected `float` > 0.0"),
    ("psgd", "optim.seed=-1", "optim.seed=-1: Expected `int` >= 0"),
    ("shampoo", "optim.start_preconditioning_step=-2", "optim.start_preconditioning_step=-2: Expected `int` >= -1"),
    ("soap", "optim.max_precondition_dim=0", "optim.max_precondition_dim=0: Expected `int` >= 1"),
    ("adamw", "optim.lr=0", "optim.lr=0.0: Expected `float` > 0.0"),
    # betas: torch's AdamW/SOAP take any float and fail (or diverge) at the first step; here, at config time
    ("adamw", "optim.beta1=1", "optim.beta1=1.0: Expected `float` < 1.0"),
    ("adamw", "optim.beta2=-0.1", "optim.beta2=-0.1: Expected `float` >= 0.0"),
    ("adamw", "optim.beta2=0", None),
    ("soap", "optim.beta1=1.5", "optim.beta1=1.5: Expected `float` < 1.0"),
    ("soap", "optim.beta2=1", "optim.beta2=1.0: Expected `float` < 1.0"),
    ("muon", "optim.adam_beta1=-1", "optim.adam_beta1=-1.0: Expected `float` >= 0.0"),
    ("muon", "optim.adam_beta2=1", "optim.adam_beta2=1.0: Expected `float` < 1.0"),
])
def test_each_optimizer_checks_its_own_ranges(name, override, message):
    if message is None:
        apply_overrides(run_preset("nano"), [f"optim.name={name}", override])
        return
    with pytest.raises(OptquantError) as err:
        apply_overrides(run_preset("nano"), [f"optim.name={name}", override])
    assert str(err.value) == message

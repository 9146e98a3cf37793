"""Config tests: overrides are typed and checked, switches build the right sections, records round-trip."""

import pytest

from optquant.config import (
    apply_overrides,
    config_hash,
    from_dict,
    resolve,
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
    (["optim.lr=fast"], "expected a number"),
    (["train.precision=fp8"], "choose one of"),
    (["optim.name=sgd"], "choose one of"),
    (["train.steps"], "expected key=value"),
    (["nothing.here=1"], "unknown field 'nothing'"),
])
def test_bad_overrides_are_one_line_errors(bad, message):
    with pytest.raises(OptquantError, match=message) as err:
        apply_overrides(run_preset("nano"), bad)
    assert "\n" not in str(err.value)


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


@pytest.mark.parametrize("name, override, message", [
    ("muon", "optim.momentum=1", "optim.momentum=1.0: must be in [0, 1)"),
    ("scion", "optim.momentum=0", "optim.momentum=0.0: must be in (0, 1]"),  # Scion's α = 1 − β
    ("scion", "optim.momentum=1", None),
    ("psgd", "optim.update_prob=0", "optim.update_prob=0.0: must be in (0, 1]"),
    ("psgd", "optim.seed=-1", "optim.seed=-1: must be in [0, 2.14748e+09]"),
    ("shampoo", "optim.start_preconditioning_step=-2", "optim.start_preconditioning_step=-2: must be in [-1, inf)"),
    ("soap", "optim.max_precondition_dim=0", "optim.max_precondition_dim=0: must be in [1, inf)"),
    ("adamw", "optim.lr=0", "optim.lr=0.0: must be in (0, inf)"),
])
def test_each_optimizer_checks_its_own_ranges(name, override, message):
    if message is None:
        apply_overrides(run_preset("nano"), [f"optim.name={name}", override])
        return
    with pytest.raises(OptquantError) as err:
        apply_overrides(run_preset("nano"), [f"optim.name={name}", override])
    assert str(err.value) == message

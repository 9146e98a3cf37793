"""CLI tests: the commands a newcomer types, their exit codes and one-line errors."""

import json

import pytest

from optquant.cli import main


def test_train_then_skip(corpus, tmp_path, capsys):
    args = ["train", "--preset", "nano", "--out", str(tmp_path), "--quiet",
            "--set", f"data.source={corpus}", "--set", "model.vocab_size=320", "--set", "model.seq_len=32",
            "--set", "train.batch_size=8", "--set", "train.steps=20", "--set", "train.eval_every=10"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.split("run directory:")[0])
    assert summary["status"] == "done" and summary["steps"] == 20
    assert main(args) == 0
    assert "already done" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--set", "optim.name=sgd"], "choose one of"),
    (["--set", "data.source=/no/such/corpus"], "/no/such/corpus"),
    (["--config", "/no/such.toml"], "not found"),
    (["--preset", "huge"], "unknown preset"),
])
def test_bad_input_is_one_line_and_nonzero(tmp_path, capsys, args, message):
    assert main(["train", "--out", str(tmp_path), "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optquant: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("toml, sets, message", [
    ('[optim]\nname = ["muon"]\n', [], "optim.name=['muon']: expected str, got list"),
    ('[qat]\nw_bits = "4"\n', [], "qat.w_bits='4': Expected `int`, got `str`"),
    ("", ["--set", "qat.w_bits=four"], "--set qat.w_bits=four: Expected `int`, got `str`"),
    ("", ["--set", "optim.lr=-1"], "optim.lr=-1.0: Expected `float` > 0.0"),
])
def test_typed_config_errors_are_one_line(tmp_path, capsys, toml, sets, message):
    """TOML's types and --set's strings are both checked by the field's type and range, before any run."""
    (tmp_path / "run.toml").write_text(toml)
    assert main(["train", "--out", str(tmp_path), "--quiet", "--config", str(tmp_path / "run.toml"), *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optquant: error:") and message in err and "\n" not in err
    assert not any(tmp_path.glob("*/config.json"))


@pytest.mark.parametrize("toml, message", [
    ('name = ["x"]\n', "name=['x']: Expected `str`, got `array`"),
    ('lr_points = "4"\n', "lr_points='4': Expected `int`, got `str`"),
    ('sizes = "femto"\n', "sizes='femto': Expected `array`, got `str`"),
    ('[lrs]\nadamw = ["0.01"]\n', "lrs.adamw=['0.01']: Expected `float`, got `str`"),
    ('[run.optim]\nname = ["muon"]\n', "optim.name=['muon']: Expected `str`, got `array`"),
    ('[run.qat]\nw_bits = "4"\n', "qat.w_bits='4': Expected `int`, got `str`"),
    ('[run]\n"train.steps" = "4"\n', "train.steps='4': Expected `int`, got `str`"),
    ('[sweeps.muon]\n"optim.momentum" = ["0.9"]\n', "sweeps.muon.optim.momentum: optim.momentum='0.9': Expected"),
])
def test_study_toml_values_keep_their_types(tmp_path, capsys, toml, message):
    """A study TOML goes to the spec as TOML typed it (it was flattened into `k=v` strings and parsed again, so
    `name = ["x"]` named the study x and `w_bits = "4"` trained 4 bits): a wrong type is one line, exit 2."""
    (tmp_path / "study.toml").write_text(toml)
    for dry in ([], ["--dry-run"]):
        assert main(["study", "--preset", "smoke", "--config", str(tmp_path / "study.toml"), "--quiet",
                     "--out", str(tmp_path / "out"), *dry]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("optquant: error:") and message in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


GOOD_STUDY = """preset = "smoke"
sizes = ["femto"]
optimizers = ["adamw", "muon"]
lr_points = 3
lr_refine = false
seeds = [0, 1]
[lrs]
adamw = [0.001, 0.003, 0.01]
[sweeps.muon]
"optim.momentum" = [0.9, 0.95]
[run]
"model.vocab_size" = 320
[run.train]
steps = 12
tokens_per_param = 10
[data]
max_epochs = 100
[eval]
tasks = []
"""
GOOD_SETS = ["sizes=femto", "optimizers=adamw,muon", "lr_points=3", "lr_refine=false", "seeds=0,1",
             "lrs.adamw=0.001,0.003,0.01", "sweeps.muon.optim.momentum=0.9,0.95", "run=model.vocab_size=320",
             "run=train.steps=12", "run=train.tokens_per_param=10", "data.max_epochs=100", "eval.tasks="]


@pytest.mark.slow  # two dry runs: 13 s on the loaded 2-core machine
def test_a_study_toml_is_its_set_flags(tmp_path, capsys, monkeypatch):
    """The same study as a TOML file (TOML's types) and as --set strings: the same spec through the CLI, hence
    the same run ids for every run the LR search, the sweeps and the seeds start from."""
    import optquant.study.dryrun
    from optquant.config import run_id
    from optquant.errors import OptquantError
    from optquant.study_spec import lr_grid, run_config

    specs = []

    def stop(spec):  # the CLI's spec, checked, just before anything would train
        specs.append(spec)
        raise OptquantError("stopped")

    monkeypatch.setattr(optquant.study.dryrun, "check_study_epochs", stop)
    (tmp_path / "study.toml").write_text(GOOD_STUDY)
    assert main(["study", "--config", str(tmp_path / "study.toml"), "--out", str(tmp_path)]) == 2
    flags = [a for s in GOOD_SETS for a in ("--set", s)]
    assert main(["study", "--preset", "smoke", "--out", str(tmp_path), *flags]) == 2
    toml, sets = specs
    assert toml == sets and toml.run["train.tokens_per_param"] == 10.0 and toml.lrs["adamw"] == (0.001, 0.003, 0.01)

    def ids(spec):
        return sorted(run_id(run_config(spec, size, opt, lr, seed, extra={p: v}))
                      for size in spec.sizes for opt in spec.optimizers for lr in lr_grid(spec, opt)
                      for seed in spec.seeds for p, vs in spec.sweeps.get(opt, {"seed": (seed,)}).items() for v in vs)

    assert ids(toml) == ids(sets) and len(ids(toml)) == 3 * 2 + 3 * 2 * 2  # adamw: lr × seed; muon: × momentum
    dry = []
    for args in (["--config", str(tmp_path / "study.toml")], ["--preset", "smoke", *flags]):
        assert main(["study", "--dry-run", *args]) == 0
        dry.append(capsys.readouterr().out)
    assert dry[0] == dry[1] and "femto adamw" in dry[0]


def test_help_mentions_examples(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at the terminal width
    assert "optim.name=muon" in out and "resumes" in out
    from optquant.config import RUN_PRESETS

    assert all(f" {name}," in out or f" {name} " in out for name in RUN_PRESETS)  # the literal list is complete


def test_ptq_and_analyze_on_a_trained_run(corpus, tmp_path, capsys):
    base = ["--preset", "nano", "--out", str(tmp_path), "--quiet", "--set", f"data.source={corpus}",
            "--set", "model.vocab_size=320", "--set", "model.seq_len=32", "--set", "train.batch_size=8",
            "--set", "train.steps=20", "--set", "train.eval_every=10", "--set", "train.precision=fp32"]
    assert main(["train", *base]) == 0
    run = next(tmp_path.glob("nano-adamw-*"))
    capsys.readouterr()
    assert main(["ptq", str(run), "--mc-items", "20"]) == 0
    result = json.loads(capsys.readouterr().out.split("written:")[0])
    assert result["scheme"] == "w4a4-rtn" and result["val_loss_q"] > result["val_loss_fp"]
    assert main(["analyze", str(run), "--method", "gptq", "--rotation", "hadamard", "--mc-items", "0"]) == 0
    out = run / "ptq" / "final" / "w4a4-gptq-had"
    assert (out / "propagation.parquet").exists() and (out / "outliers.parquet").exists()
    assert json.loads((out / "analysis.json").read_text())["R_L"] > 0
    assert main(["ptq", str(run), "--weights", "cl"]) == 2
    assert "Common Loss" in capsys.readouterr().err


def test_every_study_preset_is_a_cli_preset(capsys):
    """`optquant study --preset NAME` takes every preset of study_spec.py (cpu-thorough too, which the CLI
    once refused as an invalid choice); an unknown one is one line listing them."""
    from optquant.study_spec import STUDY_PRESETS

    assert "cpu-thorough" in STUDY_PRESETS
    assert main(["study", "--preset", "cpu-thorough", "--dry-run", "--set", "sizes=zepto"]) == 0
    assert capsys.readouterr().out.startswith("study cpu-thorough: 1 sizes × 6 optimizers, 5 seed(s)")
    assert main(["study", "--preset", "huge", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"optquant: error: unknown study preset 'huge'; choose one of {', '.join(STUDY_PRESETS)}"
    import argparse

    from optquant.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    text = next(a.help for a in commands["study"]._actions if a.dest == "preset")  # --help, torch-free: typed
    assert all(f" {name}" in text for name in STUDY_PRESETS), text


def test_ptq_flags_take_their_choices_and_defaults_from_ptqconfig():
    """--method/--format/--grid/--rotation list PTQConfig's own Literal values; no flag given is PTQConfig()."""
    import argparse
    import dataclasses
    import typing

    from optquant.cli import build_parser
    from optquant.cli.quant import SCHEME_FLAGS, _ptq_config
    from optquant.quant.ptq import PTQConfig

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    hints = typing.get_type_hints(PTQConfig)
    assert set(SCHEME_FLAGS) <= {f.name for f in dataclasses.fields(PTQConfig)}
    for name in ("ptq", "analyze", "bits"):
        choices = {a.dest: tuple(a.choices) for a in commands[name]._actions if a.choices}
        assert {f: choices[f] for f in ("method", "format", "grid", "rotation")} == \
               {f: typing.get_args(hints[f]) for f in ("method", "format", "grid", "rotation")}
        assert _ptq_config(parser.parse_args([name, "r", "--avg-bits", "4"][:None if name == "bits" else 2])) \
            == PTQConfig()
    assert _ptq_config(parser.parse_args(["ptq", "r", "--group-size", "32", "--act-order"])) == \
        PTQConfig(w_group_size=32, act_order=True)

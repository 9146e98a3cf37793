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

"""Numeric command-line flags out of range (issue 30): each is one line and exit 2 before any work, through the
real entry `optquant.cli.main`, and nothing is written; a value that has a meaning (a group wider than a layer)
does what --help says. A flag that means a config field is checked by its range type (ranges.flag)."""

from __future__ import annotations

import json
import shutil

import pytest

from optquant.cli import main


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: a usage error
        code = e.code
    return code, capsys.readouterr().err


# argv → the whole stderr. Each once did something else: --limit -1 and 0 reached lm-eval, whose slice
# (instances[:limit]) then scores no item at all; --mc-items -1 failed only after the FP evaluation ("multiple
# choice: no items"); --split-seed -1 was taken (a run's data.split_seed must be >= 0); data prepare's other counts
# were one line already, now the range type's.
USAGE = [
    (["eval", "RUN", "--limit", "-1"], "optquant eval: error: argument --limit: -1: Expected `int` >= 0"),
    (["ptq", "RUN", "--mc-items", "-1"], "optquant ptq: error: argument --mc-items: -1: Expected `int` >= 0"),
    (["ptq", "RUN", "--group-size", "-8"], "optquant ptq: error: argument --group-size: -8: Expected `int` >= 0"),
    (["analyze", "--hf", "HF", "--seq-len", "1"],
     "optquant analyze: error: argument --seq-len: 1: Expected `int` >= 2"),
    (["bits", "RUN", "--avg-bits", "4", "--mc-items", "x"],
     "optquant bits: error: argument --mc-items: x: Expected `int`, got `str`"),
    (["data", "prepare", "SRC", "--out", "OUT", "--split-seed", "-1"],
     "optquant data prepare: error: argument --split-seed: -1: Expected `int` >= 0"),
    (["data", "prepare", "SRC", "--out", "OUT", "--val-fraction", "1"],
     "optquant data prepare: error: argument --val-fraction: 1: Expected `float` < 1.0"),
    (["data", "prepare", "SRC", "--out", "OUT", "--val-fraction", "nan"],
     "optquant data prepare: error: argument --val-fraction: nan: Expected `float` > 0.0"),
    (["data", "prepare", "SRC", "--out", "OUT", "--jobs", "0"],
     "optquant data prepare: error: argument --jobs: 0: Expected `int` >= 1"),
]


@pytest.mark.parametrize(("argv", "message"), USAGE, ids=[f"{argv[0]} {argv[-2]}" for argv, _ in USAGE])
def test_an_out_of_range_flag_is_one_usage_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(argv, capsys)
    prog = message.split(": error:")[0]
    assert (code, err) == (2, f"{message} (see {prog} --help)\n")
    assert not any(tmp_path.iterdir())


@pytest.fixture
def run(nano_cfg, runs_cache, tmp_path):
    """conftest's shared nano run (input widths 48 and 192), copied: ptq writes into it."""
    from optquant.runs import run_dir
    from optquant.train import train

    shared = run_dir(runs_cache, nano_cfg)
    train(nano_cfg, shared)
    return shutil.copytree(shared, tmp_path / shared.name)


@pytest.mark.parametrize(("flags", "named"), [(["--seq-len", "64"], "--seq-len is"), (["--out", "x"], "--out is"),
                                              (["--dtype", "float32", "--data", "x.txt"], "--data, --dtype are")])
def test_an_hf_flag_with_a_run_is_refused_not_ignored(run, capsys, flags, named):
    """--seq-len, --out, --data, ... once went unread with a run directory (its own window, ptq/ folder, data)."""
    for what in ("ptq", "analyze"):
        code, err = run_cli([what, str(run), "--mc-items", "0", *flags], capsys)
        assert (code, err) == (2, f"optquant: error: {what}: {named} for --hf only (a run has its own data, window "
                                  "and output directory)\n")
    assert not (run / "ptq").exists()


def test_a_group_wider_than_every_layer_is_per_channel_and_a_ragged_one_refused(run, capsys):
    """--help's meaning: a group at least a layer's input width is one scale per row of it (compressed-tensors'
    reading), so 100000 on this model is per channel to the bit; one that leaves a ragged last group (5 divides
    neither 48 nor 192) is refused before anything is evaluated or written."""
    losses = {}
    for group in ("0", "100000", "16"):
        assert main(["ptq", str(run), "--mc-items", "0", "--group-size", group]) == 0
        losses[group] = json.loads(capsys.readouterr().out.split("written:")[0])["val_loss_q"]
    assert losses["100000"] == losses["0"] != losses["16"]
    code, err = run_cli(["ptq", str(run), "--mc-items", "0", "--group-size", "5"], capsys)
    assert (code, err) == (2, "optquant: error: ptq.w_group_size=5 does not divide the input width(s) [48, 192] of "
                              "this model's linear layers; choose a divisor\n")
    assert not (run / "ptq" / "final" / "w4a4-rtn-g5").exists()


def test_eval_limit_zero_is_every_item(run, tmp_path, monkeypatch, capsys):
    """--limit 0 means every item, as a study's eval.limit = 0: lm-eval gets no limit (its 0 would be 0 %)."""
    import optquant.harness

    seen = []
    monkeypatch.setattr(optquant.harness, "lm_eval_tasks", lambda *a, limit, **k: seen.append(limit) or {})
    for limit, want in (("0", None), ("7", 7)):
        assert main(["eval", str(run), "--tasks", "t", "--limit", limit, "--out", str(tmp_path / "e.json")]) == 0
        assert seen.pop() == want


@pytest.fixture
def hf_folder(tmp_path, corpus):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install 'optquant[hf]'")
    from test_hf import _with_tokenizer, save_tiny  # max_position_embeddings 64, widths 64 and 96

    return _with_tokenizer(save_tiny("llama", tmp_path / "llama", vocab_size=320), corpus)


def test_an_hf_window_beyond_the_model_is_refused(hf_folder, tmp_path, capsys):
    """--seq-len 100000 was silently cut to max_position_embeddings (64); the default 128 still is (documented)."""
    out = tmp_path / "out"
    for argv in (["ptq"], ["analyze"], ["bits", "--avg-bits", "6", "--plan-out", str(tmp_path / "plan.json")]):
        code, err = run_cli([*argv, "--hf", str(hf_folder), "--seq-len", "100000", "--out", str(out)], capsys)
        assert (code, err) == (2, f"optquant: error: --seq-len 100000 exceeds {hf_folder}'s "
                                  "max_position_embeddings (64)\n")
    assert not out.exists() and not (tmp_path / "plan.json").exists()


def test_an_hf_group_size_is_refused_before_the_fp_pass(hf_folder, tmp_path, monkeypatch, capsys, corpus):
    import optquant.ptq_stage

    def no_pass(*a, **k):
        raise AssertionError("the FP model was evaluated before the group size was checked")

    monkeypatch.setattr(optquant.ptq_stage, "val_loss", no_pass)
    code, err = run_cli(["ptq", "--hf", str(hf_folder), "--data", str(corpus), "--seq-len", "32", "--group-size",
                         "5", "--out", str(tmp_path / "out")], capsys)
    assert (code, err) == (2, "optquant: error: ptq.w_group_size=5 does not divide the input width(s) [64, 96] of "
                              "this model's linear layers; choose a divisor\n")
    assert not (tmp_path / "out").exists()

"""Settings of the right type but a size no model or corpus can use, and output paths that are not files (issue 30,
item 5): each once hung, aborted the process or was accepted silently; now each is one line and exit 2, or has a
stated meaning, through the real entry `optquant.cli.main`. A test whose regression would hang runs in a child
process with a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optquant.cli import main

SMALL = ("model.vocab_size=320", "model.seq_len=32", "train.batch_size=8", "train.steps=40")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def dry_run(corpus: Path, *sets: str) -> list[str]:
    return ["train", "--dry-run", *(a for s in (f"data.source={corpus}", *SMALL, *sets) for a in ("--set", s))]


def test_a_deep_model_dry_run_takes_seconds_and_counts_every_block(corpus, capsys):
    """model.n_layer=100000 built 100,000 blocks on the meta device (~1 ms of CPU each: minutes); the counts are
    affine in the depth (every block is the same), so they come from 1- and 2-block models, exactly."""
    from optquant.config import apply_overrides, run_preset
    from optquant.cost import meta_model, optimizer_state_bytes, run_cost
    from optquant.model import count_params

    for depth in (1, 7):  # the extrapolation is the full build's count, parameters and optimizer state alike
        for optim in ("adamw", "muon", "shampoo"):
            cfg = apply_overrides(run_preset("nano"), [*SMALL, f"model.n_layer={depth}", f"optim.name={optim}"])
            b, model = run_cost(cfg), meta_model(cfg)
            assert (b.n_params, b.n_params_non_embedding) == (count_params(model), count_params(model, False))
            assert b.state == optimizer_state_bytes(model, cfg.optim)
    start = time.process_time()
    code, out, err = run_cli(dry_run(corpus, "model.n_layer=100000"), capsys)
    assert (code, err) == (0, "")
    assert time.process_time() - start < 10, "the dry run's cost grew with the depth again"
    one = apply_overrides(run_preset("tiny"), [*SMALL, "model.n_layer=1"])
    two = apply_overrides(run_preset("tiny"), [*SMALL, "model.n_layer=2"])
    n1, n2 = (count_params(meta_model(c)) for c in (one, two))
    assert f"parameters {n1 + 99_999 * (n2 - n1):,} (" in out


def test_a_width_whose_weights_torch_cannot_address_is_one_line(corpus, capsys):
    """model.d_model=10**9 was a RuntimeError traceback (a 4e18-element embedding overflows torch's storage)."""
    code, _, err = run_cli(dry_run(corpus, "model.d_model=1000000000"), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("optquant: error: model cfg.model.d_model=1000000000, cfg.model.vocab_size=320: a weight "
                          "of these shapes has more bytes than torch can address"), err


@pytest.mark.slow  # a child process reading the ≈11 MB embedded corpus
def test_a_vocabulary_larger_than_its_text_is_refused_before_the_bpe_trainer(corpus, tmp_path):
    """model.vocab_size=2e9 made the BPE trainer size its tables first and abort the interpreter (a Rust
    out-of-memory, a 40-line backtrace, exit 134); a BPE learns at most one token per byte of its text. A child
    process: a regression kills the process, not the suite."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    argv = dry_run(corpus, "data.source=embedded", "model.vocab_size=2000000000")  # its dry run reads the corpus
    r = subprocess.run([sys.executable, "-c", f"import sys; from optquant.cli import main; sys.exit(main({argv!r}))"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith("optquant: error: vocab_size=2,000,000,000: a BPE learns at most one token per byte of "
                               "its "), r.stderr
    assert 10**6 < int(r.stderr.split("-byte")[0].split()[-1].replace(",", "")) < 11 << 20  # the ≈11 MB corpus


@pytest.fixture
def run(nano_cfg, runs_cache, tmp_path):
    from optquant.runs import run_dir
    from optquant.train import train

    shared = run_dir(runs_cache, nano_cfg)
    train(nano_cfg, shared)
    return shutil.copytree(shared, tmp_path / shared.name)


def test_more_mc_items_than_distinct_contexts_is_refused(run, capsys):
    """--mc-items 10**9 drew a billion items (hours, then memory); past the validation split's distinct contexts
    every further item repeats one, so it is refused, naming the count. Up to it, items are drawn as before."""
    code, _, err = run_cli(["ptq", str(run), "--mc-items", "1000000000"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("optquant: error: multiple choice: 1,000,000,000 items exceed the "), err
    contexts = int(err.split("exceed the ")[1].split()[0].replace(",", ""))
    assert 0 < contexts < 10**6
    assert not (run / "ptq" / "final" / "w4a4-rtn").exists()


def test_eval_without_a_task_is_refused(run, tmp_path, capsys):
    """`--tasks ,` once wrote an empty lm_eval.json and exited 0."""
    code, _, err = run_cli(["eval", str(run), "--tasks", " , ", "--out", str(tmp_path / "e.json")], capsys)
    assert (code, err) == (2, "optquant: error: eval: --tasks ' , ' names no task (e.g. --tasks piqa,hellaswag)\n")
    assert not (tmp_path / "e.json").exists()


@pytest.mark.parametrize("kind", ["fifo", "dir"])
@pytest.mark.parametrize("flag", ["--plan-out", "--recipe", "--torchao"])
def test_an_output_that_is_not_a_file_is_refused_not_replaced(run, tmp_path, capsys, kind, flag):
    """A written file renamed over a FIFO or device replaced it: run as root, `bits --recipe /dev/full` left a
    regular file in place of the device. (The test uses a FIFO, never a real device.) A directory is refused too."""
    target = tmp_path / "target"
    os.mkfifo(target) if kind == "fifo" else target.mkdir()
    argv = ["bits", str(run), "--avg-bits", "6", "--mc-items", "0", flag, str(target)]
    if flag != "--plan-out":
        argv += ["--plan-out", str(tmp_path / "plan.json")]
    code, _, err = run_cli(argv, capsys)
    what = "a FIFO" if kind == "fifo" else "a directory"
    assert (code, err) == (2, f"optquant: error: {target}: is {what}; optquant writes a file there (choose a file "
                              "path)\n")
    assert (target.is_fifo() if kind == "fifo" else target.is_dir())

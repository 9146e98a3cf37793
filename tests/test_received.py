"""Files received from others (issue 21): reading a run, a study or an HF folder runs no code from it, no
write follows a planted link, and a record that does not check out is one error line (exit 2) naming the
file and field, never a silently dropped row, an empty table or a traceback.

Every fixture is what optquant (or transformers' save_pretrained, for HF folders) really writes: a nano run
trained by `optquant train`, a killed one with its checkpoint, a one-optimizer study made by `run_study`;
each test copies one and damages it the way the issue describes.
"""

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from test_reliability import one_line_error  # the same one-line-error check as the reliability tests

from optquant.cli import main
from optquant.config import resolve
from optquant.runs import run_dir
from optquant.train import train

SETS = ["model.vocab_size=320", "model.seq_len=32", "train.batch_size=8", "train.steps=4", "train.eval_every=2",
        "train.eval_batches=1", "train.precision=fp32"]


def nano_args(corpus, out, *extra: str) -> list[str]:
    sets = [f"data.source={corpus}", *SETS, *extra]
    return ["--preset", "nano", "--out", str(out), "--quiet", *[a for s in sets for a in ("--set", s)]]


def nano_dir(corpus, out, *extra: str) -> Path:
    return run_dir(out, resolve("nano", None, [f"data.source={corpus}", *SETS, *extra]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """A finished nano run (OLMo2 and Llama variants) and a killed one holding a checkpoint, all by the CLI."""
    root = tmp_path_factory.mktemp("received")
    assert main(["train", *nano_args(corpus, root / "done")]) == 0
    assert main(["train", *nano_args(corpus, root / "llama", "model.arch=llama")]) == 0
    killed = nano_dir(corpus, root / "killed")

    def stop(info):
        if info["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(resolve("nano", None, [f"data.source={corpus}", *SETS]), killed, on_step=stop)
    assert (killed / "checkpoint.safetensors").is_file()
    return {"done": nano_dir(corpus, root / "done"), "llama": nano_dir(corpus, root / "llama", "model.arch=llama"),
            "killed": killed}


def copy_run(runs, which: str, tmp_path) -> Path:
    dst = tmp_path / "runs" / runs[which].name
    shutil.copytree(runs[which], dst)
    return dst


# --- trust boundary: no code runs from a received run --------------------------------------------------


@pytest.mark.parametrize("relative", [False, True])
def test_ptq_and_analyze_never_import_a_plugin_named_in_a_received_config(runs, tmp_path, capsys, monkeypatch,
                                                                         relative):
    run = copy_run(runs, "done", tmp_path)
    marker = tmp_path / "imported"
    evil = run / "evil.py"  # shipped inside the received directory
    evil.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef f(groups, lr):\n    raise SystemExit(9)\n")
    monkeypatch.chdir(run)
    record = json.loads((run / "config.json").read_text())
    record["config"]["optim"] = {"name": ("evil.py" if relative else str(evil)) + ":f", "lr": 1e-3}
    (run / "config.json").write_text(json.dumps(record))
    for command in ("ptq", "analyze"):
        assert main([command, str(run), "--mc-items", "0"]) == 0, capsys.readouterr().err
    assert not marker.exists(), "a plugin file from the run directory was imported"
    assert not any(k.startswith("optquant_plugin_") and "evil" in k for k in sys.modules)


def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(corpus, tmp_path, capsys):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    path = nano_dir(corpus, tmp_path / "out")
    path.mkdir(parents=True)
    (path / ".lock").symlink_to(target)
    assert main(["train", *nano_args(corpus, tmp_path / "out")]) == 2
    one_line_error(capsys, ".lock", "symbolic link")
    assert target.read_text() == "keep me\n"
    assert sorted(p.name for p in path.iterdir()) == [".lock"]  # nothing trained behind the refusal


def test_a_planted_metrics_symlink_is_not_written_through(runs, tmp_path, capsys):
    run = copy_run(runs, "killed", tmp_path)
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(tmp_path / "dangling")  # a dangling link: open("a") would create it
    source = json.loads((run / "config.json").read_text())["config"]["data"]["source"]
    assert main(["train", *nano_args(source, run.parent)]) == 2
    one_line_error(capsys, "metrics.jsonl", "symbolic link")
    assert not (tmp_path / "dangling").exists()


# --- guarded outputs: export --------------------------------------------------------------------------


def test_export_refuses_the_run_itself_an_existing_file_and_a_second_export(runs, tmp_path, capsys):
    pytest.importorskip("transformers")
    run = copy_run(runs, "llama", tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["export", str(run), "--hf", str(run)]) == 2
    one_line_error(capsys, "run or study directory")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert main(["train", *nano_args(json.loads((run / "config.json").read_text())["config"]["data"]["source"],
                                     run.parent, "model.arch=llama")]) == 0
    assert "already done" in capsys.readouterr().out
    file = tmp_path / "a-file"
    file.write_text("mine\n")
    assert main(["export", str(run), "--hf", str(file)]) == 2
    one_line_error(capsys, "not a directory")
    assert file.read_text() == "mine\n"
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    capsys.readouterr()
    assert main(["export", str(run), "--hf", str(out)]) == 2
    one_line_error(capsys, "--force")
    assert main(["export", str(run), "--hf", str(out), "--force"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


# --- integrity on read: runs --------------------------------------------------------------------------


def test_a_checkpoint_past_the_runs_total_is_an_error_not_done(runs, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    run = copy_run(runs, "killed", tmp_path)
    ckpt = run / "checkpoint.safetensors"
    with safe_open(str(ckpt), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    structure = json.dumps(json.loads(meta["structure"])).replace('["step", 2]', '["step", 1000]')
    assert '["step", 1000]' in structure
    save_file(tensors, str(ckpt), metadata={"structure": structure})
    source = json.loads((run / "config.json").read_text())["config"]["data"]["source"]
    assert main(["train", *nano_args(source, run.parent)]) == 2
    one_line_error(capsys, "checkpoint.safetensors", "not within this run's 4 steps")
    assert not (run / "summary.json").exists()
    save_file(tensors, str(ckpt), metadata={"structure": "{not json"})
    assert main(["train", *nano_args(source, run.parent)]) == 2
    one_line_error(capsys, "checkpoint.safetensors", "metadata is corrupt")


def test_damaged_metrics_values_are_an_error_naming_the_line(runs, tmp_path, capsys):
    run = copy_run(runs, "killed", tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    record["val_loss"] = "low"
    (run / "metrics.jsonl").write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    source = json.loads((run / "config.json").read_text())["config"]["data"]["source"]
    assert main(["train", *nano_args(source, run.parent)]) == 2
    one_line_error(capsys, "metrics.jsonl line 1", "val_loss")


@pytest.mark.parametrize("edit", [{"final_val_loss": "3.1"}, {"final_val_loss": None}, {"steps": "4"},
                                  {"n_params": True}])
def test_a_done_summary_with_wrong_types_is_an_error(runs, tmp_path, capsys, edit):
    run = copy_run(runs, "done", tmp_path)
    summary = {**json.loads((run / "summary.json").read_text()), **edit}
    (run / "summary.json").write_text(json.dumps(summary))
    source = json.loads((run / "config.json").read_text())["config"]["data"]["source"]
    assert main(["train", *nano_args(source, run.parent)]) == 2
    one_line_error(capsys, "summary.json", "--force")


# --- plugins: one line, exit 2, no run directory -------------------------------------------------------

PLUGINS = {
    "raises_on_import": "raise RuntimeError('boom at import')\n",
    "syntax_error": "def f(groups, lr)\n    pass\n",
    "raises_in_factory": "def f(groups, lr):\n    raise ValueError('boom in factory')\nf.default_lr = 1e-3\n",
    "bad_default_lr": "import torch\ndef f(groups, lr):\n    return torch.optim.SGD(groups.all(), lr=lr)\n"
                      "f.default_lr = 'fast'\n",
    "negative_default_lr": "import torch\ndef f(groups, lr):\n    return torch.optim.SGD(groups.all(), lr=lr)\n"
                           "f.default_lr = -1.0\n",
    "returns_no_optimizer": "def f(groups, lr):\n    return 3\nf.default_lr = 1e-3\n",
}
NON_TENSOR_STATE = textwrap.dedent("""
    import torch
    class Odd(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            for p in self.param_groups[0]["params"]:
                self.state[p]["odd"] = object()
    def f(groups, lr):
        return Odd(groups.all(), lr=lr)
    f.default_lr = 1e-3
    """)


@pytest.mark.parametrize("name", PLUGINS)
def test_a_broken_plugin_is_one_line_and_leaves_no_run_directory(corpus, tmp_path, capsys, name):
    plugin = tmp_path / f"{name}.py"
    plugin.write_text(PLUGINS[name])
    out = tmp_path / "out"
    assert main(["train", *nano_args(corpus, out, f"optim.name={plugin}:f", "optim.lr=1e-3")]) == 2
    one_line_error(capsys, "optimizer plugin")
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


def test_a_plugin_with_a_non_tensor_state_is_one_line(corpus, tmp_path, capsys):
    plugin = tmp_path / "odd.py"
    plugin.write_text(NON_TENSOR_STATE)
    assert main(["train", *nano_args(corpus, tmp_path / "out", f"optim.name={plugin}:f")]) == 2
    one_line_error(capsys, "cannot checkpoint a object")


# --- HF folders -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=None, bos_token_id=0, eos_token_id=0)
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


HF_DAMAGE = {
    "llama_weights_labelled_qwen3": lambda p: _edit_config(p, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                                                         head_dim=8),
    "weights_not_matching_config": lambda p: _edit_config(p, hidden_size=64),
    "truncated_weights": lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:500]),
    "zero_heads": lambda p: _edit_config(p, num_attention_heads=0),
    "config_not_an_object": lambda p: (p / "config.json").write_text("[1, 2]"),
}


@pytest.mark.parametrize("damage", HF_DAMAGE)
def test_a_malformed_hf_folder_is_one_line(hf_llama, tmp_path, capsys, damage):
    path = tmp_path / "hf"
    shutil.copytree(hf_llama, path)
    HF_DAMAGE[damage](path)
    assert main(["analyze", "--hf", str(path), "--out", str(tmp_path / "out"), "--mc-items", "0"]) == 2
    one_line_error(capsys, str(path))
    assert not (tmp_path / "out").exists()


def test_hf_seq_len_zero_is_one_line(hf_llama, tmp_path, capsys):
    """A usage error (the flag's range type, ranges.flag): argparse's one line and exit 2, nothing written."""
    with pytest.raises(SystemExit) as exit_:
        main(["ptq", "--hf", str(hf_llama), "--seq-len", "0", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith("optquant ptq: error: argument --seq-len: 0: "), err
    assert not (tmp_path / "out").exists()


# --- studies: the spec, damaged summaries and results ----------------------------------------------------

STUDY_SETS = ["sizes=femto", "optimizers=adamw", "lrs.adamw=0.003", "lr_extensions=0", "lr_refine=false",
              "seeds=0", "ptq_schemes=w4a4-rtn", "sweep_ptq_schemes=", "qat_bits=4", "workers=1",
              "run=model.vocab_size=320", "run=train.steps=10", "run=train.eval_every=5"]


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory, corpus):
    """A finished one-optimizer, one-size study by run_study (FP, CL, PTQ, QAT, results, report)."""
    from optquant.study.plan import run_study
    from optquant.study_spec import apply_study_overrides, study_preset

    spec = apply_study_overrides(study_preset("smoke"), [f"run=data.source={corpus}", *STUDY_SETS])
    root = tmp_path_factory.mktemp("study") / "study"
    run_study(spec, root)
    return spec, root


BAD_SPECS = ["optimizers=", "seeds=", "lr_step=0", "lr_points=0", "lr_extensions=-1", "workers=-1", "workers=100000",
             "lrs.adamw=", "lrs.adamw=-0.001", "sweeps.adamw.optim.weight_decay=z", "seeds=-1", "seeds=0,0",
             "seeds=4294967296", "sizes=femto,femto", "optimizers=adamw,adamw", "name=../../evil", "cl_eval_every=0"]


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("bad", BAD_SPECS)
def test_dry_run_and_real_run_reject_the_same_spec_before_anything_trains(corpus, tmp_path, capsys, bad, dry_run):
    out = tmp_path / "study"
    argv = ["study", "--preset", "smoke", "--quiet", "--out", str(out), f"--set=run=data.source={corpus}",
            *[f"--set={s}" for s in STUDY_SETS if s.split("=")[0] != bad.split("=")[0]], f"--set={bad}"]
    assert main([*argv, *(["--dry-run"] if dry_run else [])]) == 2
    one_line_error(capsys, bad.split("=")[0].split(".")[0])
    assert not out.exists()


def test_a_study_meeting_a_damaged_summary_names_the_run_and_how_to_redo_it(tiny_study, tmp_path):
    from optquant.errors import OptquantError
    from optquant.study.plan import run_study

    spec, root = tiny_study
    copy = tmp_path / "study"
    shutil.copytree(root, copy)
    qat = [p for p in (copy / "runs").iterdir() if json.loads((p / "config.json").read_text())["config"]["qat"]]
    summary = json.loads((qat[0] / "summary.json").read_text())
    (qat[0] / "summary.json").write_text(json.dumps({**summary, "final_val_loss": "n/a"}))
    with pytest.raises(OptquantError, match=f"{qat[0].name}.*final_val_loss.*delete the run directory"):
        run_study(spec, copy)


def test_report_on_results_with_string_values_is_an_error(tiny_study, tmp_path, capsys):
    copy = tmp_path / "study"
    shutil.copytree(tiny_study[1], copy)
    df = pd.read_parquet(copy / "results.parquet")
    df["value"] = df["value"].map(lambda v: f"{v:.3f}!")
    df.to_parquet(copy / "results.parquet", index=False)
    for command in ("report", "fit"):
        assert main([command, str(copy)]) == 2
        one_line_error(capsys, "results.parquet", "'value'")


def test_report_on_a_damaged_best_json_is_an_error(tiny_study, tmp_path, capsys):
    copy = tmp_path / "study"
    shutil.copytree(tiny_study[1], copy)
    best = json.loads((copy / "best.json").read_text())
    (copy / "best.json").write_text(json.dumps([{**v, "best_lr": "high"} for v in best]))
    assert main(["report", str(copy)]) == 2
    one_line_error(capsys, "best.json", "best_lr")


def test_a_study_meeting_a_damaged_ptq_result_names_it(tiny_study, tmp_path):
    from optquant.errors import OptquantError
    from optquant.study.plan import run_study

    spec, root = tiny_study
    copy = tmp_path / "study"
    shutil.copytree(root, copy)
    result = next((copy / "runs").glob("*/ptq/cl/w4a4-rtn/summary.json"))
    result.write_text(json.dumps({**json.loads(result.read_text()), "val_loss_q": "low"}))
    with pytest.raises(OptquantError, match="summary.json: field 'val_loss_q'.*delete .*w4a4-rtn to redo it"):
        run_study(spec, copy)

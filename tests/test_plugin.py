"""Optimizer plugins: the example Lion against its closed-form update, the loading routes (module:attr,
file.py:attr, entry point), the contract checks, and a smoke study run with the plugin end to end."""

import json
import math
import shutil
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from optquant.cli import main
from optquant.config import apply_overrides, from_dict, run_id, run_preset, to_dict
from optquant.errors import OptquantError
from optquant.model import LM, lm_loss, model_config
from optquant.optim import PluginConfig, build_optimizers
from optquant.optim.plugin import load_factory
from optquant.report.load import load_study
from optquant.report.paper import label
from optquant.report.protocol import lr_status_table, tuning_table
from optquant.report.tables import table2
from optquant.study.plan import run_study
from optquant.study_spec import apply_study_overrides, lr_grid, study_preset

ROOT = Path(__file__).resolve().parents[1]
LION = str(ROOT / "examples" / "lion.py") + ":make_optimizer"


def test_example_lion_matches_its_closed_form():
    Lion = sys.modules[load_factory(LION).__module__].Lion
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    lr, (b1, b2), wd = 0.1, (0.9, 0.99), 0.3
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    theta, m = p.detach().double().clone(), torch.zeros(5, 3, dtype=torch.float64)
    for step in range(4):
        g = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
        p.grad = g.clone()
        opt.step()
        c = b1 * m + (1 - b1) * g.double()
        theta = theta - lr * (torch.sign(c) + wd * theta)
        m = b2 * m + (1 - b2) * g.double()
        torch.testing.assert_close(p.detach().double(), theta, rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=0, atol=1e-6)


def test_plugin_by_file_trains_and_records_base_lr():
    cfg = apply_overrides(run_preset("femto"), [f"optim.name={LION}"])
    assert isinstance(cfg.optim, PluginConfig) and cfg.optim.lr == 3e-4  # the plugin's default_lr
    cfg = apply_overrides(cfg, ["optim.lr=1e-3"])
    assert from_dict(to_dict(cfg)) == cfg
    assert "/" not in run_id(cfg) and run_id(cfg).startswith("femto-lion.make_optimizer-")
    torch.manual_seed(0)
    model = LM(model_config("femto", vocab_size=64, seq_len=16))
    opts = build_optimizers(model, cfg.optim)
    assert [g["base_lr"] for g in opts[0].param_groups] == [1e-3] * 3
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(30):
        loss = lm_loss(model, x[:, :-1], x[:, 1:].contiguous())
        loss.backward()
        opts[0].step()
        opts[0].zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def _write_plugin(root: Path, body: str) -> None:
    (root / "myplug").mkdir(exist_ok=True)
    (root / "myplug" / "__init__.py").write_text("")
    (root / "myplug" / "opt.py").write_text(textwrap.dedent(body))


def test_plugin_by_module_and_entry_point(tmp_path, monkeypatch):
    _write_plugin(tmp_path, """
        import torch
        def make(groups, lr):
            rest = groups.embeddings + groups.vectors
            return [torch.optim.SGD(groups.matrices, lr=lr), torch.optim.SGD(rest, lr=lr / 10)]
        def drops_vectors(groups, lr):
            return torch.optim.SGD(groups.matrices + groups.embeddings, lr=lr)
        def not_an_optimizer(groups, lr):
            return 3
        """)
    dist = tmp_path / "myplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[optquant.optimizers]\nsgd2 = myplug.opt:make\n")
    monkeypatch.chdir(tmp_path)  # module:attr is also searched in the current directory
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    model = LM(model_config("femto", vocab_size=64, seq_len=16))
    with pytest.raises(OptquantError, match="declares no default_lr: set optim.lr"):
        build_optimizers(model, apply_overrides(run_preset("femto"), ["optim.name=myplug.opt:make"]).optim)
    cfg = apply_overrides(run_preset("femto"), ["optim.name=myplug.opt:make", "optim.lr=0.5"])
    opts = build_optimizers(model, cfg.optim)
    assert [o.param_groups[0]["base_lr"] for o in opts] == [0.5, 0.05]
    monkeypatch.syspath_prepend(str(tmp_path))  # now the fake distribution's entry point is visible
    opts = build_optimizers(model, apply_overrides(run_preset("femto"), ["optim.name=sgd2", "optim.lr=0.2"]).optim)
    assert len(opts) == 2
    for name, match in (("myplug.opt:drops_vectors", "exactly one param group"),
                        ("myplug.opt:not_an_optimizer", "must return a torch.optim.Optimizer"),
                        ("myplug.opt:nothing", "has no attribute 'nothing'"),
                        ("nosuchpkg.mod:make", "module .nosuchpkg. not found"),
                        ("missing.py:make", "no such file"),
                        ("sgd3", "unknown optimizer 'sgd3'")):
        with pytest.raises(OptquantError, match=match):
            build_optimizers(model, apply_overrides(run_preset("femto"), [f"optim.name={name}", "optim.lr=1"]).optim)
    with pytest.raises(OptquantError, match="declares no default_lr: give its grid, lrs.sgd2"):
        lr_grid(apply_study_overrides(study_preset("smoke"), ["optimizers=sgd2"]), "sgd2")


def test_smoke_study_with_the_example_plugin(corpus, tmp_path):
    spec = apply_study_overrides(study_preset("smoke"), [
        f"run=data.source={corpus}", "run=model.vocab_size=320", "run=train.steps=20", "sizes=femto",
        f"optimizers=adamw,{LION}", "lrs.adamw=0.003", "ptq_schemes=w4a4-rtn", "workers=1", "lr_points=1",
        "lr_extensions=0", "seeds=0"])
    assert lr_grid(spec, LION) == (3e-4,)
    report = run_study(spec, tmp_path / "study")
    df = pd.read_parquet(tmp_path / "study" / "results.parquet")
    for kind in ("fp", "cl", "qat"):
        assert set(df[df.kind == kind].optimizer) == {"adamw", LION}, kind
    lion_ptq = df[(df.optimizer == LION) & (df.kind == "cl") & (df.metric == "delta_val_loss")]
    assert len(lion_ptq) == 1 and math.isfinite(lion_ptq.value.iloc[0])
    assert LION in report.read_text() or "lion" in report.read_text()


def test_a_plugin_is_named_as_typed_with_a_path_shortened():
    assert label(LION) == label("examples/lion.py:make_optimizer") == "lion.py:make_optimizer"
    assert label("myplug.opt:make") == "myplug.opt:make" and label("sgd2") == "sgd2" and label("muon") == "Muon"


def test_dry_run_gives_a_plugins_state_as_unknown(capsys):
    assert main(["study", "--preset", "smoke", "--set", f"optimizers=adamw,{LION}", "--dry-run"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if LION in line]
    assert len(rows) == 2 and all(" unknown " in r and " ≥" in r for r in rows), rows  # opt state, peak


def _as_plugin(tmp_path: Path, status: str = "cap") -> Path:
    """docs/results (written by main before issue 30: best.json keyed "<optimizer>/<size>") with AdamW
    renamed to the Lion plugin by its path, in results.parquet and best.json's keys, one search left open."""
    root = tmp_path / "results"
    shutil.copytree(ROOT / "docs" / "results", root, ignore=shutil.ignore_patterns("runs"))
    df = pd.read_parquet(root / "results.parquet")
    df["optimizer"] = df["optimizer"].replace("adamw", LION)
    df.to_parquet(root / "results.parquet", index=False)
    old = json.loads((root / "best.json").read_text())
    assert all(k.count("/") == 1 for k in old)  # main's format
    renamed = {k.replace("adamw/", f"{LION}/", 1): v for k, v in old.items()}
    renamed[f"{LION}/atto"]["status"] = status
    (root / "best.json").write_text(json.dumps(renamed))
    return root


def test_an_old_best_json_with_a_plugin_path_feeds_the_report(tmp_path):
    old = json.loads((ROOT / "docs" / "results" / "best.json").read_text())
    d = load_study(ROOT / "docs" / "results")
    assert d.best == {tuple(k.split("/")): {"optimizer": k.split("/")[0], "size": k.split("/")[1], **v}
                      for k, v in old.items()}
    d = load_study(_as_plugin(tmp_path))
    assert (LION, "atto") in d.best and LION in d.optimizers
    short = "lion.py:make_optimizer"
    lr = lr_status_table(d)
    assert [(r[0], r[1]) for r in lr.rows] == [(d.size_label("atto"), short)]
    tuning = [r for r in tuning_table(d).rows if r[0] == short]
    assert len(tuning) == 3 and all("–" not in r[4:] for r in tuning), tuning  # three groups, an LR per size
    assert short in {r[1] for r in table2(d).rows}
    (tmp_path / "results" / "best.json").write_text(json.dumps([{"size": "atto", "best_lr": 1e-3}]))
    with pytest.raises(OptquantError, match="entry 0: no optimizer and size"):
        load_study(tmp_path / "results")

"""Without an optional extra, each feature that needs it fails with one line naming the extra (these run in
the lean `.[dev]` install, where the extras' own tests skip)."""

import importlib.util

import pytest

from optquant.errors import OptquantError


@pytest.fixture
def nothing_installed(monkeypatch):
    real = importlib.util.find_spec
    missing = {"transformers", "lm_eval", "tensorboard", "wandb"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))


def test_each_extra_is_named_when_missing(nothing_installed, tmp_path):
    from optquant.harness import require_lm_eval
    from optquant.hf import require_transformers
    from optquant.tracking import LogConfig, open_tracker

    with pytest.raises(OptquantError, match=r"pip install 'optquant\[hf\]'"):
        require_transformers()
    with pytest.raises(OptquantError, match=r"pip install 'optquant\[eval\]'"):
        require_lm_eval()
    for to in ("tensorboard", "wandb"):
        with pytest.raises(OptquantError, match=rf"pip install 'optquant\[{to}\]'"):
            open_tracker(LogConfig(to=to), tmp_path, {})
    assert not list(tmp_path.iterdir())  # nothing written


def test_cli_reports_a_missing_extra_in_one_line(nothing_installed, tmp_path, capsys):
    from optquant.cli import main

    (tmp_path / "config.json").write_text("{}")
    assert main(["analyze", "--hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "optquant[hf]" in err
    # a study with lm-eval tasks stops before it trains anything
    assert main(["study", "--preset", "smoke", "--set", "eval.tasks=piqa", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "optquant[eval]" in err and not (tmp_path / "s").exists()

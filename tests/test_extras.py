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


def _declared(requirements: list[str]) -> set[str]:
    """Canonical names of `requirements` and, through installed metadata, of everything they require in turn
    (markers evaluated without extras: an extra's own requirements are not pulled in)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), list(requirements)
    while todo:
        r = Requirement(todo.pop())
        name = canonicalize_name(r.name)
        if name in seen or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_eval_extra_declares_what_lm_eval_hf_imports():
    """`lm_eval --model hf DIR` (the way to check an export) imports lm_eval.models.huggingface; each package it
    imports at the top must be declared by `pip install 'optquant[eval,hf]'`. accelerate was not."""
    import ast
    import sys
    import tomllib
    from importlib import metadata
    from pathlib import Path

    from packaging.utils import canonicalize_name

    spec = importlib.util.find_spec("lm_eval") and importlib.util.find_spec("lm_eval.models.huggingface")
    if spec is None:
        pytest.skip("needs the eval extra: pip install 'optquant[eval]'")
    tree = ast.parse(Path(spec.origin).read_text())
    modules = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 0}
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = _declared([*project["dependencies"], *extras["eval"], *extras["hf"]])
    dists = metadata.packages_distributions()
    missing = [m for m in sorted(modules - set(sys.stdlib_module_names)) if
               not {canonicalize_name(d) for d in dists.get(m, [m])} & declared]
    assert "accelerate" in modules and not missing, missing

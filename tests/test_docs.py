"""The generated docs are what their generators write today: docs/configuration.md from the config dataclasses,
docs/results.md from the committed record of the default study (docs/results/)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _script(name: str):
    """docs/<name>.py, imported by path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_configuration_md_is_generated():
    gen = _script("configuration")
    committed = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert gen.render() == committed, (
        f"docs/configuration.md is not what docs/configuration.py writes from today's config classes "
        f"(a field, default, range or comment changed): regenerate it with `{gen.COMMAND}` and commit it")


def test_results_md_matches_report():
    gen = _script("results")
    committed = (DOCS / "results.md").read_text(encoding="utf-8")
    assert gen.render() == committed, (
        "docs/results.md is not what `optquant report --markdown` writes for the study recorded in docs/results/. "
        "If only the report's code changed: `python docs/results.py --write` re-renders it from the record; if the "
        f"study was rerun or the report reads other files now: `{gen.COMMAND}` (e.g. studies/cpu) refreshes both")

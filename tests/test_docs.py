"""The generated docs are what their generators write today: docs/configuration.md from the config dataclasses,
docs/results.md from the committed record of the default study (docs/results/)."""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _script(name: str):
    """docs/<name>.py, imported by path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _same(generated: str, path: Path, how: str) -> None:
    """Fail with `how` and the first lines of the difference (not pytest's diff of two 50 kB strings)."""
    committed = path.read_text(encoding="utf-8")
    if generated != committed:
        diff = difflib.unified_diff(committed.splitlines(), generated.splitlines(), f"{path.name} (committed)",
                                    f"{path.name} (generated)", lineterm="", n=0)
        pytest.fail(f"{how}\n" + "\n".join(list(diff)[:20]), pytrace=False)


def test_configuration_md_is_generated():
    gen = _script("configuration")
    _same(gen.render(), DOCS / "configuration.md",
          "docs/configuration.md is not what docs/configuration.py writes from today's config classes (a field, "
          f"default, range or comment changed): regenerate it with `{gen.COMMAND}` and commit it")


def test_results_md_matches_report():
    gen = _script("results")
    _same(gen.render(), DOCS / "results.md",
          "docs/results.md is not what `optquant report --markdown` writes for the study recorded in docs/results/. "
          f"If only the report's code changed: `{gen.WRITE}` re-renders it from the record; if the study was rerun "
          f"or the report reads other files now: `{gen.COMMAND}` (e.g. studies/cpu) refreshes both")


def _comments(toml: str) -> list[str]:
    """The comment of each line of a TOML file: from a `#` outside a string to the end of the line."""
    out = []
    for line in toml.splitlines():
        quote = None
        for i, c in enumerate(line):
            if quote:
                quote = None if c == quote else quote
            elif c in "\"'":
                quote = c
            elif c == "#":
                out.append(line[i + 1:])
                break
    return out


def test_pyproject_comments_carry_no_measured_numbers():
    """A number measured once and typed into a comment goes stale unseen: pyproject.toml's comments give the
    reason for a pin or a dependency, and docs/benchmarks.md ("Numbers behind choices in the code") the number.
    Version specifiers (torch>=2.0) and a command's options (-n 0) are not measurements."""
    import re

    comments = _comments((DOCS.parent / "pyproject.toml").read_text(encoding="utf-8"))
    allowed = re.compile(r"[\w.-]+\s*[<>=~!]=?\s*[\d.*]+|(?<!\w)-\w \d+")
    numbered = [c for c in comments if re.search(r"\d", allowed.sub("", c))]
    assert not numbered, f"pyproject.toml comments with numbers (move them to docs/benchmarks.md): {numbered}"
    assert any("docs/benchmarks.md" in c for c in comments)  # the comments were found, and point at the numbers

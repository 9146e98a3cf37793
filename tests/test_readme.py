"""The README's headline table says what the default study's report says: each row's claim is one of the
report's paper claims in docs/results.md, word for word, and its verdict is the report's (or the start of
it, where the report adds the reason). A README edited by hand, or a results.md regenerated with other
verdicts, fails here.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(text: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.replace("\\|", "¦").strip("|").split(" | ")])
    return rows


def test_readme_verdicts_are_the_reports():
    report = {row[0]: row[-1] for row in _rows((ROOT / "docs" / "results.md").read_text(), "| paper claim |")}
    readme = _rows((ROOT / "README.md").read_text(), "| paper claim |")
    assert len(readme) >= 8
    for claim, verdict, *_ in readme:
        assert claim in report, f"README claim {claim!r} is not a claim of docs/results.md"
        assert report[claim].startswith(verdict), f"{claim!r}: README says {verdict!r}, the report {report[claim]!r}"

"""No code outside optquant/optim/ branches on a built-in optimizer's name: what an optimizer is (its state
layout, its ranges, whether it has a precondition cap or Newton–Schulz) is declared by its config class, so
a new optimizer needs no edit elsewhere (optim/__init__.py's docstring).

An AST scan of src/optquant outside optim/ for the three ways of branching on a name: a comparison (==, !=,
in, not in and the set comparisons) with a registry name or a tuple/list/set holding one; a `match` case on
one; a `{...}.get(x)` or `{...}[x]` on a dict literal keyed by one. Names used as data (a preset's list of
optimizers, the paper's numbers and claims per optimizer, display labels) are not branches and pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

from optquant.optim import OPTIMIZERS

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "optquant"
_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _is_name(node: ast.AST, names: set[str]) -> bool:
    return isinstance(node, ast.Constant) and node.value in names


def _holds_name(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_name(e, names) for e in node.elts)
    return _is_name(node, names)


def _keyed_by_name(node: ast.AST, names: set[str]) -> bool:
    return isinstance(node, ast.Dict) and any(k is not None and _is_name(k, names) for k in node.keys)


def name_branches(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every branch on one of `names` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, _OPS) for op in node.ops):
            if any(_holds_name(side, names) for side in (node.left, *node.comparators)):
                found.append((node.lineno, "comparison with an optimizer name"))
        elif isinstance(node, ast.match_case):
            if any(isinstance(p, ast.MatchValue) and _is_name(p.value, names) for p in ast.walk(node.pattern)):
                found.append((node.pattern.lineno, "match case on an optimizer name"))
        elif isinstance(node, ast.Subscript) and _keyed_by_name(node.value, names):
            found.append((node.lineno, "lookup in a dict literal keyed by optimizer names"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and _keyed_by_name(node.func.value, names)):
            found.append((node.lineno, ".get on a dict literal keyed by optimizer names"))
    return found


def test_no_code_outside_optim_branches_on_an_optimizer_name():
    names = set(OPTIMIZERS)
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if "optim" not in p.relative_to(PACKAGE).parts[:1]]
    assert len(files) > 20 and PACKAGE / "cost.py" in files
    hits = [f"{p.relative_to(PACKAGE)}:{line}: {what}" for p in files
            for line, what in name_branches(p.read_text(), names)]
    assert not hits, "branches on an optimizer's name (declare it on the config class instead):\n" + "\n".join(hits)


def test_the_scan_finds_each_kind_of_branch():
    names = {"muon", "psgd"}
    bad = ['if optim.name == "muon": pass', 'x = name in ("muon", "lion")', 'y = {"muon", "adamw"} <= set(r)',
           'match name:\n    case "psgd" | "x": pass', 'k = {"psgd": 1}.get(name)', 'k = {"psgd": 1}[name]']
    for source in bad:
        assert name_branches(source, names), source
    good = ['OPTS = ("muon", "psgd")', 'LABELS = {"muon": "Muon"}', 'f(d, "muon")', 'if name == "lion": pass',
            'c = LABELS.get(name)']
    for source in good:
        assert not name_branches(source, names), source

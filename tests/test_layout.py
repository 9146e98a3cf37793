"""One owner of the run directory: no module but runs.py spells a path inside a run.

A run's files (runs.RunDir) and its PTQ results (runs.PTQ_FILES) are named in runs.py alone; everything
else asks RunDir. Checked on the source with `ast`: a string constant that names one of those files (as
a whole, or as a component of a path like "ptq/final/outliers.json") and a path joined with "ptq" or
"history" are errors outside runs.py. Docstrings are documentation and are skipped. A Hugging Face
folder has its own config.json and model.safetensors (hf/, the HF layout, not a run's).
"""

from __future__ import annotations

import ast
from pathlib import Path

import optquant
from optquant.runs import LOCK, PTQ_FILES, WEIGHT_FILES, RunDir

SRC = Path(optquant.__file__).parent
RUN = RunDir(Path("r"))
NAMES = {p.name for p in (RUN.config, RUN.metrics, RUN.summary, RUN.checkpoint, RUN.history, RUN.outliers(),
                          RUN.lm_eval)}
NAMES |= {*WEIGHT_FILES.values(), *PTQ_FILES.values(), LOCK}
DIRS = {"ptq", RUN.history.name}  # a run's subdirectories: joined with `/` only in runs.py
HF_LAYOUT = {"config.json", "model.safetensors"}  # an HF folder's own files (hf/)


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def run_paths(path: Path) -> list[str]:
    """Where `path` spells a path inside a run directory: `line: text`."""
    tree = ast.parse(path.read_text(), str(path))
    allowed = HF_LAYOUT if path.parent.name == "hf" else set()
    docs, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            parts = {p.strip("{}") for p in node.value.replace(",", "/").split("/")}
            if parts & (NAMES - allowed):
                found.append(f"{node.lineno}: {node.value!r}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                and node.right.value in DIRS:
            found.append(f"{node.lineno}: / {node.right.value!r}")
    return sorted(found, key=lambda hit: int(hit.split(":")[0]))


def test_no_module_but_runs_spells_a_run_path():
    offenders = {str(p.relative_to(SRC)): hits for p in sorted(SRC.rglob("*.py"))
                 if p.name != "runs.py" and (hits := run_paths(p))}
    assert not offenders, f"paths inside a run spelled outside runs.py (use runs.RunDir): {offenders}"


def test_the_check_sees_the_spellings_it_forbids(tmp_path):
    """The scan catches a file name, a name inside a path and a joined subdirectory; docstrings pass."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""Writes summary.json."""\n'
                   'a = run / "summary.json"\nb = "ptq/final/outliers.json"\nc = run / "ptq" / x\n'
                   'd = f"{run}/metrics.jsonl"\n')
    assert [h.split(":")[0] for h in run_paths(bad)] == ["2", "3", "4", "5"]

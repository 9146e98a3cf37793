"""One owner of the run directory and one of the study directory: no module but runs.py spells a path
inside a run or a study.

A run's files (runs.RunDir), its PTQ results (runs.PTQ_FILES) and a study's files (runs.StudyDir: study.json,
results.parquet, costs.jsonl, robust.parquet, report/, ...) are named in runs.py alone; everything else asks
RunDir or StudyDir. Checked on the source with `ast`: a string constant that names one of those files (as
a whole, or as a component of a path like "ptq/final/outliers.json") and a path joined with "ptq" or
"history" (a run's), or with "runs", "bits", "report" or "figures" (a study's), are errors outside
runs.py. Docstrings are documentation and are skipped. A Hugging Face
folder has its own config.json and model.safetensors (hf/, the HF layout, not a run's).
"""

from __future__ import annotations

import ast
from pathlib import Path

import optquant
from optquant.runs import LOCK, PTQ_FILES, WEIGHT_FILES, RunDir, StudyDir

SRC = Path(optquant.__file__).parent
RUN = RunDir(Path("r"))
NAMES = {p.name for p in (RUN.config, RUN.metrics, RUN.summary, RUN.checkpoint, RUN.history, RUN.outliers(),
                          RUN.lm_eval)}
NAMES |= {*WEIGHT_FILES.values(), *PTQ_FILES.values(), LOCK}
STUDY = StudyDir(Path("s"))
NAMES |= {p.name for p in (STUDY.study, STUDY.costs, STUDY.results, STUDY.correlations, STUDY.fits, STUDY.best,
                           STUDY.robust, STUDY.page)}
DIRS = {"ptq", RUN.history.name}  # a run's subdirectories: joined with `/` only in runs.py
DIRS |= {p.name for p in (STUDY.runs, STUDY.bits, STUDY.report, STUDY.figures)}  # not submitit: data prepare's too
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


def test_no_module_but_runs_spells_a_run_or_study_path():
    offenders = {str(p.relative_to(SRC)): hits for p in sorted(SRC.rglob("*.py"))
                 if p.name != "runs.py" and (hits := run_paths(p))}
    assert not offenders, f"paths inside a run or study spelled outside runs.py (use RunDir, StudyDir): {offenders}"


def test_the_check_sees_the_spellings_it_forbids(tmp_path):
    """The scan catches a file name, a name inside a path and a joined subdirectory; docstrings pass."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""Writes summary.json."""\n'
                   'a = run / "summary.json"\nb = "ptq/final/outliers.json"\nc = run / "ptq" / x\n'
                   'd = f"{run}/metrics.jsonl"\n')
    assert [h.split(":")[0] for h in run_paths(bad)] == ["2", "3", "4", "5"]


def test_the_check_sees_a_study_file_anywhere(tmp_path):
    """Every study file name and subdirectory StudyDir owns is caught, as a whole string, in a path or joined."""
    bad = tmp_path / "bad.py"
    names = sorted(NAMES & {p.name for p in (STUDY.study, STUDY.costs, STUDY.results, STUDY.correlations,
                                             STUDY.fits, STUDY.best, STUDY.robust, STUDY.page)})
    assert "results.parquet" in names and "costs.jsonl" in names and "robust.parquet" in names
    lines = [f"x = {n!r}" for n in names] + ['y = f"{root}/results.parquet"', 'z = root / "report" / "figures"',
                                             'w = Path(root) / "bits"', 'v = "results.parquet is written last"']
    bad.write_text("\n".join(lines) + "\n")
    hits = [int(h.split(":")[0]) for h in run_paths(bad)]
    assert hits == [*range(1, len(names) + 3), len(names) + 2, len(names) + 3], hits  # prose (the last) passes

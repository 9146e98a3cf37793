"""The package's import graph, built from the source with `ast`, is acyclic and layered.

What counts as an edge a → b: every `import optquant…` and `from optquant… import …` anywhere in module
a, at module level or inside a function (a deferred import is as real a dependency; it only runs
later). `from optquant.x import y` is an import of optquant.x.y when y is a module. Importing a module
also runs its packages' __init__ files, so an import of optquant.quant.ptq from outside optquant.quant
is an edge to optquant.quant too (inside a package that is circular by construction and harmless).

Layers, lowest first; a module may import from its own layer (without cycles) or lower ones. `config`
sits above optim/quant because a RunConfig holds an optimizer config and a QATConfig; `report` sits
below `study` because a study renders its report (a deferred import in study/plan.py), while the
report only reads a study's files.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import optquant

SRC = Path(optquant.__file__).parent
LAYERS = [
    {"", "errors"},  # "" = the optquant package itself
    {"device", "files", "tracking", "compiled", "ranges"},
    {"model", "data", "corpus", "checkpoint", "distributed", "evaluate", "scaling", "stats"},
    {"optim", "quant"},
    {"config", "runs"},
    {"metrics", "harness"},
    {"ptq_stage", "train"},
    {"cost"},
    {"hf"},
    {"study_spec"},  # the StudySpec: data that the study runs and the report reads
    {"report"},
    {"study"},
    {"cli"},
]


def module_name(path: Path) -> str:
    parts = ("optquant", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "optquant"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "optquant":
            assert node.level == 0, f"{path}: relative import"
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= {s for s in subs if is_module(s)} or {node.module}
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        deps = set()
        for dep in imports_of(path):
            parts = dep.split(".")
            for k in range(1, len(parts) + 1):  # the module and the packages it runs on the way
                target = ".".join(parts[:k])
                if not (name + ".").startswith(target + "."):  # skip the importer's own packages
                    deps.add(target)
        graph[name] = deps - {name}
    return graph


def layer(name: str) -> int:
    key = name.split(".")[1] if "." in name else ""
    for i, keys in enumerate(LAYERS):
        if key in keys:
            return i
    raise AssertionError(f"{name}: add {key!r} to a layer in tests/test_imports.py")


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_graph_is_read_from_the_real_imports():
    graph = import_graph()
    assert len(graph) > 50 and all(dep in graph for deps in graph.values() for dep in deps)
    assert {"optquant.quant.ptq", "optquant.quant.layers", "optquant.quant"} <= graph["optquant.metrics.chain"]
    assert "optquant.quant.qat" in graph["optquant.train"]  # a function-level import counts
    assert "optquant.distributed" in graph["optquant.train"]  # `from optquant import distributed`


def test_import_graph_is_acyclic():
    graphlib.TopologicalSorter(import_graph()).prepare()  # raises CycleError naming the cycle


def test_imports_only_go_down_the_layers():
    graph = import_graph()
    upward = [f"{a} → {b}" for a, deps in graph.items() for b in deps if layer(b) > layer(a)]
    assert not upward, upward


def test_a_config_does_not_load_the_quantization_code():
    loaded = closure(import_graph(), "optquant.config")
    assert "optquant.quant.qat_config" in loaded
    assert not loaded & {"optquant.quant.ptq", "optquant.quant.gptq", "optquant.quant.qat", "optquant.quant.rotate"}

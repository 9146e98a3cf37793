"""The Bit plans section (issue 31), from the plans `optquant bits RUN --plan-out STUDY/bits/NAME.json` wrote into
the study directory (no study stage computes them; the section is left out where there are none).

Per plan: a table of its modules (bits, parameters, share) and a figure, modules × layers, of each module's share
of the removable error (its gain at the highest choice over the plan's total: for the ABC score, its share of R_L)
beside the bits the plan gives it. Names are read as blocks.<layer>.<...>.<module> (ours and optquant.hf's).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from optquant.files import read_json
from optquant.report.figures import Plot, save
from optquant.report.html import Section
from optquant.report.tables import Table
from optquant.runs import StudyDir

BITS_DIR = StudyDir(Path()).bits.name  # STUDY/bits/*.json: plans from optquant bits
_NAME = re.compile(r"^blocks\.(\d+)\..*?([^.]+)$")


def plan_grid(record: dict) -> tuple[list[str], list[int], np.ndarray, np.ndarray]:
    """(module kinds, layers, share[kind, layer], bits[kind, layer]) of a plan record; NaN where a cell has none."""
    top = str(max(record["choices"]))
    cells = {}
    for name, v in record["modules"].items():
        m = _NAME.match(name)
        if m:
            cells[(m.group(2), int(m.group(1)))] = (float(v.get("gains", {}).get(top, v["gain"])), v["bits"])
    kinds, layers = list(dict.fromkeys(k for k, _ in cells)), sorted({i for _, i in cells})
    total = sum(max(g, 0.0) for g, _ in cells.values()) or 1.0
    share, bits = np.full((len(kinds), len(layers)), np.nan), np.full((len(kinds), len(layers)), np.nan)
    for (k, i), (g, b) in cells.items():
        share[kinds.index(k), layers.index(i)] = max(g, 0.0) / total
        bits[kinds.index(k), layers.index(i)] = b
    return kinds, layers, share, bits


def fig_plan(key: str, record: dict, out: Path) -> Plot:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kinds, layers, share, bits = plan_grid(record)
    fig = Figure(figsize=(2.2 + 0.45 * len(layers), 0.9 + 0.35 * len(kinds)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, data, title, cmap in ((axes[0], share, "share of the removable error", "viridis"),
                                  (axes[1], bits, "planned bits", "coolwarm")):
        im = ax.imshow(data, cmap=cmap, aspect="auto")
        ax.set_xticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
        ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    caption = (f"{BITS_DIR}/{key}.json: {len(record['modules'])} modules, score {record['score']}, average "
               f"{record['plan_avg_bits']:.3f} bits (budget {record['avg_bits']}), choices {record['choices']}.")
    return Plot(f"bits-{key}", f"Bit plan {key}", save(fig, out, f"bits_{key}"), caption)


def bits_section(root: Path, fig_dir: Path) -> Section | None:
    paths = sorted(StudyDir(root).bits.glob("*.json"))
    if not paths:
        return None
    blocks = []
    for path in paths:
        record = read_json(path)
        kinds, layers, share, bits = plan_grid(record)
        rows = tuple((f"{k} {i}", f"{int(bits[a, b])}", f"{share[a, b]:.3f}") for a, k in enumerate(kinds)
                     for b, i in enumerate(layers) if np.isfinite(bits[a, b]))
        blocks += [Table(f"bits-{path.stem}", f"Bit plan {path.stem}: bits and share per module",
                         ("module", "bits", "share"), rows, f"{BITS_DIR}/{path.name}, score {record['score']}."),
                   fig_plan(path.stem, record, fig_dir)]
    return Section("bits", "Bit plans", "Per-module bits from optquant bits (quant/bit_plan.py), with each module's "
                   "share of the error its highest choice would remove.", tuple(blocks))

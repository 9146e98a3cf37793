"""The Bit plans section (issue 31), from the plans in STUDY/bits/*.json: the study's own (study/plan.py
`bits_stage`: each Common-Loss model at +0.5 bits, the decomposition's score, with its size, optimizer and seed)
and any `optquant bits RUN --plan-out STUDY/bits/NAME.json` wrote (each its own group). No plans, no section.

Per group (a size, or one plan): a figure, modules × layers, of each module's share of the removable error (its
gain at the highest choice over the plan's total: for the ABC score, its share of R_L), averaged over the group's
plans, beside the share of its plans that keep the module at the highest choice. One table row per (size,
optimizer): the modules most of its plans keep high and their share of the error. Names are read as
blocks.<layer>.<...>.<module> (ours and optquant.hf's).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from optquant.files import read_json
from optquant.report.figures import Plot, save
from optquant.report.html import Section
from optquant.report.tables import Table
from optquant.runs import StudyDir

BITS_DIR = StudyDir(Path()).bits.name  # STUDY/bits/*.json: plans from the study's bits stage or optquant bits
_NAME = re.compile(r"^blocks\.(\d+)\..*?([^.]+)$")


def plan_cells(record: dict) -> dict[tuple[str, int], tuple[float, bool]]:
    """(module kind, layer) → (share of the plan's removable error, kept at the highest choice) of a plan record."""
    top = max(record["choices"])
    cells = {(m[2], int(m[1])): (max(float(v.get("gains", {}).get(str(top), v["gain"])), 0.0), v["bits"] == top)
             for name, v in record["modules"].items() if (m := _NAME.match(name))}
    total = sum(g for g, _ in cells.values()) or 1.0
    return {k: (g / total, high) for k, (g, high) in cells.items()}


def plan_grid(records: list[dict]) -> tuple[list[str], list[int], np.ndarray, np.ndarray]:
    """(module kinds, layers, mean share[kind, layer], share of plans at the highest choice[kind, layer]) of
    plans of one shape; NaN where a cell has no module."""
    cells = [plan_cells(r) for r in records]
    keys = list(dict.fromkeys(k for c in cells for k in c))
    kinds, layers = list(dict.fromkeys(k for k, _ in keys)), sorted({i for _, i in keys})
    share, high = np.full((len(kinds), len(layers)), np.nan), np.full((len(kinds), len(layers)), np.nan)
    for k, i in keys:
        got = [c[(k, i)] for c in cells if (k, i) in c]
        share[kinds.index(k), layers.index(i)] = np.mean([s for s, _ in got])
        high[kinds.index(k), layers.index(i)] = np.mean([h for _, h in got])
    return kinds, layers, share, high


def fig_plan(key: str, records: list[dict], out: Path, title: str) -> Plot:
    kinds, layers, share, high = plan_grid(records)
    top = max(records[0]["choices"])
    fig = Figure(figsize=(2.6 + 0.45 * len(layers), 0.9 + 0.35 * len(kinds)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, data, name, cmap in ((axes[0], share, "share of the removable error", "viridis"),
                                 (axes[1], high, f"share of plans at {top} bits", "coolwarm")):
        im = ax.imshow(data, cmap=cmap, aspect="auto", **({"vmin": 0, "vmax": 1} if ax is axes[1] else {}))
        ax.set_xticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
        ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(name, fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    r = records[0]
    caption = (f"{len(records)} plan(s) in {BITS_DIR}/, {len(r['modules'])} modules each, score {r['score']}, "
               f"budget {r['avg_bits']} bits, choices {r['choices']}; the share is averaged over the plans.")
    return Plot(f"bits-{key}", title, save(fig, out, f"bits_{key}"), caption)


def bits_section(root: Path, fig_dir: Path) -> Section | None:
    paths = sorted(StudyDir(root).bits.glob("*.json"))
    if not paths:
        return None
    groups: dict[str, dict[str, list[dict]]] = {}  # figure group → table row (optimizer, or the plan) → plans
    for p in paths:
        r = read_json(p)
        groups.setdefault(str(r.get("size") or p.stem), {}).setdefault(str(r.get("optimizer") or "–"), []).append(r)
    rows, figs = [], []
    for g, by_row in groups.items():
        figs.append(fig_plan(re.sub(r"[^\w-]", "_", g), [r for rs in by_row.values() for r in rs], fig_dir,
                             f"Bit plans {g}: modules × layers"))
        for row, records in by_row.items():
            kinds, layers, share, high = plan_grid(records)
            kept = [(f"{k} {i}", share[a, b]) for a, k in enumerate(kinds) for b, i in enumerate(layers)
                    if np.isfinite(high[a, b]) and high[a, b] > 0.5]
            avg = np.mean([r["plan_avg_bits"] for r in records])
            rows.append((g, row, str(len(records)), f"{avg:.3f}", ", ".join(n for n, _ in kept) or "none",
                         f"{sum(s for _, s in kept):.2f}"))
    table = Table("bits", "Bit plans: the modules kept at the highest choice", ("size or plan", "optimizer",
                  "plans", "average bits", "kept high in most plans", "their share of the error"), tuple(rows),
                  f"From {BITS_DIR}/*.json (quant/bit_plan.py): per size and optimizer over seeds (a study's plans), "
                  "or per plan; a module's share is its gain at the highest choice over the plan's total.")
    return Section("bits", "Bit plans", "Per-module bits at an average budget from the error decomposition "
                   "(quant/bit_plan.py): which modules to keep at higher precision, and how much of the error at "
                   "the output they carry.", (table, *figs))

"""The report's timing section ("Study cost"): where the study's wall time went, from STUDY_DIR/costs.jsonl.

The executor appends one line per job that ran (study/executor.py `timing_record`): its stage (fp, cl
and qat training, ptq, outliers), optimizer, size, start and end, worker and seconds per part
(training, qat, ptq, analysis). Jobs answered from files (a resumed study) are not in the log. Tables:
wall time per stage (with its worker utilisation: busy worker-seconds over workers × the stage's span),
per optimizer and part, and the share of each part in the whole.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from optquant.report.html import Section
from optquant.report.tables import Table
from optquant.runs import StudyDir

PARTS = ("training", "ptq", "analysis", "qat")
STAGES = ("fp", "cl", "ptq", "outliers", "qat", "robust")


def read_timings(root: Path) -> list[dict]:
    path = StudyDir(root).costs
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write: skip it
            continue
    return out


def _hms(s: float) -> str:
    return f"{s:,.0f} s" if s < 600 else f"{s / 60:,.1f} min" if s < 36000 else f"{s / 3600:,.1f} h"


def _pct(x: float, total: float) -> str:
    return f"{100 * x / total:.1f} %" if total > 0 else "–"


def utilisation(records: list[dict]) -> float:
    """Busy worker-seconds / (workers × span) over the records' time window."""
    if not records:
        return float("nan")
    span = max(r["end"] for r in records) - min(r["start"] for r in records)
    workers = max(r.get("workers", 1) for r in records)
    return sum(r["seconds"] for r in records) / (workers * span) if span > 0 else float("nan")


def stage_table(records: list[dict]) -> Table:
    by_stage: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_stage[r["stage"]].append(r)
    total = sum(r["seconds"] for r in records)
    order = [s for s in STAGES if s in by_stage] + sorted(set(by_stage) - set(STAGES))
    rows = [(s, str(len(by_stage[s])), _hms(sum(r["seconds"] for r in by_stage[s])),
             _pct(sum(r["seconds"] for r in by_stage[s]), total), f"{utilisation(by_stage[s]):.0%}",
             _hms(max(r["seconds"] for r in by_stage[s]))) for s in order]
    rows.append(("all", str(len(records)), _hms(total), "100 %", f"{utilisation(records):.0%}",
                 _hms(max(r["seconds"] for r in records))))
    return Table("cost-stages", "Wall time per stage", ("stage", "jobs", "job time", "share", "utilisation",
                                                        "longest job"), tuple(rows),
                 caption="Job time is the sum of the jobs' wall-clock seconds (worker-seconds). Utilisation: "
                 "that sum over (workers × the stage's first-start-to-last-end span); below 100 % a worker "
                 "idled, e.g. waiting for the last long job of a stage.")


def optimizer_table(records: list[dict]) -> Table:
    sums: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        sums[r.get("optimizer") or "?"].update(r.get("parts", {}))
    rows = [(o, *(_hms(sums[o][p]) if sums[o][p] else "–" for p in PARTS), _hms(sum(sums[o].values())))
            for o in sorted(sums)]
    return Table("cost-optimizers", "Wall time per optimizer and part", ("optimizer", *PARTS, "total"),
                 tuple(rows), caption="Worker-seconds per optimizer: FP and CL training, PTQ (quantize, "
                 "val loss, multiple choice), analysis (outliers and ABC) and QAT training.")


def share_table(records: list[dict]) -> Table:
    sums: Counter = Counter()
    for r in records:
        sums.update(r.get("parts", {}))
    total = sum(sums.values())
    rows = tuple((p, _hms(sums[p]), _pct(sums[p], total)) for p in (*PARTS, *sorted(set(sums) - set(PARTS)))
                 if p in sums)
    return Table("cost-shares", "Share of the study's time", ("part", "time", "share"), rows,
                 caption="Where the next minute should come from: the largest share is the one to speed up.")


def timing_section(root: Path) -> Section:
    records = read_timings(root)
    intro = "Where the study's wall time went, from costs.jsonl (one line per job the executor ran)."
    if not records:
        missing = Table("cost-stages", "Wall time per stage", missing="no cost log: costs.jsonl lists the jobs "
                        "the executor ran (none here: a study from before the log, or every job was already done)")
        return Section("costs", "Study cost", intro, (missing,))
    return Section("costs", "Study cost", intro,
                   (stage_table(records), (optimizer_table(records), share_table(records))))

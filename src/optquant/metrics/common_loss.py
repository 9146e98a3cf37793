"""Common Loss (CL): the validation loss every optimizer reaches at a model size (paper.md §4).

CL(size) = max over optimizers of (min over that optimizer's runs of the best validation loss), i.e.
the worst of the optimizers' best losses. Each optimizer's CL model is its best run's checkpoint at the
first evaluation whose validation loss is at or below CL (the authors' `--thresh` checkpoint), so all
pre-quantization models have nearly the same loss and PTQ damage measures robustness alone.

Pure functions over run summaries (mappings with `optimizer`, `size` and the best validation loss) and
over a run's `metrics.jsonl` records. Runs whose best loss is not finite (diverged) are ignored; an
optimizer with no finite run is left out of CL with a warning, since it reaches no loss at all.
Left out on purpose: reading files (callers pass parsed records) and re-running training.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

from optquant.errors import OptquantError

log = logging.getLogger(__name__)


def _field(run: Mapping, key: str):
    if key not in run:
        raise OptquantError(f"common_loss: a run summary lacks {key!r} (has {sorted(run)})")
    return run[key]


def best_runs(summaries: Iterable[Mapping], key: str = "best_val_loss") -> dict[tuple, Mapping]:
    """(size, optimizer) -> the run with the lowest finite `key` (the best-LR run of a sweep)."""
    best: dict[tuple, Mapping] = {}
    seen: set[tuple] = set()
    for run in summaries:
        group = (_field(run, "size"), _field(run, "optimizer"))
        seen.add(group)
        loss = float(_field(run, key))
        if math.isfinite(loss) and (group not in best or loss < float(best[group][key])):
            best[group] = run
    for size, opt in sorted(seen - best.keys(), key=str):
        log.warning("common loss: optimizer %s at size %s has no finite %s; left out", opt, size, key)
    return best


def common_loss(summaries: Iterable[Mapping], key: str = "best_val_loss") -> dict:
    """size -> CL, the maximum over optimizers of each optimizer's best `key`."""
    cl: dict = {}
    for (size, _), run in best_runs(summaries, key).items():
        cl[size] = max(cl.get(size, -math.inf), float(run[key]))
    return cl


def first_crossing(
    records: Iterable[Mapping], cl: float, key: str = "val_loss", tol: float = 0.0
) -> Mapping | None:
    """The first eval record (in step order) with `key` ≤ cl + tol, or None if the run never gets there.

    Records without `key` (training-only lines of metrics.jsonl) are skipped.
    """
    evals = [r for r in records if key in r and r[key] is not None]
    for rec in sorted(evals, key=lambda r: r.get("step", 0)):
        if float(rec[key]) <= cl + tol:
            return rec
    return None

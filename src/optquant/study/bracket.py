"""LR search that brackets the optimum: extend the grid until the best LR has a worse neighbour on each
side, then refine once between the best LR and its better neighbour.

Pure functions over {lr: loss} (the mean final validation loss of an optimizer at one size, +inf for a
diverged run), so the rule is tested on synthetic loss curves and the study only submits what they ask for.

    round 0   the initial log grid
    round k   while the best LR is the grid's lowest (highest) point: one more point a grid step below
              (above) it, up to `max_extensions` rounds; a point that diverges ends the search on its side
    last      one refinement at the geometric mean of the best LR and its better (lower-loss) neighbour

Status of an (optimizer, size) after the search: "bracketed" (finite, worse neighbours on both sides),
"diverged" (the neighbour on one side diverged: the optimum lies between the best LR and the divergence
edge), "cap" (the best LR is still at an edge after `max_extensions` extensions), "no-converged-lr" (every
LR diverged). Only "bracketed" is tuned; every other status is flagged in the results and the report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from optquant.study_spec import round_lr


@dataclass(frozen=True)
class Bracket:
    best: float | None  # the LR with the lowest finite loss (None when every LR diverged)
    status: str  # "bracketed" | "diverged" | "cap" | "no-converged-lr" (after the search; see module doc)
    reason: str  # a sentence for the report


def best_lr(losses: Mapping[float, float]) -> float | None:
    """The LR with the lowest finite loss (ties: the smaller LR), or None."""
    finite = {lr: loss for lr, loss in losses.items() if math.isfinite(loss)}
    return min(sorted(finite), key=lambda lr: finite[lr]) if finite else None


def _neighbours(losses: Mapping[float, float], best: float) -> tuple[float | None, float | None]:
    grid = sorted(losses)
    i = grid.index(best)
    return (grid[i - 1] if i > 0 else None), (grid[i + 1] if i + 1 < len(grid) else None)


def extensions(losses: Mapping[float, float], step: float) -> list[float]:
    """The LRs to try next so that the best LR gets a neighbour on each side ([] when it has both, when
    the missing side's neighbour diverged, or when every LR diverged)."""
    best = best_lr(losses)
    if best is None:
        return []
    below, above = _neighbours(losses, best)
    new = (round_lr(lr) for side, lr in ((below, best / step), (above, best * step)) if side is None)
    return [lr for lr in new if lr not in losses]


def refinement(losses: Mapping[float, float]) -> float | None:
    """The geometric mean of the best LR and its better finite neighbour (None if it has none)."""
    best = best_lr(losses)
    if best is None:
        return None
    sides = [lr for lr in _neighbours(losses, best) if lr is not None and math.isfinite(losses[lr])]
    if not sides:
        return None
    other = min(sides, key=lambda lr: losses[lr])
    lr = round_lr(math.sqrt(best * other))
    return None if lr in losses else lr


def bracket(losses: Mapping[float, float]) -> Bracket:
    """Where the search ended (see the module docstring for the statuses)."""
    best = best_lr(losses)
    if best is None:
        return Bracket(None, "no-converged-lr", f"all {len(losses)} learning rates diverged")
    below, above = _neighbours(losses, best)
    missing = [side for side, lr in (("lower", below), ("higher", above)) if lr is None]
    if missing:
        return Bracket(best, "cap", f"best LR {best:g} is the {' and '.join(missing)} edge of the grid "
                                    "after the last allowed extension")
    diverged = [side for side, lr in (("lower", below), ("higher", above)) if not math.isfinite(losses[lr])]
    if diverged:
        return Bracket(best, "diverged", f"the next {' and '.join(diverged)} LR diverged; the optimum lies "
                                         f"between {best:g} and the divergence edge")
    return Bracket(best, "bracketed", "worse neighbours on both sides")

"""The step-size search of a study: every step size that moves a real share of the parameters is searched.

An optimizer's main LR is searched at every size (study/bracket.py: a log grid, extended until bracketed,
refined once). Its other step sizes (Muon's AdamW group, Scion's embedding and vector groups: the
`GROUP_LRS` an optimizer config declares) are tied to it, group lr = ratio × lr, so that the LR search
moves them too, and with `tune_groups` each ratio is searched by the same rule at every size:

    smallest size   LR search from the default grid → each ratio searched at that best LR, one group after
                    another → if a ratio moved, the LR searched again around its best at the new ratios
    other sizes     the same, all sizes at once, every grid (LR and ratios) centred on the smallest size's
                    result, since optima move little between neighbouring sizes (fewer wasted points)

One pass of coordinate search per size; the ratios start from the authors' values over their default LR
(e.g. Muon's 3e-3 / 3e-2). `benchmarks/tuning_check.py` checks the result: moving any step size ×3 or ÷3
around the study's choice must not improve the loss by more than the seeds' noise.

Pure over a `run` callable (stage, {tag: RunConfig} → {tag: summary}), so the rule is tested without
training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from optquant.config import RunConfig
from optquant.study.bracket import Bracket, bracket, extensions, refinement, round_lr
from optquant.study_spec import StudySpec, lr_grid, run_config

Key = tuple[str, str]  # (optimizer, size)
Runner = Callable[[str, dict[Hashable, RunConfig]], dict[Hashable, dict[str, Any]]]


@dataclass(frozen=True)
class LRSearch:
    """One (optimizer, size)'s step sizes as the study chose them: every LR tried (the first seed's summary;
    at the best LR, every seed's), the best LR and whether the search bracketed it (study/bracket.py), the mean
    final loss over the best LR's seeds, the tied groups' ratios with their searches, and each parameter
    group's step size (`step_sizes`). `sweeps`: the optimizer's swept settings (field → value)."""

    lrs: dict[float, list[dict[str, Any]]]
    best: float | None
    status: str
    reason: str
    best_loss: float
    sweeps: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    ratio_search: dict[str, dict[float, float]] = field(default_factory=dict)
    ratio_status: dict[str, str] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    seeds: tuple[int, ...] = (0,)  # the seeds of each LR's runs in order: the search seed's, then the repeats

    @property
    def converged(self) -> bool:
        return math.isfinite(self.best_loss)

    def best_runs(self) -> dict[int, dict[str, Any]]:
        """The summaries of the best LR's runs by seed."""
        return dict(zip(self.seeds, self.lrs.get(self.best, []), strict=False))

    def runs(self) -> list[tuple[float, int, dict[str, Any]]]:
        """(lr, seed, summary) of every run: each LR's on the search seed, the best LR's on every seed."""
        return [(lr, seed, s) for lr, sums in self.lrs.items() for seed, s in zip(self.seeds, sums, strict=False)]

    def settings(self) -> dict[str, Any]:
        """What every later run of this (optimizer, size) is trained with: the tied groups' ratios (the
        sweeps are `sweeps`)."""
        return ratio_settings(self.ratios)


@dataclass
class Tuning:
    """One (optimizer, size)'s search: the LR's and each tied group ratio's runs, and where each ended."""

    lr_runs: dict[float, dict[str, Any]]  # lr -> first-seed summary, at the final ratios
    lr: Bracket  # the LR search's end over lr_runs
    ratios: dict[str, float] = field(default_factory=dict)  # ratio field -> value (the tied groups)
    ratio_runs: dict[str, dict[float, dict[str, Any]]] = field(default_factory=dict)  # field -> ratio -> summary
    ratio_ends: dict[str, Bracket] = field(default_factory=dict)  # field -> its search's end over ratio_runs


def loss_of(summary: dict[str, Any]) -> float:
    value = summary.get("final_val_loss")
    return math.inf if summary.get("status") != "done" or value is None else float(value)


def losses(runs: dict[float, dict[str, Any]]) -> dict[float, float]:
    return {x: loss_of(s) for x, s in runs.items()}


def group_fields(spec: StudySpec, opt: str) -> list[tuple[str, str, str]]:
    """(label, fixed field, ratio field) of the groups the study ties to lr and searches (none without
    `tune_groups`)."""
    cls = type(run_config(spec, spec.sizes[0], opt).optim)
    return [(label, f, r) for label, (f, r) in getattr(cls, "GROUP_LRS", {}).items()] if spec.tune_groups else []


def initial_ratios(spec: StudySpec, opt: str) -> dict[str, float]:
    """Each searched group's starting ratio: the run config's own if set (> 0), else the fixed value over
    the default lr (the authors' setting at their default LR)."""
    if not (fields := group_fields(spec, opt)):  # a plugin, or no group tuning: nothing to search
        return {}
    optim = run_config(spec, spec.sizes[0], opt).optim
    default = type(optim)()
    return {r: getattr(optim, r) or round_lr(getattr(default, f) / default.lr) for _, f, r in fields}


def centred(x: float, step: float, points: int) -> list[float]:
    return [round_lr(x * step ** (i - (points - 1) / 2)) for i in range(points)]


def ratio_settings(ratios: dict[str, float]) -> dict[str, float]:
    """The run settings of the tied groups' ratios."""
    return {f"optim.{r}": v for r, v in sorted(ratios.items())}


def search(run: Runner, stage: str, grids: dict[Hashable, list[float]], config: Callable[[Hashable, float], RunConfig],
           spec: StudySpec) -> dict[Hashable, dict[float, dict[str, Any]]]:
    """The bracketed 1-D search (study/bracket.py) for many keys at once, a batch of runs per round."""
    found: dict[Hashable, dict[float, dict]] = {k: {} for k in grids}

    def go(name: str, points: dict[Hashable, list[float]]) -> None:
        cfgs = {(k, x): config(k, x) for k, xs in points.items() for x in xs if x not in found[k]}
        if cfgs:
            for (k, x), summary in run(name, cfgs).items():
                found[k][x] = summary

    pending = grids
    for rnd in range(spec.lr_extensions + 1):
        go(stage if rnd == 0 else f"{stage} extension {rnd}", pending)
        pending = {k: new for k in grids if (new := extensions(losses(found[k]), spec.lr_step))}
        if not pending or rnd == spec.lr_extensions:
            break
    if spec.lr_refine:
        go(f"{stage} refinement", {k: [x] for k in grids
                                   if bracket(losses(found[k])).status in ("bracketed", "diverged")
                                   and (x := refinement(losses(found[k]))) is not None})
    return found


def coordinate(run: Runner, spec: StudySpec, config: Callable[[Key, float, dict], RunConfig],
               grids: dict[Key, list[float]], start: dict[Key, dict[str, float]]) -> dict[Key, Tuning]:
    """One pass of coordinate search for every key at once: LR (at the `start` ratios), then each tied group's
    ratio at the best LR, then the LR again around its best where a ratio moved."""
    lr_runs = search(run, "fp sweep", grids, lambda k, lr: config(k, lr, start[k]), spec)
    ends = {k: bracket(losses(lr_runs[k])) for k in grids}
    best = {k: e.best for k, e in ends.items()}
    ratios = {k: dict(v) for k, v in start.items()}  # a copy: `start` is compared with at the end
    ratio_runs: dict[Key, dict[str, dict]] = {k: {} for k in grids}
    ratio_ends: dict[Key, dict[str, Bracket]] = {k: {} for k in grids}
    fields = {k: [r for _, _, r in group_fields(spec, k[0])] for k in grids}
    for i in range(max((len(v) for v in fields.values()), default=0)):
        keys = {k: fields[k][i] for k in grids if i < len(fields[k]) and best[k] is not None}
        if not keys:
            continue
        found = search(run, "group lr", {k: centred(ratios[k][f], spec.lr_step, 3) for k, f in keys.items()},
                       lambda k, x, keys=keys: config(k, best[k], {**ratios[k], keys[k]: x}), spec)
        for k, f in keys.items():
            ratio_runs[k][f], ratio_ends[k][f] = found[k], bracket(losses(found[k]))
            if ratio_ends[k][f].best is not None:
                ratios[k][f] = ratio_ends[k][f].best
    moved = {k: centred(best[k], spec.lr_step, spec.lr_points) for k in grids if ratios[k] != start[k]}
    if moved:
        again = search(run, "fp sweep", moved, lambda k, lr: config(k, lr, ratios[k]), spec)
        lr_runs.update(again)
        ends |= {k: bracket(losses(lr_runs[k])) for k in again}
    return {k: Tuning(lr_runs[k], ends[k], ratios[k], ratio_runs[k], ratio_ends[k]) for k in grids}


def tune(run: Runner, spec: StudySpec, config: Callable[[Key, float, dict], RunConfig]) -> dict[Key, Tuning]:
    """The search at the smallest size, then at every other size from its result (module docstring)."""
    first, rest = spec.sizes[0], spec.sizes[1:]
    keys = [(o, first) for o in spec.optimizers]
    out = coordinate(run, spec, config, {k: list(lr_grid(spec, k[0])) for k in keys},
                     {k: initial_ratios(spec, k[0]) for k in keys})
    if rest:
        grids, ratios = {}, {}
        for o in spec.optimizers:
            src = out[(o, first)]
            b = None if o in spec.lrs or not spec.lr_from_smallest else src.lr.best  # None: the grid as given
            for s in rest:
                grids[(o, s)] = list(lr_grid(spec, o)) if b is None else centred(b, spec.lr_step, spec.lr_points)
                ratios[(o, s)] = dict(src.ratios)
        out.update(coordinate(run, spec, config, grids, ratios))
    return out


def step_sizes(cfg: RunConfig, searched: set[str]) -> list[dict[str, Any]]:
    """Every step size of `cfg`'s optimizers, as the optimizer declares its param groups (its `lr_groups`): the
    parameter groups each moves (embeddings, vectors, matrices), their count and share, its base LR, and how it
    was chosen: "searched" (it is lr), "tied" (a multiple of lr whose ratio field is in `searched`), "tied-fixed"
    (a multiple of lr at a fixed ratio) or "fixed" (it does not move with lr). Nothing is built but the model's
    shapes (cost.meta_model), which give the counts."""
    from optquant.cost import meta_model
    from optquant.optim import split_params

    counts = {kind: sum(p.numel() for p in ps) for kind, ps in vars(split_params(meta_model(cfg))).items()}
    rows, lr = [], cfg.optim.lr
    for g in cfg.optim.lr_groups():  # each parameter group in one param group: no two rows to merge
        if not (kinds := sorted(k for k in g.kinds if counts[k])):
            continue  # build leaves out an empty param group
        if math.isclose(g.lr, lr, rel_tol=1e-9):
            rule, fld = "searched", None
        else:
            fld = g.ratio if g.tied and g.ratio in searched else None
            rule = "tied" if fld else "tied-fixed" if g.tied else "fixed"
        rows.append({"group": "+".join(kinds), "rule": rule, "lr": g.lr, "ratio": g.lr / lr, "field": fld,
                     "params": (n := sum(counts[k] for k in kinds)), "share": n / sum(counts.values())})
    return rows

"""One check of a StudySpec, shared by `optquant study --dry-run`, the real run and `run_study`: both accept
and reject the same values, before anything is planned, written or trained.

Counts are ≥ 1 (`lr_points`, `cl_eval_every`; `lr_extensions` ≥ 0), the LR ratio above 1, `workers` in
[1, cores × 4] locally (at most 1024 elsewhere), lists non-empty and free of duplicates (sizes,
optimizers, seeds, LR grids, sweep values, schemes, QAT bits). Every run the spec describes is built
once through the run config's own validation (presets, `run=`, `per_optimizer`, each LR and seed, each
sweep value, each QAT width, each robust entry), so a value the training would reject (a negative LR, a sweep value "z",
a seed of -1, a name that is a path) is rejected here.

Left out on purpose: `ptq_schemes`, `sweep_ptq_schemes` and `qat_bits` may be empty (a study without
PTQ or QAT), and `run=` overrides are only checked by building the runs.
"""

from __future__ import annotations

import math
import os
import re

from optquant.config import MAX_NAME, NAME
from optquant.errors import OptquantError
from optquant.optim import OPTIMIZERS, is_optimizer
from optquant.quant.ptq import SCHEMES
from optquant.ranges import SEED_MAX
from optquant.study_spec import StudySpec, lr_grid, robust_settings, run_config, search_seed

REMOTE_WORKERS = 1024  # the stated cap of concurrent jobs for the Slurm executors


def _list(what: str, values, allow_empty: bool = False) -> None:
    if not values and not allow_empty:
        raise OptquantError(f"{what}: must not be empty")
    seen = [v for i, v in enumerate(values) if v in values[:i]]
    if seen:
        raise OptquantError(f"{what}: {seen[0]!r} appears more than once")


def _at_least(what: str, value, low: int) -> None:
    if type(value) is not int or value < low:
        raise OptquantError(f"{what}={value!r}: must be a whole number ≥ {low}")


def validate_spec(spec: StudySpec) -> StudySpec:
    """Check `spec` (see the module docstring); returns it. One OptquantError naming the setting."""
    if not re.fullmatch(NAME, spec.name) or len(spec.name) > MAX_NAME - 16:
        raise OptquantError(f"name={spec.name[:40]!r}{'…' if len(spec.name) > 40 else ''}: use at most "
                            f"{MAX_NAME - 16} letters, digits and . _ + - (it names the study's runs)")
    _list("sizes", spec.sizes)
    _list("optimizers", spec.optimizers)
    _list("seeds", spec.seeds)
    for seed in spec.seeds:
        _at_least("seeds", seed, 0)
        if seed > SEED_MAX:  # named here, not by the first run it would build (lrs.OPT=… at size …: seed=…)
            raise OptquantError(f"seeds={seed}: a run's seed is at most {SEED_MAX:,}")
    _at_least("lr_points", spec.lr_points, 1)
    _at_least("lr_extensions", spec.lr_extensions, 0)
    _at_least("cl_eval_every", spec.cl_eval_every, 1)
    if not (isinstance(spec.lr_step, int | float) and math.isfinite(spec.lr_step) and spec.lr_step > 1):
        raise OptquantError(f"lr_step={spec.lr_step!r}: the ratio between neighbouring LRs must be above 1")
    cap = (os.cpu_count() or 1) * 4 if spec.executor == "local" else REMOTE_WORKERS
    if type(spec.workers) is not int or not 1 <= spec.workers <= cap:
        raise OptquantError(f"workers={spec.workers!r}: must be in [1, {cap}] "
                            f"({'4 × this machine' + chr(39) + 's cores' if spec.executor == 'local' else 'the cap'})")
    for what, schemes in (("ptq_schemes", spec.ptq_schemes), ("sweep_ptq_schemes", spec.sweep_ptq_schemes)):
        _list(what, schemes, allow_empty=True)
        if unknown := [s for s in schemes if s not in SCHEMES]:
            raise OptquantError(f"{what}: unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    _list("qat_bits", spec.qat_bits, allow_empty=True)
    for opt in (*spec.lrs, *spec.sweeps, *spec.per_optimizer):
        if opt not in spec.optimizers and not is_optimizer(opt):
            raise OptquantError(f"{opt!r} (in lrs, sweeps or per_optimizer): unknown optimizer; choose from "
                                f"{', '.join(OPTIMIZERS)}")
    _check_runs(spec)
    return spec


def _check_runs(spec: StudySpec) -> None:
    """Build every run the spec describes once, through RunConfig's validation."""
    seed0 = search_seed(spec.seeds)
    for opt in spec.optimizers:
        grid = lr_grid(spec, opt)
        _list(f"lrs.{opt}", grid)
        if bad := [lr for lr in grid if not (math.isfinite(lr) and lr > 0)]:
            raise OptquantError(f"lrs.{opt}: {bad[0]} is not a positive learning rate")
        for size in spec.sizes:
            for lr in grid:
                _run(spec, f"lrs.{opt}={lr} at size {size}", size, opt, lr, seed0)
            for seed in spec.seeds:
                _run(spec, f"seeds={seed}", size, opt, None, seed)
            for b in spec.qat_bits:
                _run(spec, f"qat_bits={b}", size, opt, None, seed0,
                     {"qat.method": "quest", "qat.w_bits": b, "qat.a_bits": b})
            for entry in spec.robust:
                _run(spec, f"robust={entry}", size, opt, None, seed0, robust=entry)
        for param, values in spec.sweeps.get(opt, {}).items():
            _list(f"sweeps.{opt}.{param}", values)
            for v in values:
                _run(spec, f"sweeps.{opt}.{param}={v}", spec.sizes[0], opt, None, seed0, extra={param: v})


def _run(spec: StudySpec, what: str, size: str, opt: str, lr: float | None, seed: int,
         settings: dict | None = None, extra: dict | None = None, robust: str | None = None) -> None:
    """Build one run; an error, the entry's own included (`robust`), is named by `what`."""
    try:
        run_config(spec, size, opt, lr, seed, settings, robust_settings(robust) if robust is not None else extra)
    except OptquantError as e:
        raise OptquantError(f"{what}: {e}") from None

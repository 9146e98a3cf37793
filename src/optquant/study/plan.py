"""The planner: the paper's protocol as a sequence of stages, each a batch of idempotent jobs.

    sweeps (1-D, smallest size) → FP LR sweep per (optimizer, size) → best LR (edge ⇒ extend once)
    → Common Loss per size → CL re-runs (stop at the first crossing) → PTQ + outliers + ABC per CL model
    and scheme → outliers of every FP run (MMR vs LR) → QAT at each best LR → results, fits, report

Everything is derived from files, so rerunning a killed study redoes nothing that finished: a done
run is skipped by its summary.json, a killed run resumes from its checkpoint, a finished PTQ result
is read back. Diverged runs are recorded (their loss is +inf for the LR choice) and never retried.
The CL threshold carries a relative slack of 1e-4 so that the optimizer that *defines* CL crosses it
in its re-run even if worker thread counts change the last bits of its losses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from optquant.analysis import scheme_config
from optquant.checkpoint import atomic_write_json
from optquant.config import RunConfig, apply_overrides, run_preset, to_dict
from optquant.metrics.common_loss import common_loss
from optquant.runs import run_dir
from optquant.study.executor import Job, execute
from optquant.study.spec import StudySpec, extend, lr_grid

log = logging.getLogger(__name__)
CL_SLACK = 1e-4
Event = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Study:
    spec: StudySpec
    root: Path
    on_event: Event | None = None

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def emit(self, **event: Any) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def run(self, stage: str, jobs: list[Job]) -> dict[str, dict[str, Any]]:
        self.emit(event="stage", stage=stage, jobs=len(jobs))
        return execute(jobs, self.spec.executor, self.spec.workers, self.root / "submitit",
                       lambda job, result: self.emit(event="job", stage=stage, key=job.key, result=result))


def run_config(spec: StudySpec, size: str, opt: str, lr: float, seed: int, extra: tuple = ()) -> RunConfig:
    cfg = apply_overrides(run_preset(size), [*spec.run, f"optim.name={opt}", *spec.per_optimizer.get(opt, ()),
                                             f"optim.lr={lr}", f"seed={seed}", *extra])
    return replace(cfg, name=f"{spec.name}-{size}")


def train_jobs(study: Study, cfgs: list[RunConfig]) -> list[Job]:
    unique = {str(run_dir(study.runs, c)): c for c in cfgs}
    return [Job("train", Path(d).name, {"config": to_dict(c), "run_dir": d}) for d, c in unique.items()]


def loss_of(summary: dict[str, Any]) -> float:
    value = summary.get("final_val_loss")
    return math.inf if summary.get("status") != "done" or value is None else float(value)


def sweep_stage(study: Study) -> dict[str, tuple[str, ...]]:
    """The paper's sequential 1-D sweeps at the smallest size: each hyperparameter's best value is
    kept for the next sweep and for every size. Returns per-optimizer overrides."""
    spec = study.spec
    tuned: dict[str, tuple] = {opt: () for opt in spec.optimizers}
    for opt, params in spec.sweeps.items():
        if opt not in tuned:
            continue
        center = lr_grid(spec, opt)[len(lr_grid(spec, opt)) // 2]
        for param, values in params.items():
            cfgs = {v: run_config(spec, spec.sizes[0], opt, center, spec.seeds[0], (*tuned[opt], f"{param}={v}"))
                    for v in values}
            results = study.run(f"sweep {opt} {param}", train_jobs(study, list(cfgs.values())))
            best = min(values, key=lambda v: loss_of(results[run_dir(study.runs, cfgs[v]).name]))
            tuned[opt] = (*tuned[opt], f"{param}={best}")
            log.info("sweep %s: %s = %s", opt, param, best)
    return tuned


def fp_stage(study: Study, tuned: dict[str, tuple]) -> dict[tuple, dict[str, Any]]:
    """LR sweep per (optimizer, size, seed); an optimum at a grid edge extends the grid once.
    Returns (opt, size) → {"lrs": {lr: [summary per seed]}, "best": lr, "edge": bool}."""
    spec = study.spec
    grids = {(o, s): list(lr_grid(spec, o)) for o in spec.optimizers for s in spec.sizes}
    results: dict[str, dict] = {}
    for attempt in ("sweep", "extension"):
        cfgs = [run_config(spec, s, o, lr, seed, tuned[o]) for (o, s), grid in grids.items()
                for lr in grid for seed in spec.seeds]
        results.update(study.run(f"fp {attempt}", train_jobs(study, cfgs)))
        table = _lr_table(study, grids, tuned, results)
        if attempt == "extension":
            break
        for key, row in table.items():
            new = extend(tuple(grids[key]), row["best"], spec.lr_step)
            if new is not None and math.isfinite(row["best_loss"]):
                grids[key].append(new)
    for key, row in table.items():
        row["edge"] = extend(tuple(grids[key]), row["best"], spec.lr_step) is not None
    return table


def _lr_table(study: Study, grids: dict, tuned: dict, results: dict) -> dict[tuple, dict[str, Any]]:
    spec, table = study.spec, {}
    for (opt, size), grid in grids.items():
        per_lr = {lr: [results[run_dir(study.runs, run_config(spec, size, opt, lr, seed, tuned[opt])).name]
                       for seed in spec.seeds] for lr in grid}
        mean = {lr: sum(loss_of(s) for s in sums) / len(sums) for lr, sums in per_lr.items()}
        best = min(sorted(mean), key=lambda lr: mean[lr])
        table[(opt, size)] = {"lrs": per_lr, "best": best, "best_loss": mean[best]}
    return table


def cl_stage(study: Study, tuned: dict, table: dict) -> tuple[dict, dict[tuple, Path]]:
    """Common Loss per (size, seed) from the best-LR runs; re-run each to its first crossing."""
    spec, thresholds, cfgs = study.spec, {}, {}
    for i, seed in enumerate(spec.seeds):
        summaries = [{"size": s, "optimizer": o, "best_val_loss": row["lrs"][row["best"]][i].get("best_val_loss")}
                     for (o, s), row in table.items() if row["lrs"][row["best"]][i].get("status") == "done"]
        for size, cl in common_loss([x for x in summaries if x["best_val_loss"] is not None]).items():
            thresholds[(size, seed)] = cl
            for (o, s), row in table.items():
                if s == size and math.isfinite(row["best_loss"]):
                    extra = (*tuned[o], f"train.cl_threshold={cl * (1 + CL_SLACK)!r}", "train.stop_at_cl=true")
                    cfgs[(o, s, seed)] = run_config(spec, s, o, row["best"], seed, extra)
    results = study.run("common loss", train_jobs(study, list(cfgs.values())))
    paths = {}
    for key, cfg in cfgs.items():
        path = run_dir(study.runs, cfg)
        if results[path.name].get("cl_step") is None:
            log.warning("%s never reached the common loss; left out of PTQ", path.name)
        else:
            paths[key] = path
    return thresholds, paths


def ptq_stage(study: Study, cl_paths: dict[tuple, Path], table: dict) -> dict[str, dict]:
    mc = 200 if study.spec.name != "smoke" else 20
    jobs = [Job("ptq", f"{path.name}/{scheme}", {"run_dir": str(path), "ptq": asdict(scheme_config(scheme)),
                                                  "weights": "cl", "mc_items": mc})
            for path in cl_paths.values() for scheme in study.spec.ptq_schemes]
    outliers = [Job("outliers", f"{run_id}/outliers", {"run_dir": str(study.runs / run_id)})
                for row in table.values() for sums in row["lrs"].values() for s in sums
                if s.get("status") == "done" for run_id in [s["run_id"]]]
    return study.run("ptq + analysis", jobs + outliers)


def qat_stage(study: Study, tuned: dict, table: dict) -> dict[str, dict]:
    spec = study.spec
    cfgs = [run_config(spec, s, o, row["best"], seed,
                       (*tuned[o], "qat.method=quest", f"qat.w_bits={b}", f"qat.a_bits={b}"))
            for (o, s), row in table.items() if math.isfinite(row["best_loss"])
            for seed in spec.seeds for b in spec.qat_bits]
    return study.run("qat", train_jobs(study, cfgs))


def run_study(spec: StudySpec, root: Path, on_event: Event | None = None) -> Path:
    """Run (or resume) the whole study in `root`; returns the report's path."""
    from optquant.report import render_report
    from optquant.study.results import write_results

    study = Study(spec, Path(root), on_event)
    study.root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(study.root / "study.json", {"spec": asdict(spec), "sizes": _sizes(spec)})
    tuned = sweep_stage(study)
    table = fp_stage(study, tuned)
    warn_unconverged(study, table)
    thresholds, cl_paths = cl_stage(study, tuned, table)
    ptq_stage(study, cl_paths, table)
    qat = qat_stage(study, tuned, table) if spec.qat_bits else {}
    write_results(study, table, thresholds, cl_paths, qat)
    study.emit(event="stage", stage="report", jobs=0)
    return render_report(study.root)


def warn_unconverged(study: Study, table: dict[tuple, dict[str, Any]]) -> list[str]:
    """Say (log + a "warning" event) which optimizer has no converged LR at a size: the study leaves it
    out of Common Loss, PTQ and QAT there. Returns the messages."""
    messages = [f"{opt} has no converged learning rate at size {size} (every lr of {sorted(row['lrs'])} "
                "diverged); it is left out of Common Loss, PTQ and QAT at that size"
                for (opt, size), row in table.items() if not math.isfinite(row["best_loss"])]
    for message in messages:
        if study.on_event is None:
            log.warning(message)
        study.emit(event="warning", message=message)
    return messages


def _sizes(spec: StudySpec) -> dict[str, dict[str, int]]:
    import torch

    from optquant.model import LM, count_params

    out = {}
    for size in spec.sizes:
        cfg = run_config(spec, size, spec.optimizers[0], 1e-3, 0)
        with torch.device("meta"):
            model = LM(cfg.model)
        out[size] = {"n_params": count_params(model), "n_params_non_embedding": count_params(model, False)}
    return out

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

import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from optquant.analysis import scheme_config
from optquant.checkpoint import atomic_write_json, atomic_write_text
from optquant.config import RunConfig, to_dict
from optquant.harness import HarnessConfig, task_manager
from optquant.runs import read_config, read_metrics, run_dir
from optquant.study.bracket import bracket, extensions, refinement
from optquant.study.executor import Job, WorkerPool, execute
from optquant.study.spec import StudySpec, lr_grid, run_config
from optquant.train import HISTORY, history_checkpoint

log = logging.getLogger(__name__)
CL_SLACK = 1e-4
Event = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Study:
    spec: StudySpec
    root: Path
    on_event: Event | None = None
    pool: WorkerPool | None = None  # the local workers, kept across the stages

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def emit(self, **event: Any) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def run(self, stage: str, jobs: list[Job]) -> dict[str, dict[str, Any]]:
        self.emit(event="stage", stage=stage, jobs=len(jobs))
        return execute(jobs, self.spec.executor, self.spec.workers, self.root / "submitit",
                       lambda job, result: self.emit(event="job", stage=stage, key=job.key, result=result),
                       pool=self.pool)


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
    """The LR search per (optimizer, size) on the first seed (study/bracket.py: extend until bracketed,
    at most `lr_extensions` rounds, then refine once), then the best LR's run for every other seed.
    Returns (opt, size) → {"lrs": {lr: [summary per seed]}, "best": lr, "status", "reason",
    "best_loss": mean final loss over the best LR's seeds}."""
    spec = study.spec
    seed0 = spec.seeds[0]
    keys = [(o, s) for o in spec.optimizers for s in spec.sizes]
    found: dict[tuple, dict[float, dict]] = {key: {} for key in keys}

    def run(stage: str, lrs: dict[tuple, list[float]], seeds=(seed0,)) -> None:
        cfgs = {(key, lr, seed): fp_config(spec, key, lr, seed, tuned) for key, grid in lrs.items()
                for lr in grid for seed in seeds}
        if cfgs:
            results = study.run(stage, train_jobs(study, list(cfgs.values())))
            for (key, lr, seed), cfg in cfgs.items():
                found[key].setdefault(lr, {})[seed] = results[run_dir(study.runs, cfg).name]

    def losses(key: tuple) -> dict[float, float]:
        return {lr: loss_of(per_seed[seed0]) for lr, per_seed in found[key].items()}

    pending = {key: list(lr_grid(spec, key[0])) for key in keys}
    for rnd in range(spec.lr_extensions + 1):
        run("fp sweep" if rnd == 0 else f"fp extension {rnd}", pending)
        pending = {key: new for key in keys if (new := extensions(losses(key), spec.lr_step))}
        if not pending or rnd == spec.lr_extensions:
            break
    if spec.lr_refine:
        run("fp refinement", {key: [lr] for key in keys if bracket(losses(key)).status in ("bracketed", "diverged")
                              and (lr := refinement(losses(key))) is not None})
    ends = {key: bracket(losses(key)) for key in keys}
    run("fp seeds", {key: [b.best] for key, b in ends.items() if b.best is not None}, spec.seeds[1:])
    table = {}
    for key, b in ends.items():
        lrs = {lr: [per_seed[seed] for seed in spec.seeds if seed in per_seed] for lr, per_seed in
               sorted(found[key].items())}
        best_losses = [loss_of(x) for x in lrs[b.best]] if b.best is not None else [math.inf]
        table[key] = {"lrs": lrs, "best": b.best, "status": b.status, "reason": b.reason,
                      "best_loss": sum(best_losses) / len(best_losses)}
        if b.status != "bracketed":
            log.warning("%s at %s: best LR %s not bracketed (%s): %s", *key, b.best, b.status, b.reason)
    return table


def fp_config(spec: StudySpec, key: tuple, lr: float, seed: int, tuned: dict, extra: tuple = ()) -> RunConfig:
    """An FP (or, with `extra`, QAT) run of the study; every evaluation's checkpoint is kept so the
    Common-Loss stage can start from the last one before the crossing instead of replaying the run."""
    opt, size = key
    return run_config(spec, size, opt, lr, seed, (*tuned[opt], "train.keep_history=true", *extra))


def cl_stage(study: Study, tuned: dict, table: dict) -> tuple[dict, dict[tuple, Path]]:
    """Common Loss per size: the worst of the optimizers' best-LR losses over every seed, so that every
    best-LR run of every seed crosses it. Each CL model is found at a resolution of `cl_eval_every`
    steps with the fp32 evaluator, starting from the kept checkpoint of the last evaluation before the
    crossing (a deterministic run resumes exactly where a replay would be)."""
    spec, thresholds, cfgs = study.spec, {}, {}
    done = [(key, s) for key, row in table.items() if row["best"] is not None
            for s in row["lrs"][row["best"]] if s.get("status") == "done" and s.get("best_val_loss") is not None]
    for size in spec.sizes:
        losses = [s["best_val_loss"] for (o, sz), s in done if sz == size]
        if losses:
            thresholds[size] = max(losses)
    for (opt, size), summary in done:
        threshold = thresholds[size] * (1 + CL_SLACK)
        source = study.runs / summary["run_id"]
        start = last_eval_before(read_metrics(source), threshold)
        cfg = run_config(spec, size, opt, table[(opt, size)]["best"], read_config(source).seed,
                         (*tuned[opt], f"train.cl_threshold={threshold!r}", "train.stop_at_cl=true",
                          f"train.cl_eval_every={spec.cl_eval_every}", f"train.cl_eval_from={start}"))
        cfgs[(opt, size, cfg.seed)] = cfg
        seed_from_history(source, start, run_dir(study.runs, cfg))
    results = study.run("common loss", train_jobs(study, list(cfgs.values())))
    paths = {}
    for key, cfg in cfgs.items():
        path = run_dir(study.runs, cfg)
        if results[path.name].get("cl_step") is None:
            log.warning("%s never reached the common loss; left out of PTQ", path.name)
        else:
            paths[key] = path
    return thresholds, paths


def last_eval_before(records: list[dict], threshold: float) -> int:
    """The step of the last evaluation above `threshold` before the first one at or below it (0 if the
    first evaluation already crosses): where the fine search for the crossing starts."""
    start = 0
    for rec in sorted(records, key=lambda r: r["step"]):
        if rec.get("val_loss") is not None and rec["val_loss"] <= threshold:
            break
        start = rec["step"]
    return start


def seed_from_history(source: Path, step: int, target: Path) -> None:
    """Start a CL run from `source`'s kept checkpoint at `step` (its metrics up to that step beside it);
    without one (history pruned, or a run from before keep_history) the CL run replays from scratch."""
    ckpt = history_checkpoint(source, step)
    if not ckpt.exists() or (target / "summary.json").exists() or (target / "checkpoint.safetensors").exists():
        return
    target.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in read_metrics(source) if r["step"] <= step]
    atomic_write_text(target / "metrics.jsonl", "".join(ln + "\n" for ln in lines))
    tmp = target / ".checkpoint.safetensors.seed"
    shutil.copyfile(ckpt, tmp)
    os.replace(tmp, target / "checkpoint.safetensors")


def prune_history(study: Study) -> None:
    """Drop the kept checkpoints once every CL run has started from them (they are only a shortcut: a
    later CL run without one replays its source run)."""
    for path in study.runs.glob(f"*/{HISTORY}"):
        shutil.rmtree(path, ignore_errors=True)


def ptq_stage(study: Study, cl_paths: dict[tuple, Path], table: dict) -> dict[str, dict]:
    """Every PTQ scheme on every CL model (with the built-in MC task, or the lm-eval tasks of `eval.tasks`);
    the sweep schemes, outliers and ABC on the final model of every finished FP run (val loss only), for
    correlations within each size."""
    spec = study.spec
    mc = 0 if spec.eval.tasks else 200 if spec.name != "smoke" else 20
    jobs = [ptq_job(path, scheme, "cl", mc, spec.eval) for path in cl_paths.values() for scheme in spec.ptq_schemes]
    finished = [study.runs / s["run_id"] for row in table.values() for sums in row["lrs"].values() for s in sums
                if s.get("status") == "done"]
    jobs += [ptq_job(path, scheme, "final", 0) for path in finished for scheme in spec.sweep_ptq_schemes]
    if not spec.sweep_ptq_schemes:
        jobs += [Job("outliers", f"{path.name}/outliers", {"run_dir": str(path)}) for path in finished]
    return study.run("ptq + analysis", jobs)


def ptq_job(path: Path, scheme: str, weights: str, mc_items: int, harness: HarnessConfig | None = None) -> Job:
    args = {"run_dir": str(path), "ptq": asdict(scheme_config(scheme)), "weights": weights, "mc_items": mc_items}
    if harness is not None and harness.tasks:
        args["harness"] = asdict(harness)
    return Job("ptq", f"{path.name}/{weights}/{scheme}", args)


def qat_stage(study: Study, tuned: dict, table: dict) -> dict[str, tuple[str, dict]]:
    """QuEST QAT at each best LR, for every seed and bit width; run id → (size, summary)."""
    spec = study.spec
    cfgs = {run_dir(study.runs, cfg).name: (key[1], cfg) for key, row in table.items()
            if row["best"] is not None and math.isfinite(row["best_loss"])
            for seed in spec.seeds for b in spec.qat_bits
            for cfg in [fp_config(spec, key, row["best"], seed, tuned,
                                  ("qat.method=quest", f"qat.w_bits={b}", f"qat.a_bits={b}"))]}
    results = study.run("qat", train_jobs(study, [cfg for _, cfg in cfgs.values()]))
    return {run_id: (size, results[run_id]) for run_id, (size, _) in cfgs.items()}


def run_study(spec: StudySpec, root: Path, on_event: Event | None = None) -> Path:
    """Run (or resume) the whole study in `root`; returns the report's path."""
    from optquant.report import render_report
    from optquant.study.results import write_results
    from optquant.study.validate import validate_spec

    validate_spec(spec)  # the same check as the CLI's, for callers of the library
    if spec.eval.tasks:  # unknown task names fail now, before anything is written or trained
        task_manager(spec.eval.tasks, spec.eval.include_path or None)
    with WorkerPool(spec.workers) as pool:  # started by the first batch that needs it
        study = Study(spec, Path(root), on_event, pool)
        study.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(study.root / "study.json", {"spec": asdict(spec), "sizes": _sizes(spec)})
        tuned = sweep_stage(study)
        table = fp_stage(study, tuned)
        warn_unconverged(study, table)
        thresholds, cl_paths = cl_stage(study, tuned, table)
        ptq_stage(study, cl_paths, table)
        qat = qat_stage(study, tuned, table) if spec.qat_bits else {}
        prune_history(study)  # QAT runs keep theirs too: their config must equal their FP twin's but for qat
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

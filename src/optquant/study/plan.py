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

from optquant.checkpoint import atomic_write_json, atomic_write_text
from optquant.config import RunConfig, to_dict
from optquant.harness import HarnessConfig, task_manager
from optquant.ptq_stage import scheme_config
from optquant.runs import read_config, read_metrics, run_dir
from optquant.study.bracket import bracket
from optquant.study.executor import Job, WorkerPool, execute, threads_per_worker
from optquant.study.spec import StudySpec, lr_grid, run_config
from optquant.study.tuning import loss_of, losses, ratio_overrides, step_sizes, tune
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


def fp_stage(study: Study, swept: dict[str, tuple]) -> tuple[dict[tuple, dict[str, Any]], dict[tuple, tuple]]:
    """The step-size search per (optimizer, size) on the first seed (study/tuning.py: the LR, and each tied
    group's ratio, bracketed and refined), then the best point's run for every other seed. Returns the table
    (opt, size) → {"lrs": {lr: [summary per seed]}, "best": lr, "status", "reason", "best_loss": mean final
    loss over the best LR's seeds, "ratios": {field: value}, "ratio_search": {field: {ratio: loss}}} and
    each key's run overrides (the sweeps' and the tuned ratios)."""
    spec = study.spec
    seed0 = spec.seeds[0]

    def run(stage: str, cfgs: dict) -> dict:
        results = study.run(stage, train_jobs(study, list(cfgs.values())))
        return {tag: results[run_dir(study.runs, cfg).name] for tag, cfg in cfgs.items()}

    def config(key: tuple, lr: float, ratios: dict, seed: int = seed0) -> RunConfig:
        return fp_config(spec, key, lr, seed, {key: (*swept[key[0]], *ratio_overrides(ratios))})

    found = tune(run, spec, config)
    tuned = {key: (*swept[key[0]], *ratio_overrides(t.ratios)) for key, t in found.items()}
    ends = {key: bracket(losses(t.lr_runs)) for key, t in found.items()}
    seeds = {(key, seed): config(key, b.best, found[key].ratios, seed) for key, b in ends.items()
             if b.best is not None for seed in spec.seeds[1:]}
    others = run("fp seeds", seeds) if seeds else {}
    table = {}
    for key, b in ends.items():
        per_lr = {lr: [s] for lr, s in sorted(found[key].lr_runs.items())}
        if b.best is not None:
            per_lr[b.best] += [others[(key, seed)] for seed in spec.seeds[1:]]
        best_losses = [loss_of(x) for x in per_lr[b.best]] if b.best is not None else [math.inf]
        table[key] = {"lrs": per_lr, "best": b.best, "status": b.status, "reason": b.reason,
                      "best_loss": sum(best_losses) / len(best_losses), "ratios": found[key].ratios,
                      "ratio_search": {f: losses(r) for f, r in found[key].ratio_runs.items()},
                      "ratio_status": {f: bracket(losses(r)).status for f, r in found[key].ratio_runs.items()},
                      "groups": step_sizes(config(key, b.best if b.best is not None else 1e-3, found[key].ratios),
                                           set(found[key].ratios))}
        if b.status != "bracketed":
            log.warning("%s at %s: best LR %s not bracketed (%s): %s", *key, b.best, b.status, b.reason)
    return table, tuned


def fp_config(spec: StudySpec, key: tuple, lr: float, seed: int, tuned: dict, extra: tuple = ()) -> RunConfig:
    """An FP (or, with `extra`, QAT) run of the study; every evaluation's checkpoint is kept so the
    Common-Loss stage can start from the last one before the crossing instead of replaying the run.
    `tuned`: (opt, size) → the run's overrides (sweeps, tied group ratios)."""
    opt, size = key
    return run_config(spec, size, opt, lr, seed, (*tuned[key], "train.keep_history=true", *extra))


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
                         (*tuned[(opt, size)], f"train.cl_threshold={threshold!r}", "train.stop_at_cl=true",
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
    mc = mc_items(spec)
    jobs = [ptq_job(path, scheme, "cl", mc, spec.eval) for path in cl_paths.values() for scheme in spec.ptq_schemes]
    finished = [study.runs / s["run_id"] for row in table.values() for sums in row["lrs"].values() for s in sums
                if s.get("status") == "done"]
    jobs += [ptq_job(path, scheme, "final", 0) for path in finished for scheme in spec.sweep_ptq_schemes]
    if not spec.sweep_ptq_schemes:
        jobs += [Job("outliers", f"{path.name}/outliers", {"run_dir": str(path)}) for path in finished]
    return study.run("ptq + analysis", jobs)


def mc_items(spec: StudySpec) -> int:
    """Items of the built-in multiple-choice task per CL model (none when lm-eval tasks score them)."""
    return 0 if spec.eval.tasks else 200 if spec.name != "smoke" else 20


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


def robust_stage(study: Study, tuned: dict, table: dict, thresholds: dict, cl_paths: dict) -> None:
    """The robust arm (study/robust.py): each best-LR run of every seed again with each `robust` entry, with
    the size's CL threshold set; every PTQ scheme on their CL models, the first on their final models and
    the plain runs' (the plain CL models' PTQ is the PTQ stage's, read back). Writes robust.parquet."""
    from optquant.quant.robust_config import entry_overrides
    from optquant.study.robust import robust_rows, write_robust

    spec, plain, cfgs = study.spec, {}, {}
    for (opt, size), row in table.items():
        runs = [study.runs / s["run_id"] for s in row["lrs"].get(row["best"], []) if s.get("status") == "done"]
        for source in runs if size in thresholds else []:
            seed, threshold = read_config(source).seed, thresholds[size] * (1 + CL_SLACK)
            plain[(opt, size, seed, "none")] = source
            cl = (f"train.cl_threshold={threshold!r}", f"train.cl_eval_every={spec.cl_eval_every}",
                  f"train.cl_eval_from={last_eval_before(read_metrics(source), threshold)}")
            for entry in spec.robust:
                cfgs[(opt, size, seed, entry)] = run_config(spec, size, opt, row["best"], seed,
                                                            (*tuned[(opt, size)], *entry_overrides(entry), *cl))
    summaries = study.run("robust", train_jobs(study, list(cfgs.values())))
    runs = {key: run_dir(study.runs, cfg) for key, cfg in cfgs.items()}
    cl_models = {key: p for key, p in runs.items() if summaries[p.name].get("cl_step") is not None}
    cl_models |= {(*key, "none"): p for key, p in cl_paths.items() if (*key, "none") in plain}
    finals = {**plain, **{key: p for key, p in runs.items() if summaries[p.name].get("status") == "done"}}
    first = spec.ptq_schemes[0]
    jobs = [ptq_job(p, s, "cl", mc_items(spec), spec.eval) for p in cl_models.values() for s in spec.ptq_schemes]
    results = study.run("robust ptq", jobs + [ptq_job(p, first, "final", 0) for p in finals.values()])
    write_robust(study.root, robust_rows(spec, cl_models, finals, {**plain, **runs}, {**summaries, **results}))


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
        atomic_write_json(study.root / "study.json", {"spec": asdict(spec), "sizes": _sizes(spec),
                                                      "machine": machine(spec)})
        table, tuned = fp_stage(study, sweep_stage(study))
        warn_unconverged(study, table)
        thresholds, cl_paths = cl_stage(study, tuned, table)
        ptq_stage(study, cl_paths, table)
        qat = qat_stage(study, tuned, table) if spec.qat_bits else {}
        if spec.robust:
            robust_stage(study, tuned, table, thresholds, cl_paths)
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


def machine(spec: StudySpec) -> dict[str, Any]:
    """Where the study (last) started: the CPU and whether it multiplies bf16 natively, the precision its runs
    compute in (train.precision and Newton–Schulz, resolved on this CPU), threads per worker, the commit."""
    import torch

    from optquant.device import cpu_name, fast_bf16, use_bf16
    from optquant.runs import git_commit

    cpu = torch.device("cpu")
    runs = {o: run_config(spec, spec.sizes[0], o) for o in spec.optimizers}
    ns = sorted({"bf16" if use_bf16(c.optim.ns_dtype, cpu) else "fp32" for c in runs.values()
                 if hasattr(c.optim, "ns_dtype")})
    train = sorted({f"{c.train.precision} → {'bf16' if use_bf16(c.train.precision, cpu) else 'fp32'}"
                    for c in runs.values()})
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "native_bf16": fast_bf16(cpu), "precision": train,
            "newton_schulz": ns, "workers": spec.workers, "threads_per_worker": threads_per_worker(spec.workers),
            "torch": torch.__version__, **git_commit()}


def _sizes(spec: StudySpec) -> dict[str, dict[str, int]]:
    import torch

    from optquant.model import LM, count_params

    out = {}
    for size in spec.sizes:
        cfg = run_config(spec, size, spec.optimizers[0], 1e-3, 0)
        with torch.device("meta"):
            model = LM(cfg.model)
        out[size] = {"n_params": count_params(model), "n_params_non_embedding": count_params(model, False),
                     "n_layer": cfg.model.n_layer}
    return out

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
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from optquant.config import RunConfig, override
from optquant.device import cpu_name, fast_bf16, use_bf16
from optquant.files import atomic_write, atomic_write_json, atomic_write_text, write_parquet
from optquant.harness import HarnessConfig, task_manager
from optquant.ptq_stage import AnalysisConfig, scheme_config
from optquant.runs import RunDir, StudyDir, git_commit, read_metrics, run_dir
from optquant.study.executor import WorkerPool, execute, threads_per_worker
from optquant.study.jobs import Job, OutliersJob, PTQJob, Result, TrainJob
from optquant.study.tuning import Key, LRSearch, group_fields, loss_of, losses, ratio_settings, step_sizes, tune
from optquant.study_spec import StudySpec, lr_grid, repeat_seeds, robust_settings, run_config, search_seed, spec_to_dict

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
    def dir(self) -> StudyDir:
        return StudyDir(self.root)

    @property
    def runs(self) -> Path:
        return self.dir.runs

    def emit(self, **event: Any) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def run(self, stage: str, jobs: list[Job]) -> dict[str, Result]:
        self.emit(event="stage", stage=stage, jobs=len(jobs))
        return execute(jobs, self.spec.executor, self.spec.workers, self.dir.submitit,
                       lambda job, result, timing: self.emit(event="job", stage=stage, key=job.key,
                                                             job_stage=job.stage, result=result, timing=timing),
                       pool=self.pool)

    def train(self, stage: str, cfgs: dict[Hashable, RunConfig], kind: str | None = None) -> dict[Hashable, Result]:
        """Train `cfgs` (each once, however many tags share a run) as one batch; tag → summary. `kind`: the
        jobs' class in costs.jsonl where their configs cannot tell it (TrainJob.stage)."""
        dirs = {tag: run_dir(self.runs, cfg) for tag, cfg in cfgs.items()}
        unique = {d: TrainJob(cfgs[tag], d, kind) for tag, d in dirs.items()}
        results = self.run(stage, list(unique.values()))
        return {tag: results[d.name] for tag, d in dirs.items()}


@dataclass
class State:
    """What the steps of `run_study` hand on to the later ones."""

    swept: dict[str, dict[str, Any]] = field(default_factory=dict)  # optimizer → its swept settings
    found: dict[Key, LRSearch] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)  # size → Common Loss
    cl_paths: dict[tuple, Path] = field(default_factory=dict)  # (optimizer, size, seed) → CL model's run
    qat: dict[str, tuple[Key, float, int, int, Result]] = field(default_factory=dict)  # run id → its run


def sweep_stage(study: Study, state: State) -> None:
    """The paper's sequential 1-D sweeps at the smallest size: each hyperparameter's best value is
    kept for the next sweep and for every size: `state.swept`, per-optimizer settings (field → value)."""
    spec = study.spec
    tuned: dict[str, dict[str, Any]] = {opt: {} for opt in spec.optimizers}
    for opt, params in spec.sweeps.items():
        if opt not in tuned:
            continue
        center = lr_grid(spec, opt)[len(lr_grid(spec, opt)) // 2]
        for param, values in params.items():
            cfgs = {v: run_config(spec, spec.sizes[0], opt, center, search_seed(spec.seeds),
                                  extra={**tuned[opt], param: v})
                    for v in values}
            results = study.train(f"sweep {opt} {param}", cfgs)
            best = min(values, key=lambda v: loss_of(results[v]))
            tuned[opt] = {**tuned[opt], param: best}
            log.info("sweep %s: %s = %s", opt, param, best)
    state.swept = tuned


def fp_stage(study: Study, state: State) -> None:
    """The step-size search per (optimizer, size) on the search seed (study/tuning.py: the LR, and each tied
    group's ratio, bracketed and refined), then the best point's run for every other seed: `state.found`.
    Warns of the (optimizer, size) pairs without a converged LR."""
    spec, swept = study.spec, state.swept
    seed0 = search_seed(spec.seeds)

    def config(key: Key, lr: float, ratios: dict, seed: int = seed0) -> RunConfig:
        return fp_config(spec, key, lr, seed, swept[key[0]], ratio_settings(ratios))

    found = tune(study.train, spec, config)
    seeds = {(key, seed): config(key, t.lr.best, t.ratios, seed) for key, t in found.items()
             if t.lr.best is not None for seed in repeat_seeds(spec.seeds)}
    others = study.train("fp seeds", seeds) if seeds else {}
    out = {}
    for key, t in found.items():
        b = t.lr
        per_lr = {lr: [s] for lr, s in sorted(t.lr_runs.items())}
        if b.best is not None:
            per_lr[b.best] += [others[(key, seed)] for seed in repeat_seeds(spec.seeds)]
        best_losses = [loss_of(x) for x in per_lr[b.best]] if b.best is not None else [math.inf]
        out[key] = LRSearch(per_lr, b.best, b.status, b.reason, sum(best_losses) / len(best_losses), swept[key[0]],
                            t.ratios, {f: losses(r) for f, r in t.ratio_runs.items()},
                            {f: e.status for f, e in t.ratio_ends.items()},
                            step_sizes(config(key, b.best if b.best is not None else 1e-3, t.ratios), set(t.ratios)),
                            (seed0, *repeat_seeds(spec.seeds)))
        if b.status != "bracketed":
            log.warning("%s at %s: best LR %s not bracketed (%s): %s", *key, b.best, b.status, b.reason)
    state.found = out
    warn_unconverged(study, out)


def fp_config(spec: StudySpec, key: Key, lr: float, seed: int, sweeps: dict[str, Any] | None = None,
              settings: dict[str, Any] | None = None) -> RunConfig:
    """An FP (or, with QAT `settings`, QAT) run of the study; every evaluation's checkpoint is kept so the
    Common-Loss stage can start from the last one before the crossing instead of replaying the run."""
    opt, size = key
    return run_config(spec, size, opt, lr, seed, {**(settings or {}), "train.keep_history": True}, sweeps)


def cl_settings(spec: StudySpec, threshold: float, source: Path) -> dict[str, Any]:
    """A run that keeps its first model at or below `threshold`, evaluating every `cl_eval_every` steps from
    the last evaluation of `source` (the same run without a threshold) before its crossing."""
    return {"train.cl_threshold": threshold, "train.cl_eval_every": spec.cl_eval_every,
            "train.cl_eval_from": last_eval_before(read_metrics(source), threshold)}


def cl_stage(study: Study, state: State) -> None:
    """Common Loss per size: the worst of the optimizers' best-LR losses over every seed, so that every
    best-LR run of every seed crosses it. Each CL model is found at a resolution of `cl_eval_every`
    steps with the fp32 evaluator, starting from the kept checkpoint of the last evaluation before the
    crossing (a deterministic run resumes exactly where a replay would be). Sets the thresholds by size
    and the CL models' run directories by (optimizer, size, seed)."""
    spec, found, cfgs = study.spec, state.found, {}
    done = [(key, seed, s) for key, search in found.items() for seed, s in search.best_runs().items()
            if s.get("status") == "done" and s.get("best_val_loss") is not None]
    thresholds = {size: max(best) for size in spec.sizes
                  if (best := [s["best_val_loss"] for (_, sz), _, s in done if sz == size])}
    for (opt, size), seed, summary in done:
        threshold = thresholds[size] * (1 + CL_SLACK)
        source = study.runs / summary["run_id"]
        search = found[(opt, size)]
        settings = {**search.settings(), **cl_settings(spec, threshold, source), "train.stop_at_cl": True}
        cfg = run_config(spec, size, opt, search.best, seed, settings, search.sweeps)
        cfgs[(opt, size, seed)] = cfg
        seed_from_history(source, settings["train.cl_eval_from"], run_dir(study.runs, cfg))
    results = study.train("common loss", cfgs)
    paths = {key: run_dir(study.runs, cfg) for key, cfg in cfgs.items()}
    for key in [k for k in paths if results[k].get("cl_step") is None]:
        log.warning("%s never reached the common loss; left out of PTQ", paths.pop(key).name)
    state.thresholds, state.cl_paths = thresholds, paths


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
    src, dst = RunDir(source), RunDir(target)
    ckpt = src.history_checkpoint(step)
    if not ckpt.exists() or dst.summary.exists() or dst.checkpoint.exists():
        return
    target.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in read_metrics(source) if r["step"] <= step]
    atomic_write_text(dst.metrics, "".join(ln + "\n" for ln in lines))
    atomic_write(dst.checkpoint, lambda tmp: shutil.copyfile(ckpt, tmp))


def ptq_stage(study: Study, state: State) -> None:
    """Every PTQ scheme on every CL model (with the built-in MC task, or the lm-eval tasks of `eval.tasks`);
    the sweep schemes, outliers and ABC on the final model of every finished FP run (val loss only), for
    correlations within each size."""
    spec = study.spec
    finished = [study.runs / s["run_id"] for search in state.found.values() for _, _, s in search.runs()
                if s.get("status") == "done"]
    jobs: list[Job] = [*ptq_jobs(spec, state.cl_paths.values(), "cl", spec.ptq_schemes),
                       *ptq_jobs(spec, finished, "final", spec.sweep_ptq_schemes)]
    if not spec.sweep_ptq_schemes:
        jobs += [OutliersJob(path) for path in finished]
    study.run("ptq + analysis", jobs)


def bits_stage(study: Study, state: State) -> None:
    """Issue 31's report section: each CL model's bit plan at +0.5 bits over W4 (the decomposition's score, one
    ABC walk; choices 4,8) under the first PTQ scheme, written atomically to STUDY/bits/<run id>.json with its
    (size, optimizer, seed) for report/bit_plans.py. A plan already there is kept: a resumed study computes only
    the missing ones. Runs in the study's process: a walk costs about one PTQ job's analysis."""
    from optquant.ptq_stage import LoadedRun, model_bits  # looked up at the call (a test replaces model_bits)

    todo = {k: p for k, p in state.cl_paths.items() if not (study.dir.bits / f"{p.name}.json").exists()}
    if not study.spec.ptq_schemes or not todo:
        return
    study.emit(event="stage", stage="bit plans", jobs=0)
    qcfg, acfg = scheme_config(study.spec.ptq_schemes[0]), AnalysisConfig(weights="cl")
    for (opt, size, seed), path in sorted(todo.items(), key=lambda kv: str(kv[0])):
        record = model_bits(LoadedRun(path, "cl"), qcfg, acfg, 4.5, (4, 8))
        run = {"run": path.name, "size": size, "optimizer": opt, "seed": seed}
        atomic_write_json(study.dir.bits / f"{path.name}.json", record | run)


def ptq_jobs(spec: StudySpec, paths, weights: str, schemes) -> list[PTQJob]:
    """Each of `schemes` on each run's final or CL weights; a CL model is also scored on the built-in
    multiple-choice task, or on the lm-eval tasks of `eval.tasks` where it names some."""
    cl, tasks = weights == "cl", bool(spec.eval.tasks)
    mc = 0 if not cl or tasks else 200 if spec.name != "smoke" else 20
    acfg = AnalysisConfig(weights=weights, mc_items=mc, harness=spec.eval if cl and tasks else HarnessConfig())
    return [PTQJob(path, scheme_config(scheme), acfg) for path in paths for scheme in schemes]


def qat_stage(study: Study, state: State) -> None:
    """QuEST QAT at each best LR, for every seed and bit width: `state.qat`, run id → ((optimizer, size), lr,
    seed, bits, summary)."""
    spec = study.spec
    if not spec.qat_bits:
        return
    cfgs = {(key, search.best, seed, b): fp_config(spec, key, search.best, seed, search.sweeps, {
                **search.settings(), "qat.method": "quest", "qat.w_bits": b, "qat.a_bits": b})
            for key, search in state.found.items() if search.best is not None and search.converged
            for seed in spec.seeds for b in spec.qat_bits}
    results = study.train("qat", cfgs)
    state.qat = {run_dir(study.runs, cfg).name: (*run, results[run]) for run, cfg in cfgs.items()}


def robust_stage(study: Study, state: State) -> None:
    """The robust arm (study/robust.py): each best-LR run of every seed again with each `robust` entry, with
    the size's CL threshold set, and again to its crossing where it crossed early (`early_crossings`); every
    PTQ scheme on their CL models, the first on their final models and the plain runs' (the plain CL models'
    PTQ is the PTQ stage's, read back). Writes robust.parquet."""
    from optquant.study.robust import robust_rows

    spec, plain, cfgs, thresholds, cl_paths = study.spec, {}, {}, state.thresholds, state.cl_paths
    if not spec.robust:
        return
    for (opt, size), search in state.found.items():
        runs = {seed: study.runs / s["run_id"] for seed, s in search.best_runs().items() if s.get("status") == "done"}
        for seed, source in runs.items() if size in thresholds else ():
            threshold = thresholds[size] * (1 + CL_SLACK)
            plain[(opt, size, seed, "none")] = source
            settings = {**search.settings(), **cl_settings(spec, threshold, source)}
            for entry in spec.robust:
                cfgs[(opt, size, seed, entry)] = run_config(spec, size, opt, search.best, seed, settings,
                                                            {**search.sweeps, **robust_settings(entry)})
    summaries = study.train("robust", cfgs, "robust")  # model-option entries too
    runs = {key: run_dir(study.runs, cfg) for key, cfg in cfgs.items()}
    cl_models = {key: p for key, p in runs.items() if summaries[key].get("cl_step") is not None}
    again = early_crossings(study.runs, cfgs, summaries)
    for key, s in study.train("robust common loss again", again, "robust").items():
        if s.get("cl_step") is None:  # a deterministic replay crosses where its robust run did
            log.warning("%s did not cross again; its CL model stays the regular evaluation's", s.get("run_id"))
            continue
        cl_models[key] = run_dir(study.runs, again[key])
        summaries[key] = {**summaries[key], "cl_step": s["cl_step"]}
    cl_models |= {(*key, "none"): p for key, p in cl_paths.items() if (*key, "none") in plain}
    finals = {**plain, **{key: p for key, p in runs.items() if summaries[key].get("status") == "done"}}
    results = study.run("robust ptq", [*ptq_jobs(spec, cl_models.values(), "cl", spec.ptq_schemes),
                                       *ptq_jobs(spec, finals.values(), "final", [spec.ptq_schemes[0]])])
    by_run = {runs[key].name: s for key, s in summaries.items()}
    write_parquet(study.dir.robust, robust_rows(spec, cl_models, finals, {**plain, **runs}, {**by_run, **results}))


def early_crossings(runs: Path, cfgs: dict[Hashable, RunConfig], summaries: dict[Hashable, Result]) -> dict:
    """The robust runs that crossed the CL threshold before their fine evaluations began (where the plain run's
    search began; a faster method crosses at a regular evaluation, up to `eval_every` steps late): each again
    with fine evaluations from its own last evaluation above the threshold to the crossing, a deterministic
    replay of the robust run (which keeps no history to start from)."""
    again = {}
    for key, cfg in cfgs.items():
        tc, step = cfg.train, summaries[key].get("cl_step")
        if step is not None and tc.cl_eval_every > 0 and step <= tc.cl_eval_from:
            start = last_eval_before(read_metrics(run_dir(runs, cfg)), tc.cl_threshold)
            again[key] = override(cfg, {"train.cl_eval_from": start, "train.stop_at_cl": True})
    return again


def results_stage(study: Study, state: State) -> None:
    """Drop the kept checkpoints, now that every CL run has started from them (they are only a shortcut: a later
    CL run without one replays its source run; QAT runs keep theirs too: their config must equal their FP twin's
    but for qat), then write results.parquet, best.json, the fits and the correlations (study/results.py)."""
    from optquant.study.results import write_results

    for run in study.runs.iterdir() if study.runs.is_dir() else ():
        shutil.rmtree(RunDir(run).history, ignore_errors=True)
    write_results(study, state.found, state.thresholds, state.cl_paths, state.qat)


# ---------------------------------------------------------------- the table of stages
Counts = dict[str, Counter]  # job kind (and "analysed") → (optimizer, size) → jobs of the stages so far


@dataclass(frozen=True)
class Stage:
    """A row of the study's table: the kind of its jobs (what costs.jsonl records as `stage`: fp, cl, ptq,
    outliers or qat), its label (formatted with `spec`), and its jobs per (optimizer, size), from the spec
    and the earlier rows' counts: what it runs, or at most runs where the study decides at run time.
    `expected`: the share of that count a study is expected to run (the ETA's plan); `analysed`: its
    finished runs get the sweep PTQ schemes (or the outliers)."""

    kind: str
    label: str
    jobs: Callable[[StudySpec, Counts], dict[Key, float]]
    expected: Callable[[StudySpec], float] = lambda spec: 1.0
    analysed: bool = True


@dataclass(frozen=True)
class Step:
    """A step of `run_study`: the function that runs its stages (none: a step with no jobs of its own to
    plan), reading and adding to the study's State."""

    run: Callable[[Study, State], None]
    stages: tuple[Stage, ...] = ()


def _each(jobs: Callable[[StudySpec, str], float]) -> Callable[[StudySpec, Counts], dict[Key, float]]:
    """A Stage's jobs: `jobs(spec, optimizer)` at every (optimizer, size)."""
    return lambda spec, c: {(o, s): n for o in spec.optimizers for n in [jobs(spec, o)] for s in spec.sizes}


def _pairs(spec: StudySpec) -> list[Key]:
    return [(o, s) for o in spec.optimizers for s in spec.sizes]


def _after_grid(spec: StudySpec) -> int:
    """Points a 1-D search adds to its grid at most: the extension rounds and one refinement."""
    return spec.lr_extensions + int(spec.lr_refine)


def _new_in_centred(points: int) -> int:
    """New runs in a grid centred on a point already run (tuning.centred, odd `points`): a ratio's grid on the
    best LR's run, the LR again on the last ratio search's best run; the centre is a done run, not a job."""
    return points - points % 2


def _ptq(spec: StudySpec, c: Counts) -> dict[Key, float]:
    """Every PTQ scheme on each CL model, the sweep schemes on each analysed FP run."""
    return {k: c["cl"][k] * len(spec.ptq_schemes) + c["analysed"][k] * len(spec.sweep_ptq_schemes)
            for k in _pairs(spec)}


def _one_round(spec: StudySpec) -> float:
    return min(1.0, 1 / max(1, spec.lr_extensions))


def _half(spec: StudySpec) -> float:
    return 0.5


_robust_runs = _each(lambda spec, o: len(spec.seeds) * len(spec.robust))
STEPS = (
    Step(sweep_stage, (Stage("fp", "sweeps (smallest size)", lambda spec, c: {
        (o, spec.sizes[0]): sum(len(v) for v in spec.sweeps.get(o, {}).values()) for o in spec.optimizers},
        analysed=False),)),
    Step(fp_stage, (
        Stage("fp", "fp sweep (first seed)", _each(lambda spec, o: len(lr_grid(spec, o)))),
        Stage("fp", "fp extensions (≤ {spec.lr_extensions} rounds)", _each(
            lambda spec, o: spec.lr_extensions + (len(lr_grid(spec, o)) == 1 and spec.lr_extensions > 0)),
            expected=_one_round),  # two new LRs in the first round of a one-point grid
        Stage("fp", "fp refinement (≤ 1)", _each(lambda spec, o: int(spec.lr_refine))),
        Stage("fp", "group lr searches (tied ratios, ≤ bound)", _each(
            lambda spec, o: len(group_fields(spec, o)) * (_new_in_centred(3) + _after_grid(spec))), expected=_half,
            analysed=False),
        Stage("fp", "fp sweep again where a ratio moved (≤ bound)", _each(
            lambda spec, o: (_new_in_centred(spec.lr_points) + _after_grid(spec)) * bool(group_fields(spec, o))),
            expected=_half),
        Stage("fp", "fp seeds (best LR, other seeds)", _each(lambda spec, o: len(repeat_seeds(spec.seeds)))),
    )),
    Step(cl_stage, (Stage("cl", "common loss (from the kept checkpoint)", _each(lambda spec, o: len(spec.seeds))),)),
    Step(ptq_stage, (
        Stage("ptq", "ptq + analysis (CL models, FP runs)", _ptq),
        Stage("outliers", "outliers of every FP run", lambda spec, c: {
            k: 0 if spec.sweep_ptq_schemes else c["analysed"][k] for k in _pairs(spec)}),
    )),
    Step(bits_stage),  # in the study's process, no jobs: a plan costs about one PTQ job's analysis
    Step(qat_stage, (Stage("qat", "qat", _each(lambda spec, o: len(spec.seeds) * len(spec.qat_bits))),)),
    Step(robust_stage, (
        Stage("robust", "robust arm (every entry × seed, full budget)", _robust_runs),
        Stage("robust", "robust CL again (crossed early, ≤ bound)", _robust_runs, expected=_half),
        # every scheme on each robust and plain CL model (the plain ones read back from the PTQ stage, still
        # jobs of this stage), the first on every robust and plain final model
        Stage("ptq", "robust ptq (≤ bound)", _each(lambda spec, o: (
            len(spec.seeds) * len(spec.robust) + bool(spec.robust) * len(spec.seeds)) * (len(spec.ptq_schemes) + 1))),
    )),
    Step(results_stage),
)


def planned(spec: StudySpec, expected: bool = False) -> list[tuple[Stage, dict[Key, float]]]:
    """Every row of the table with its jobs per (optimizer, size): at most (the dry run), or with `expected`
    the share a study is expected to run (the ETA), each row counted from the earlier rows' counts."""
    counts: Counts = defaultdict(Counter)
    out = []
    for step in STEPS:
        for st in step.stages:
            share = st.expected(spec) if expected else 1.0
            jobs = {k: n * share for k, n in st.jobs(spec, counts).items() if n}
            counts[st.kind].update(jobs)
            if st.analysed and st.kind == "fp":
                counts["analysed"].update(jobs)
            out.append((st, jobs))
    return out


def phases(kind: str) -> tuple[int, int]:
    """The first and the last step of the table that run jobs of `kind` ((-1, -1): none): the kind's pipeline
    position, and the step after which its count is what ran."""
    steps = [i for i, step in enumerate(STEPS) if any(st.kind == kind for st in step.stages)] or [-1]
    return steps[0], steps[-1]


def run_study(spec: StudySpec, root: Path, on_event: Event | None = None) -> Path:
    """Run (or resume) the whole study in `root`, step by step of the table `STEPS`; returns the report's path."""
    from optquant.report import render_report
    from optquant.study.validate import validate_spec

    validate_spec(spec)  # the same check as the CLI's, for callers of the library
    if spec.eval.tasks:  # unknown task names fail now, before anything is written or trained
        task_manager(spec.eval.tasks, spec.eval.include_path or None)
    with WorkerPool(spec.workers) as pool:  # started by the first batch that needs it
        study = Study(spec, Path(root), on_event, pool)
        study.root.mkdir(parents=True, exist_ok=True)
        probed = _probe(spec)
        study.emit(event="probe", probe=probed)
        atomic_write_json(study.dir.study, {"spec": spec_to_dict(spec), "sizes": _sizes(spec), "machine": machine(spec),
                                            "search_seed": search_seed(spec.seeds), "probe": probed})
        state = State()
        for step in STEPS:
            step.run(study, state)
    study.emit(event="stage", stage="report", jobs=0)
    return render_report(study.root)


def warn_unconverged(study: Study, found: dict[Key, LRSearch]) -> list[str]:
    """Say (log + a "warning" event) which optimizer has no converged LR at a size: the study leaves it
    out of Common Loss, PTQ and QAT there. Returns the messages."""
    messages = [f"{opt} has no converged learning rate at size {size} (every lr of {sorted(search.lrs)} "
                "diverged); it is left out of Common Loss, PTQ and QAT at that size"
                for (opt, size), search in found.items() if not search.converged]
    for message in messages:
        if study.on_event is None:
            log.warning(message)
        study.emit(event="warning", message=message)
    return messages


def _probe(spec: StudySpec) -> dict[str, Any] | None:
    """This machine's speed on the study's shapes for the ETA (study/probe.py): local executors only (a Slurm
    job runs elsewhere); a probe that fails (a plugin that cannot step on random tokens) is none."""
    from optquant.study.probe import probe

    if spec.executor != "local":
        return None
    try:
        return probe(spec, threads_per_worker(spec.workers))
    except Exception:
        log.debug("no probe", exc_info=True)
        return None


def machine(spec: StudySpec) -> dict[str, Any]:
    """Where the study (last) started: the CPU and whether it multiplies bf16 natively, the precision its runs
    compute in (train.precision and Newton–Schulz, resolved on this CPU), threads per worker, the commit."""
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
    from optquant.cost import run_cost

    cfgs = {size: run_config(spec, size, spec.optimizers[0]) for size in spec.sizes}
    return {size: {"n_params": (b := run_cost(cfg)).n_params, "n_params_non_embedding": b.n_params_non_embedding,
                   "n_layer": cfg.model.n_layer} for size, cfg in cfgs.items()}

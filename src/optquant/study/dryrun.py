"""`optquant study --dry-run`: a study's jobs per stage and its cost, computed from the StudySpec alone.

The stages are study/plan.py's; the job counts are an estimate, with upper bounds where the study decides at
run time (`stages`). A Common-Loss run starts from its source run's kept checkpoint of the last evaluation
before the crossing, so it costs a fraction of a full run (`cl_fraction`, an upper bound: it stops at the
crossing). PTQ and analysis jobs are a few forward passes over evaluation batches and are left out of the
GPU-hours (well under 1 % of them at the paper's budget). A QAT run is costed as its FP twin: QuEST's
quantizers are elementwise work outside the 6·N·D count; so is a robust-arm run (the `robust` entries: each a
full-budget run of every seed's best LR; a penalty's extra forward passes and a gain cap's spectral norms are
outside the count too, benchmarks/robust.py measures them). The corpus's training tokens are a prepared
corpus's manifest's, or the embedded corpus's (`epoch_lines`, `check_study_epochs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from optquant.cost import DEFAULT_GPU, GPUConfig, RunCost, gb, meta_models, run_cost
from optquant.data import check_epochs, epochs, train_tokens
from optquant.study.plan import planned
from optquant.study_spec import StudySpec, run_config

TRAINING = ("fp", "cl", "qat", "robust")  # the job kinds that train (their runs are the GPU-hours)


@dataclass(frozen=True)
class Row:
    kind: str  # of its jobs, as the table says (study/plan.py Stage)
    name: str
    jobs: int
    train_runs: dict[tuple[str, str], float]  # (optimizer, size) → full-budget training runs in the stage


def stages(spec: StudySpec) -> list[Row]:
    """The study's stages (study/plan.py `STEPS`) with their job counts; upper bounds where it decides at run
    time: `lr_extensions` rounds of one new LR each (two in the first round of a one-point grid), one
    refinement, and every FP run finishing (each then gets the sweep PTQ schemes)."""
    out = [Row(st.kind, st.label.format(spec=spec), round(sum(jobs.values())), jobs if st.kind in TRAINING else {})
           for st, jobs in planned(spec)]
    return [s for s in out if s.jobs]


def _hours(h: float) -> str:
    return f"{h:>10,.1f}" if h >= 1 else f"{h:>10.3g}"


def cl_fraction(spec: StudySpec, opt: str, size: str, b: RunCost) -> float:
    """A Common-Loss run's cost as a fraction of its full run: `eval_every` training steps, and an fp32
    evaluation (eval_batches micro-batches forward, a third of a step's FLOPs per sequence) every
    `cl_eval_every` steps."""
    tc = run_config(spec, size, opt).train  # the LR and seed change neither cost nor memory
    steps = min(tc.eval_every, b.steps)
    evals = steps / max(1, spec.cl_eval_every) * tc.eval_batches * b.micro_batch / (3 * tc.batch_size)
    return (steps + evals) / b.steps


def run_costs(spec: StudySpec, plan: GPUConfig) -> dict[tuple[str, str], RunCost]:
    """(optimizer, size) → the budget of one FP run (the LR does not change cost or memory)."""
    out = {}
    for size in spec.sizes:
        models = None
        for opt in spec.optimizers:
            cfg = run_config(spec, size, opt)
            models = models or meta_models(cfg)
            out[(opt, size)] = run_cost(cfg, plan, models)
    return out


def study_lines(spec: StudySpec, plan: GPUConfig = DEFAULT_GPU) -> list[str]:
    """The dry-run plan of a study, as printed lines."""
    acc = plan.accelerator()
    budgets = run_costs(spec, plan)
    w = max(9, *(len(o) for o in spec.optimizers))
    lines = [f"study {spec.name}: {len(spec.sizes)} sizes × {len(spec.optimizers)} optimizers, "
             f"{len(spec.seeds)} seed(s), executor {spec.executor}",
             f"accelerator {acc.name}: peak bf16 {acc.bf16_flops / 1e12:g} TFLOP/s, assumed MFU {plan.mfu:g}, "
             f"{gb(acc.memory)} per GPU, {plan.gpus_per_run} GPU(s) per run", "",
             "per run (one FP run; memory per GPU at the micro-batch):",
             f"  {'size':>6} {'optimizer':{w}} {'params':>13} {'tokens':>15} {'FLOPs':>9} {'weights':>9} "
             f"{'grads':>9} {'opt state':>9} {'acts':>9} {'peak':>9} {'GPU-h':>9}"]
    warnings = []
    for (opt, size), b in sorted(budgets.items(), key=lambda kv: (spec.sizes.index(kv[0][1]), kv[0][0])):
        peak = "≥" * (b.state is None) + gb(b.memory)  # a plugin's state is unknown until its run measures it
        lines.append(f"  {size:>6} {opt:{w}} {b.n_params:>13,} {b.tokens:>15,} {b.flops:>9.3g} "
                     f"{gb(b.weights):>9} {gb(b.grads):>9} {gb(b.state):>9} {gb(b.activations):>9} {peak:>9} "
                     f"{b.gpu_hours:>9.3g}")
        if not b.fits:
            warnings.append(f"WARNING {size} {opt}: needs {gb(b.memory)} > {gb(acc.memory)}; fix: {b.fix}")
    lines += ["", "jobs per stage (an estimate; bounds where the study decides at run time):"]
    total_jobs, total_hours = 0, 0.0
    for stage in stages(spec):
        share = {k: cl_fraction(spec, *k, budgets[k]) if stage.kind == "cl" else 1 for k in stage.train_runs}
        hours = sum(n * share[k] * budgets[k].gpu_hours for k, n in stage.train_runs.items())
        total_jobs, total_hours = total_jobs + stage.jobs, total_hours + hours
        lines.append(f"  {stage.name:52} {stage.jobs:>6} jobs" + (f"  {_hours(hours)} GPU-h" if hours else ""))
    lines.append(f"  {'total (upper bound)':52} {total_jobs:>6} jobs  {_hours(total_hours)} GPU-h "
                 f"(training only, at MFU {plan.mfu:g})")
    return lines + epoch_lines(spec, budgets) + ([""] + warnings if warnings else [])


def epochs_by_size(spec: StudySpec, budgets: dict[tuple[str, str], RunCost], raw: bool) -> list[tuple]:
    """(size, data config, tokens one run needs, the corpus's training tokens or None, epochs or None) per size."""
    out = []
    for size in spec.sizes:
        cfg = run_config(spec, size, spec.optimizers[0])
        need = max(budgets[(o, size)].tokens for o in spec.optimizers)
        corpus = train_tokens(cfg.data, cfg.model.vocab_size, raw)
        out.append((size, cfg.data, need, corpus, None if corpus is None else epochs(need, corpus)))
    return out


def epoch_lines(spec: StudySpec, budgets: dict[tuple[str, str], RunCost]) -> list[str]:
    """The dry run's data lines: per size the tokens a run needs, the corpus's training tokens and the epochs."""
    rows = epochs_by_size(spec, budgets, raw=False)
    data = rows[0][1]
    lines = ["", f"data (data.source={data.source}; train and study refuse more than data.max_epochs="
             f"{data.max_epochs:g}):", f"  {'size':>6} {'tokens per run':>15} {'corpus tokens':>15} {'epochs':>9}"]
    for size, d, need, corpus, e in rows:
        if corpus is None:
            lines.append(f"  {size:>6} {need:>15,} {'not counted':>15} {'':>9}  (raw files: counted by "
                         "optquant data prepare)")
            continue
        over = f"  > {d.max_epochs:g}: refused; optquant data prepare SOURCE... --out DIR, then --set " \
               "data.source=DIR" if e > d.max_epochs else ""
        lines.append(f"  {size:>6} {need:>15,} {corpus:>15,} {e:>9,.2f}{over}")
    return lines


def check_study_epochs(spec: StudySpec, plan: GPUConfig = DEFAULT_GPU) -> None:
    """Refuse a study any of whose sizes would repeat its corpus more than data.max_epochs times."""
    for size, d, need, corpus, _ in epochs_by_size(spec, run_costs(spec, plan), raw=True):
        check_epochs(d, need, corpus, f"size {size}")

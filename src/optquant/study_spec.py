"""StudySpec: the whole study as data, with presets and TOML/dotted overrides.

A preset is a plain function returning a StudySpec. `smoke` runs the whole pipeline at toy scale (CI);
`cpu` (the default) is the study this README reports, sized for a 2-core CPU; `cpu-thorough` the fuller
design (more seeds, a wider span of sizes); `gpu` is one GPU at ~50M–125M; `paper` is the paper's grid
(50M…1.5B, 8 learning rates, 20 tokens per parameter).

LR grids are log-spaced around each optimizer's default learning rate (the paper's values, paper.md §3)
unless given explicitly, then extended until the best LR is bracketed (at most `lr_extensions` rounds) and
refined once (study/bracket.py). The LR search uses the first seed; the best LR's run, its Common-Loss
model and its QAT run are repeated for every seed in `seeds`, which is what the report's intervals and
paired tests are computed over. `sweeps` are the paper's sequential one-dimensional sweeps of other
hyperparameters at the smallest size (e.g. `{"muon": {"optim.momentum": (0.9, 0.95, 0.98)}}`); the best
value of each hyperparameter is kept for the next one and for every size. `eval` names lm-eval tasks
(optquant.harness, needs optquant[eval] and the task data offline) that score the Common-Loss models, FP and
quantized, instead of the built-in multiple-choice task: `eval.tasks=piqa,hellaswag,arc_easy`, or a local
task with `eval.include_path=DIR` (a folder of task YAMLs). `robust` lists quantization-robust training
methods, `method[:strength[:every]]` each (`robust=penalty:0.3,gain:4,late-qat:0.2`): every best-LR run is
repeated with each and measured at the Common Loss like the plain runs (study/robust.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec

from optquant.config import RunConfig, SetText, override, run_preset, set_field, settings, typed, typed_overrides
from optquant.errors import OptquantError
from optquant.harness import HarnessConfig, check_harness
from optquant.optim import OPTIMIZERS, is_optimizer, optimizer_config
from optquant.quant.robust_config import RECOMMENDED_ARM, entry_overrides

PAPER_PTQ_SCHEMES = ("w4a4-rtn", "w4a4-gptq", "w4a4-rtn-had", "w4a4-gptq-had")


def round_lr(x: float) -> float:
    """An LR to 4 significant digits: the grid's and the searches' points, as they name runs."""
    return float(f"{x:.4g}")


@dataclass(frozen=True)
class StudySpec:
    name: str = "study"
    sizes: tuple[str, ...] = ("zepto", "atto", "femto", "pico")  # model presets, smallest first
    optimizers: tuple[str, ...] = tuple(OPTIMIZERS)  # the six built-in ones
    lr_points: int = 3  # points of each optimizer's initial log LR grid
    lr_step: float = 3.0  # ratio between neighbouring grid points
    lr_extensions: int = 3  # rounds of grid extension while the best LR sits at an edge
    lr_refine: bool = True  # one more point between the best LR and its better neighbour
    lr_from_smallest: bool = False  # grids after the smallest size centred on its best LR (study/tuning.py)
    tune_groups: bool = False  # tie each group LR an optimizer declares (GROUP_LRS) to lr and search the ratio
    lrs: dict[str, tuple[float, ...]] = field(default_factory=dict)  # explicit grids per optimizer
    sweeps: dict[str, dict[str, tuple[Any, ...]]] = field(default_factory=dict)  # optimizer → field → values
    run: dict[str, Any] = field(default_factory=dict)  # dotted field → value, every run (data, budget, vocab, ...)
    per_optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)  # the same for one optimizer's runs
    ptq_schemes: tuple[str, ...] = PAPER_PTQ_SCHEMES  # on every Common-Loss model
    sweep_ptq_schemes: tuple[str, ...] = ("w4a4-rtn",)  # on every LR-sweep run's final model
    qat_bits: tuple[int, ...] = (4,)  # QuEST W_bA_b runs at each optimizer's best LR; () = no QAT
    seeds: tuple[int, ...] = (0, 1, 2)  # the LR search uses seeds[0]; best-LR, CL and QAT runs use all
    cl_eval_every: int = 1  # evaluation interval (steps) while locating the Common-Loss crossing
    workers: int = 2  # local worker processes; threads are split evenly between them
    executor: Literal["local", "slurm", "submitit-local"] = "local"
    fit_interval: Literal["bootstrap", "loo", "none"] = "bootstrap"  # scaling-fit uncertainty
    eval: HarnessConfig = field(default_factory=HarnessConfig)  # lm-eval tasks instead of the built-in one
    robust: tuple[str, ...] = ()  # the robust arm's entries, method[:strength[:every]]; () = none


def run_config(spec: StudySpec, size: str, opt: str, lr: float | None = None, seed: int = 0,
               settings: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> RunConfig:
    """One run of the study as the planner builds it (`lr` None: the optimizer's default), from typed dotted
    fields: `extra` (swept values, a robust entry) over the spec's, then `lr` and `seed`, then `settings`
    (the planner's own: a tied group's ratio, a Common-Loss threshold)."""
    values = {**spec.run, "optim.name": opt, **spec.per_optimizer.get(opt, {}), **(extra or {}),
              **({} if lr is None else {"optim.lr": lr}), "seed": seed, **(settings or {})}
    return replace(override(run_preset(size), values), name=f"{spec.name}-{size}")


def setting(spec: StudySpec, opt: str, key: str, default: Any, swept: dict[str, Any] | None = None) -> Any:
    """The value of dotted field `key` in `opt`'s runs as the spec sets it (a swept value, else per_optimizer,
    else run), else `default`."""
    return {**spec.run, **spec.per_optimizer.get(opt, {}), **(swept or {})}.get(key, default)


def search_seed(seeds: tuple[int, ...]) -> int:
    """The seed every search runs with (the sweeps, the LR and ratio searches): the first."""
    return seeds[0]


def repeat_seeds(seeds: tuple[int, ...]) -> tuple[int, ...]:
    """The seeds that repeat each search's best point (its FP run; the CL and QAT runs use every seed)."""
    return tuple(seeds[1:])


def lr_grid(spec: StudySpec, optimizer: str) -> tuple[float, ...]:
    """Explicit grid, or `lr_points` values log-spaced by `lr_step` around the optimizer's default lr."""
    if optimizer in spec.lrs:
        return tuple(spec.lrs[optimizer])
    center = optimizer_config(optimizer).lr
    if math.isnan(center):  # a plugin without default_lr
        raise OptquantError(f"optimizer {optimizer!r} declares no default_lr: give its grid, lrs.{optimizer}=...")
    k = spec.lr_points
    return tuple(round_lr(center * spec.lr_step ** (i - (k - 1) / 2)) for i in range(k))


def _caps(cap: int) -> dict[str, dict[str, Any]]:
    """Preconditioner size caps scaled to the model, keeping the paper's regime: the vocabulary
    dimension is above the cap (diagonal/unpreconditioned/blocked) and every hidden dimension below it
    (the paper: 12288 with vocab 32000 and hidden widths up to 8192), for every optimizer that has a cap."""
    return {o: {"optim.max_precondition_dim": cap} for o, c in OPTIMIZERS.items()
            if hasattr(c, "max_precondition_dim")}


def smoke() -> StudySpec:
    """Every stage at toy scale (CI): two sizes, a 2-point grid with one extension and a refinement,
    two seeds, all PTQ schemes, QAT, fits and the report."""
    return StudySpec(
        name="smoke", sizes=("femto", "nano"), lr_points=2, lr_extensions=1, seeds=(0, 1), lr_from_smallest=True,
        tune_groups=True, per_optimizer=_caps(256), fit_interval="none",
        run={"model.vocab_size": 512, "model.seq_len": 32, "train.batch_size": 8, "train.steps": 30,
             "train.eval_every": 10, "train.eval_batches": 2, "train.precision": "fp32"},
    )


# fp32 everywhere (the model and Muon's/Scion's Newton–Schulz): `precision=auto` picks bf16 on CPUs with
# native bf16 and fp32 elsewhere, and the two gave different best LRs and verdicts; pinned, every x86 CPU
# runs the same arithmetic up to the BLAS's summation order.
_CPU_RUN = {"model.vocab_size": 1024, "train.batch_size": 16, "train.tokens_per_param": 20.0,
            "train.budget_params": "non_embedding", "train.eval_every": 25, "train.eval_batches": 8,
            "train.precision": "fp32"}


def _cpu_per_optimizer() -> dict[str, dict[str, Any]]:
    """The caps at 512, and Newton–Schulz in fp32 for every optimizer that has one."""
    caps, ns = _caps(512), {o: {"optim.ns_dtype": "fp32"} for o, c in OPTIMIZERS.items() if hasattr(c, "ns_dtype")}
    return {o: caps.get(o, {}) | ns.get(o, {}) for o in {**caps, **ns}}


def cpu() -> StudySpec:
    """The default: four sizes with depth (model.py: 2, 2, 3 and 4 blocks, widths 8–24), 1.6k to 27.9k
    non-embedding parameters (a 17× span, what the scaling fit needs; the embedding is 47 % of the largest),
    20 tokens per non-embedding parameter (Kaplan's N, which the fits count too; with a 1024 vocabulary the
    embedding would otherwise set the budget), three seeds for every best-LR, Common-Loss and QAT run. Every
    step size is searched: the LR at every size, and each group LR an optimizer declares (Muon's AdamW group,
    Scion's embedding and vectors) tied to it by a ratio that is searched at every size too (study/tuning.py);
    the sizes after the smallest start from its optimum. Precision is pinned to fp32 (above)."""
    return StudySpec(name="cpu", sizes=("zepto", "atto", "femto", "pico"), lr_extensions=4, lr_from_smallest=True,
                     tune_groups=True, per_optimizer=_cpu_per_optimizer(), run=_CPU_RUN)


def cpu_robust() -> StudySpec:
    """Issue 32's robust arm at the default design's two largest sizes: RECOMMENDED_ARM (quant/robust_config.py)
    against the plain runs, no QAT, 14 seeds. n from the report's Seeds table over the default study: with the
    sd of a paired difference taken as √2 × the plain runs' seed sd, 14 seeds per size (28 units) resolve a
    30 % cut after Holm over the 36 cells, with power 0.8, for four of the six optimizers (docs/configuration.md)."""
    return replace(cpu(), name="cpu-robust", sizes=("femto", "pico"), seeds=tuple(range(14)), qat_bits=(),
                   robust=RECOMMENDED_ARM)


def cpu_thorough() -> StudySpec:
    """The fuller CPU design: six sizes over a 62× span (1.6k…99k non-embedding), five seeds, a 4-point
    initial grid. About ten times the default's compute."""
    return StudySpec(name="cpu-thorough", sizes=("zepto", "atto", "femto", "pico", "nano", "micro"),
                     lr_points=4, lr_step=2.5, seeds=(0, 1, 2, 3, 4), lr_from_smallest=True, tune_groups=True,
                     per_optimizer=_cpu_per_optimizer(), run=_CPU_RUN)


def gpu() -> StudySpec:
    return StudySpec(name="gpu", sizes=("50m", "125m"), lr_points=5, lr_step=2.0,
                     run={"model.vocab_size": 32000, "train.batch_size": 256, "train.grad_accum": 4})


def paper() -> StudySpec:
    return StudySpec(name="paper", sizes=("50m", "125m", "350m", "500m", "760m", "1.5b"), lr_points=8,
                     lr_step=2.0, run={"model.vocab_size": 32000}, executor="slurm", workers=1)


STUDY_PRESETS = {"smoke": smoke, "cpu": cpu, "cpu-robust": cpu_robust, "cpu-thorough": cpu_thorough, "gpu": gpu,
                 "paper": paper}


def study_preset(name: str) -> StudySpec:
    if name not in STUDY_PRESETS:
        raise OptquantError(f"unknown study preset {name!r}; choose one of {', '.join(STUDY_PRESETS)}")
    return STUDY_PRESETS[name]()


def apply_study_overrides(spec: StudySpec, overrides: list) -> StudySpec:
    """`spec` with study settings (config.settings: --set strings, or a TOML file's typed pairs): `sizes=nano,micro`,
    `optimizers=adamw,muon`, `lrs.muon=0.01,0.02`, `run=train.steps=50` (adds a run setting; so does
    `run.train.steps=50`, a TOML `[run]` table, and any `data.*`, e.g. `data.source=DIR`),
    `sweeps.muon.optim.momentum=0.9,0.95`, `eval.tasks=piqa,arc_easy`."""
    for key, value in settings(overrides, "sizes=nano,micro"):
        if key == "run" or key.startswith(("run.", "data.")):  # `data.source=DIR` is `run=data.source=DIR`
            given = [(key.removeprefix("run."), value)] if key != "run" else settings(  # TOML: run = ["k=v", ...]
                value if isinstance(value, list) else [value])
            spec = replace(spec, run={**spec.run, **typed_overrides(given, (*spec.optimizers, "adamw")[0])})
        elif key.startswith("lrs."):
            spec = replace(spec, lrs={**spec.lrs, _known_optimizer(key[4:], key): typed(value, tuple[float, ...], key)})
        elif key.startswith("sweeps."):
            opt, _, param = key[7:].partition(".")
            swept = _sweep_values(_known_optimizer(opt, key), param, value)
            spec = replace(spec, sweeps={**spec.sweeps, opt: {**spec.sweeps.get(opt, {}), param: swept}})
        else:
            spec = set_field(spec, key.split("."), value, key)
    spec = replace(spec, eval=check_harness(spec.eval))
    for entry in spec.robust:
        robust_settings(entry)  # a bad entry fails here, before anything trains
    for opt in spec.optimizers:
        _known_optimizer(opt, "optimizers")
    return spec


def _known_optimizer(name: str, where: str) -> str:
    if not is_optimizer(name):
        raise OptquantError(f"{where}: unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return name


def robust_settings(entry: str) -> dict[str, Any]:
    """A robust-arm entry `method[:strength[:every]]` as a run's typed settings."""
    return typed_overrides(list(entry_overrides(entry)))


def _sweep_values(opt: str, param: str, values: Any) -> tuple[Any, ...]:
    """A sweep's values (--set's text split at commas, or a TOML list), each typed by its field in a run of `opt`."""
    if isinstance(values, SetText):
        values = [SetText(v) for v in values.split(",") if v.strip()]
    if not isinstance(values, list | tuple):
        raise OptquantError(f"sweeps.{opt}.{param}={values!r}: expected a list of values")
    try:
        return tuple(typed_overrides([(param, v)], opt)[param] for v in values)
    except OptquantError as e:
        raise OptquantError(f"sweeps.{opt}.{param}: {e}") from None


def spec_to_dict(spec: StudySpec) -> dict[str, Any]:
    """study.json's "spec": the StudySpec as JSON values (`spec_from_dict` reads it back)."""
    return msgspec.to_builtins(spec)


def spec_from_dict(d: dict) -> StudySpec:
    """The StudySpec of a study.json "spec" (keys this version lacks are dropped). A spec from before the typed
    settings (`run` a list of `field=value` strings) has its settings parsed as the CLI parses them."""
    if isinstance(d.get("run"), list):
        opt = (d.get("optimizers") or ["adamw"])[0]
        d = {**d, "run": typed_overrides(d["run"], opt),
             "per_optimizer": {o: typed_overrides(v, o) for o, v in (d.get("per_optimizer") or {}).items()},
             "sweeps": {o: {p: _sweep_values(o, p, [SetText(x) for x in v]) for p, v in ps.items()}
                        for o, ps in (d.get("sweeps") or {}).items()}}
    try:
        return msgspec.convert(d, StudySpec)
    except msgspec.ValidationError as e:
        raise OptquantError(f"study.json: not a study spec ({e})") from None

"""PTQ and analysis of a finished run: what `optquant ptq` and `optquant analyze` do.

`ptq_damage` quantizes a copy of a run's model (final or Common-Loss weights) and measures the damage
on the very tokens the run validated on: validation loss and the built-in multiple-choice accuracy,
FP and quantized (with `AnalysisConfig.harness` tasks, lm-eval's acc and acc_norm on them instead).
`analyze` measures the FP model's outliers (MMR, kurtosis, kurtRMS per layer) and the ABC error
propagation between the FP model and its quantized copy, per module.

Both evaluate in the model's dtype without autocast: fp32 for our runs, so the measured damage is the
quantizer's and not bf16's; a Hugging Face model in its stored one (optquant.hf, `--dtype` to choose).
GPTQ calibrates on sequences from the *train* split; outliers and ABC use the first validation
batches. Outputs go to `<run>/ptq/<weights>/<scheme>/` as JSON and parquet, written atomically.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import torch
from torch import nn

from optquant.checkpoint import load_weights
from optquant.config import RunConfig
from optquant.data import TokenData, fixed_batches, load_tokens
from optquant.errors import OptquantError
from optquant.evaluate import MCConfig, mc_eval, val_loss
from optquant.files import NUMBER, atomic_write_json, check_record, finite_json, read_json, write_parquet
from optquant.harness import HarnessConfig, lm_eval_tasks
from optquant.metrics.chain import shared_copy
from optquant.metrics.outliers import aggregate, outlier_metrics
from optquant.metrics.propagation import PropagationConfig, propagation, propagation_of
from optquant.model import lm_loss
from optquant.quant.ptq import SCHEMES, PTQConfig, quantize_, quantized_layers
from optquant.quant.rotate import rotate_model_
from optquant.runs import PTQ_FILES, RunDir, Weights, check_corpus, read_config
from optquant.train import build_model

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class AnalysisConfig:
    weights: Weights = "final"
    eval_batches: int = 0  # validation batches for the losses; 0 = the run's own train.eval_batches
    mc_items: int = 200  # items of the built-in multiple-choice task (0 = skip it)
    calib_batches: int = 2  # validation batches for outliers and ABC
    gptq_sequences: int = 64  # train-split sequences for GPTQ's Hessians
    granularity: Literal["sublayer", "linear"] = "linear"  # ABC rows: sublayers, or also each linear
    harness: HarnessConfig = HarnessConfig()  # lm-eval tasks to score FP and quantized on (none = skip)


def scheme_config(name: str) -> PTQConfig:
    """The PTQConfig of a named scheme ("w4a4-rtn", "w4a4-gptq-had", ...; see quant.ptq.SCHEMES)."""
    if name not in SCHEMES:
        raise OptquantError(f"unknown PTQ scheme {name!r}; choose from {', '.join(SCHEMES)}")
    return SCHEMES[name]


def load_run_model(run_dir: Path, weights: Weights = "final") -> tuple[RunConfig, nn.Module]:
    cfg = read_config(run_dir)
    path = RunDir(run_dir).weights(weights)
    if not path.exists():
        what = "no Common Loss checkpoint (train with train.cl_threshold)" if weights == "cl" else \
            "no final weights (the run is not done or diverged)"
        raise OptquantError(f"{run_dir}: {what}")
    return cfg, load_weights(path, build_model(cfg)).eval()


def run_tokens(run_dir: Path, cfg: RunConfig) -> TokenData:
    """The tokens and tokenizer a run trained on (its data.source), refused if that corpus was prepared again."""
    check_corpus(run_dir, cfg.data.source)
    return load_tokens(cfg.data, cfg.model.vocab_size)


class LoadedRun:
    """A run's config, model and tokens, loaded once and shared by the PTQ and analysis of one job,
    with the (FP reference, quantized copy) pair of each scheme built once (GPTQ included). The quantized
    copy shares every tensor but its quantized linears with the reference (`shared_copy`).

    `owned` (a model loaded for one command, `LoadedRun.of`): the damage quantizes the model itself once
    its FP numbers are taken, and the analysis makes the quantized sublayers one at a time
    (`propagation_of`), so the model is held once; it is not reusable afterwards."""

    def __init__(self, run_dir: Path, weights: Weights):
        cfg, model = load_run_model(run_dir, weights)
        self._set(cfg, model, run_tokens(run_dir, cfg))

    @classmethod
    def of(cls, cfg: RunConfig, model: nn.Module, data, owned: bool = False) -> LoadedRun:
        """A model loaded elsewhere (e.g. a Hugging Face one, optquant.hf) with its config and tokens."""
        run = cls.__new__(cls)
        run._set(cfg, model, data, owned)
        return run

    def _set(self, cfg: RunConfig, model: nn.Module, data, owned: bool = False) -> None:
        self.cfg, self.model, self.data, self.owned = cfg, model, data, owned
        self._pairs: dict[tuple, tuple[nn.Module, nn.Module]] = {}

    def calib(self, qcfg: PTQConfig, acfg: AnalysisConfig) -> torch.Tensor | None:
        """GPTQ's calibration sequences, from the train split; None for RTN."""
        if qcfg.method == "rtn":
            return None
        micro = self.cfg.train.batch_size // self.cfg.train.grad_accum
        batches = _batches(self.cfg, self.data.train, 1 + acfg.gptq_sequences // micro, 777)
        return torch.cat([x for x, _ in batches])[: acfg.gptq_sequences]

    def pair(self, qcfg: PTQConfig, acfg: AnalysisConfig) -> tuple[nn.Module, nn.Module]:
        key = (qcfg, acfg.gptq_sequences)
        if key not in self._pairs:
            fp = self.model if qcfg.rotation == "none" else rotate_model_(copy.deepcopy(self.model))
            q = quantize_(shared_copy(fp), dataclasses.replace(qcfg, rotation="none"), self.calib(qcfg, acfg))
            self._pairs[key] = fp, q
        return self._pairs[key]

    def models(self, qcfg: PTQConfig, acfg: AnalysisConfig) -> Iterator[tuple[str, nn.Module]]:
        """("fp", the FP reference), then ("q", its quantized copy); owned: the model itself, quantized in
        place between the two."""
        if not self.owned:
            yield from zip(("fp", "q"), self.pair(qcfg, acfg), strict=True)
            return
        quantized_layers(self.model, qcfg)  # a group size or plan the model cannot take: refused before the FP pass
        if qcfg.rotation != "none":
            rotate_model_(self.model)
        yield "fp", self.model
        yield "q", quantize_(self.model, dataclasses.replace(qcfg, rotation="none"), self.calib(qcfg, acfg))
        self.model = None  # quantized: no second use


def _batches(cfg: RunConfig, tokens, n: int, seed: int) -> list:
    micro = cfg.train.batch_size // cfg.train.grad_accum
    return fixed_batches(tokens, n, micro, cfg.model.seq_len, seed=seed)


def out_dir(run_dir: Path, acfg: AnalysisConfig, scheme: str) -> Path:
    return RunDir(run_dir).ptq(acfg.weights, scheme)


def ptq_damage(run_dir: Path, qcfg: PTQConfig, acfg: AnalysisConfig = AnalysisConfig(),
             run: LoadedRun | None = None) -> dict[str, Any]:
    """Val loss and MC accuracy of the FP model and its quantized copy; writes summary.json.
    `run`: the run already loaded (shared with `analyze` in one job)."""
    run = run or LoadedRun(run_dir, acfg.weights)
    from optquant.config import to_dict
    from optquant.tracking import open_tracker

    result = model_damage(run, qcfg, acfg, out_dir(run_dir, acfg, qcfg.name))
    tracker = open_tracker(run.cfg.log, run_dir, to_dict(run.cfg))  # the run's tracker, if `log.to` is set
    tracker.record(f"ptq/{acfg.weights}/{qcfg.name}", 0, result)
    tracker.close()
    return result


def model_damage(run: LoadedRun, qcfg: PTQConfig, acfg: AnalysisConfig, out_path: Path) -> dict[str, Any]:
    """ptq_damage on a loaded model (ours or optquant.hf's, see LoadedRun.of); writes out_path/summary.json."""
    cfg, data = run.cfg, run.data
    val = _batches(cfg, data.val, acfg.eval_batches or cfg.train.eval_batches, cfg.seed + 12345)
    out = {"scheme": qcfg.name, "weights": acfg.weights, "ptq": dataclasses.asdict(qcfg)}
    tasks: dict[str, dict] = {}
    h = acfg.harness
    mcfg = MCConfig(n_items=acfg.mc_items, seed=cfg.seed)  # the built-in task, its context within the model's window
    mcfg = dataclasses.replace(mcfg, context_len=min(mcfg.context_len, cfg.model.seq_len + 1 - mcfg.cont_len))
    for tag, m in run.models(qcfg, acfg):
        out[f"val_loss_{tag}"] = val_loss(m, val).loss
        if acfg.mc_items:
            mc = mc_eval(m, data, mcfg)
            out[f"mc_acc_{tag}"], out[f"mc_acc_norm_{tag}"] = mc.acc, mc.acc_norm
        if h.tasks:  # {task: {acc, acc_stderr, acc_norm, acc_norm_stderr, n}}, with the run's own tokenizer
            tasks[tag] = lm_eval_tasks(m, data.tokenizer, data.eot_id, list(h.tasks),
                                       include_path=h.include_path or None, limit=h.limit or None)
    out["delta_val_loss"] = out["val_loss_q"] - out["val_loss_fp"]
    if acfg.mc_items:
        out["delta_acc_norm"] = out["mc_acc_norm_q"] - out["mc_acc_norm_fp"]
    if h.tasks:
        out["harness"] = dataclasses.asdict(h)
        out["tasks"] = {t: {tag: tasks[tag][t] for tag in tasks} for t in h.tasks}
    atomic_write_json(out_path / PTQ_FILES["damage"], out)
    return out


def covers(summary: dict[str, Any] | None, acfg: AnalysisConfig) -> bool:
    """Whether a PTQ summary.json already holds what `acfg` asks for (the built-in task, the lm-eval tasks
    at the same item limit); a study redoes one that does not."""
    if summary is None or (acfg.mc_items and "mc_acc_fp" not in summary):
        return False
    h = acfg.harness
    done = summary.get("harness") or {}
    return not h.tasks or (set(h.tasks) <= set(summary.get("tasks") or {}) and done.get("limit") == h.limit)


def ptq_analysis(run_dir: Path, qcfg: PTQConfig, acfg: AnalysisConfig = AnalysisConfig(),
            run: LoadedRun | None = None) -> dict[str, Any]:
    """Outliers of the FP model and the ABC decomposition against its quantized copy.
    `run`: the run already loaded (shared with `ptq_damage` in one job)."""
    return model_analysis(run or LoadedRun(run_dir, acfg.weights), qcfg, acfg, out_dir(run_dir, acfg, qcfg.name))


def model_analysis(run: LoadedRun, qcfg: PTQConfig, acfg: AnalysisConfig, out: Path) -> dict[str, Any]:
    """ptq_analysis on a loaded model (ours or optquant.hf's, see LoadedRun.of); writes into `out`."""
    cfg, model, data = run.cfg, run.model, run.data
    calib = _batches(cfg, data.val, acfg.calib_batches, cfg.seed + 12345)
    skip = () if qcfg.quantize_head else ("lm_head",)
    layers = outlier_metrics(model, calib, skip=skip)
    pcfg = PropagationConfig(granularity=acfg.granularity, skip=skip)
    if (qcfg, acfg.gptq_sequences) in run._pairs:  # the pair the damage built (GPTQ once per job)
        rows, summary = propagation(*run.pair(qcfg, acfg), calib, pcfg)
    else:  # the model held once, its quantized sublayers made one at a time (rotated in place if owned)
        rows, summary = propagation_of(model, qcfg, calib, pcfg, run.calib(qcfg, acfg), in_place=run.owned)
    write_parquet(out / PTQ_FILES["outliers"], pd.DataFrame([dataclasses.asdict(r) for r in layers]))
    write_parquet(out / PTQ_FILES["propagation"], pd.DataFrame([dataclasses.asdict(r) for r in rows]))
    result = finite_json({"scheme": qcfg.name, "weights": acfg.weights, **aggregate(layers),
                          **{k: v for k, v in dataclasses.asdict(summary).items() if k != "norm"}})  # NaN as null
    atomic_write_json(out / PTQ_FILES["analysis"], result)
    return result


def fp_outliers(run_dir: Path, acfg: AnalysisConfig = AnalysisConfig()) -> dict[str, Any]:
    """Model-level outlier metrics of a run's FP model alone (for MMR vs learning rate)."""
    path = RunDir(run_dir).outliers(acfg.weights)
    if path.exists():
        return read_json(path)
    run = LoadedRun(run_dir, acfg.weights)
    calib = _batches(run.cfg, run.data.val, acfg.calib_batches, run.cfg.seed + 12345)
    result = finite_json(aggregate(outlier_metrics(run.model, calib)))
    atomic_write_json(path, result)
    return result


def read_result(run_dir: Path, acfg: AnalysisConfig, scheme: str, what: Literal["damage", "analysis"]) -> dict | None:
    """A PTQ job's damage (summary.json) or analysis, checked for the types ptq_damage/ptq_analysis write, or None."""
    path = RunDir(run_dir).ptq_file(acfg.weights, scheme, what)
    if not path.exists():
        return None
    record, redo = read_json(path), f"; delete {path.parent} to redo it"
    if not isinstance(record, dict):
        raise OptquantError(f"{path}: not an optquant PTQ result (a JSON object){redo}")
    numbers = [k for k in record if k.startswith(("val_loss_", "mc_acc", "delta_")) or what == "analysis"]
    check_record(path, record, {**dict.fromkeys(numbers, (*NUMBER, type(None))), "scheme": (str,),
                                "weights": (str,)}, redo, finite=False)
    return record


def model_bits(run: LoadedRun, qcfg: PTQConfig, acfg: AnalysisConfig, avg_bits: float, choices: tuple[int, ...],
               score: Literal["abc", "oracle", "hawq", "fisher"] = "abc") -> dict[str, Any]:
    """A bit plan of a loaded model (quant/bit_plan.py), its gains from `score_gains`."""
    from optquant.quant.bit_plan import budget_units, check_choices, plan_record, solve
    from optquant.quant.layers import linear_layers

    choices = check_choices(choices, qcfg.format)
    params = {n: lin.weight.numel() for n, lin in linear_layers(run.model, skip=() if qcfg.quantize_head else
                                                                ("lm_head",))}
    budget_units(params, avg_bits, choices)  # an impossible average fails before any work
    gains = score_gains(run, qcfg, acfg, params, choices, score)
    plan = solve(params, gains, avg_bits, choices)
    return plan_record(plan, params, gains, {k: v for k, v in dataclasses.asdict(qcfg).items() if k != "plan"},
                       avg_bits, choices, score)


def score_gains(run: LoadedRun, qcfg: PTQConfig, acfg: AnalysisConfig, params: dict[str, int],
                choices: tuple[int, ...], score: str) -> dict[str, dict[int, float]]:
    """Each linear's gain per choice: `abc`, one ABC walk with every linear at the lowest choice; `oracle`, one
    validation loss per (module, higher choice) plus one at the lowest; `hawq`, `fisher`: HAWQ-v2's trace ×
    ‖Q(W) − W‖² on the calibration batches (Hutchinson, 4 Hessian-vector products per batch; the empirical
    Fisher, one gradient per sequence)."""
    from optquant.quant.bit_plan import abc_gains, fisher_traces, hessian_traces, measured_gains, perturbation_gains
    from optquant.quant.layers import linear_layers, model_name

    cfg, model, data = run.cfg, run.model, run.data
    skip = () if qcfg.quantize_head else ("lm_head",)
    low = dataclasses.replace(qcfg, plan=tuple((n, choices[0]) for n in params))
    calib = _batches(cfg, data.val, acfg.calib_batches, cfg.seed + 12345)
    if score == "abc":
        pcfg = PropagationConfig(granularity="linear", skip=skip)
        rows, _ = propagation_of(model, low, calib, pcfg, run.calib(low, acfg))
        return abc_gains(rows, params, choices)
    if score not in ("oracle", "hawq", "fisher"):
        raise OptquantError(f"bits: --score must be abc, oracle, hawq or fisher, got {score!r}")
    fp = model if qcfg.rotation == "none" else rotate_model_(copy.deepcopy(model))
    if score == "oracle":
        val = _batches(cfg, data.val, acfg.eval_batches or cfg.train.eval_batches, cfg.seed + 12345)
        return measured_gains(params, choices, lambda bits: val_loss(quantize_(shared_copy(fp), dataclasses.replace(
            qcfg, rotation="none", plan=tuple(bits.items())), run.calib(qcfg, acfg)), val).loss)  # fp: rotated already
    lins = {model_name(n): lin for n, lin in linear_layers(fp, skip=skip)}  # a rotated o_proj is o_proj
    weights = {n: lins[model_name(n)].weight for n in params}
    was = {n: w.requires_grad for n, w in weights.items()}
    for w in weights.values():
        w.requires_grad_(True)
    try:
        if score == "hawq":
            traces = hessian_traces(lambda b: lm_loss(fp, *b), calib, weights, seed=cfg.seed)
        else:  # one sample = one sequence
            traces = fisher_traces(lambda b: lm_loss(fp, *b), [(x[i : i + 1], y[i : i + 1]) for x, y in calib
                                                               for i in range(len(x))], weights)
    finally:
        for n, w in weights.items():
            w.requires_grad_(was[n])
    return perturbation_gains(traces, weights, lambda b: dataclasses.replace(qcfg, w_bits=b, plan=()).weight_spec,
                              choices)

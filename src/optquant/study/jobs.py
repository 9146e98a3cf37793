"""The study's three kinds of job, each a frozen dataclass that owns what it needs to know about itself.

A job is idempotent: its outputs are files written atomically, so `done()` answers from them and a killed
study is resumed by submitting the same jobs again. The executor (study/executor.py) only calls the four
methods of `Job` and reads its two attributes; `stage` is the class of job the ETA prices (study/eta.py).

A run directory is locked (runs.locked: fcntl, released when the process dies) while a job works in it,
as `optquant train/ptq/analyze` lock it, so no two processes ever write the same run at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from optquant.config import RunConfig
from optquant.ptq_stage import (
    AnalysisConfig,
    LoadedRun,
    covers,
    fp_outliers,
    out_dir,
    ptq_analysis,
    ptq_damage,
    read_result,
)
from optquant.quant.ptq import PTQConfig
from optquant.runs import RunDir, check_corpus, locked, read_config, read_summary
from optquant.train import train

log = logging.getLogger(__name__)
Result = dict[str, Any]


class Job(Protocol):
    @property
    def key(self) -> str: ...  # unique within a study: the run id, or run id/weights/scheme

    @property
    def stage(self) -> str: ...  # fp, cl, qat, robust, ptq or outliers

    def done(self) -> Result | None: ...  # the result, from the job's files if they cover what it asks; else None

    def cost(self) -> float: ...  # a FLOPs-like estimate, for scheduling the longest first (0 = unknown: last)

    def run(self) -> tuple[Result, dict[str, float]]: ...  # (result, seconds by part; {} = one part) in this process

    def describe(self) -> dict[str, Any]: ...  # what costs.jsonl records: kind, stage, optimizer, size, part


def _config_of(path: Path, key: str) -> RunConfig | None:
    """A run's config for a PTQ or outlier job's cost and record (None if the run cannot be read yet)."""
    try:
        return read_config(path)
    except Exception:  # a job we cannot cost or describe is still run
        log.debug("no config for %s", key, exc_info=True)
        return None


@dataclass(frozen=True)
class TrainJob:
    """Train one run (FP, Common-Loss re-run or QAT) in `dir`, resuming from its checkpoint."""

    cfg: RunConfig
    dir: Path
    kind: str | None = None  # the stage's kind where the config alone cannot tell (the robust arm's model options)

    @property
    def key(self) -> str:
        return Path(self.dir).name

    @property
    def stage(self) -> str:
        cfg = self.cfg  # a robust run has the CL threshold set but trains its full budget
        return self.kind or ("qat" if cfg.qat is not None else "robust" if cfg.robust.method != "none"
                             else "cl" if cfg.train.cl_threshold is not None else "fp")

    def done(self) -> Result | None:
        summary = read_summary(self.dir)
        if summary is not None:  # a study continued on a corpus prepared again must not reuse this run
            check_corpus(self.dir, self.cfg.data.source)
        return summary

    def cost(self) -> float:
        """Training FLOPs: 6·N·D + attention (cost.training_flops), N every parameter, D the tokens of the run's
        budget as the dry run counts them (cost.run_cost)."""
        from optquant.cost import run_cost, training_flops

        b = run_cost(self.cfg)
        return training_flops(self.cfg, b.n_params, b.tokens)

    def run(self) -> tuple[Result, dict[str, float]]:
        with locked(Path(self.dir)):
            return train(self.cfg, Path(self.dir)), {}

    def describe(self) -> dict[str, Any]:
        return {"kind": "train", "stage": self.stage, "optimizer": self.cfg.optim.name, "size": self.cfg.preset or None,
                "part": "qat" if self.stage == "qat" else "training"}


@dataclass(frozen=True)
class _ForwardJob:
    """What a PTQ and an outliers job share: a trained run's `dir`, costed in forward passes and described by
    its run's config. `stage` is also the kind; `part` is what costs.jsonl names its time."""

    dir: Path
    stage = part = ""

    def cost(self) -> float:
        """Forward passes over the eval batches (cost.eval_flops); 0 while the run's config cannot be read."""
        from optquant.cost import EVAL_FORWARDS, at_depth, eval_flops, meta_models
        from optquant.model import count_params

        cfg = _config_of(self.dir, self.key)
        return 0.0 if cfg is None else eval_flops(cfg, at_depth(cfg, meta_models(cfg), count_params),
                                                   EVAL_FORWARDS[self.stage])

    def describe(self) -> dict[str, Any]:
        cfg = _config_of(Path(self.dir), self.key)
        return {"kind": self.stage, "stage": self.stage, "optimizer": cfg.optim.name if cfg else None,
                "size": (cfg.preset or None) if cfg else None, "part": self.part}


@dataclass(frozen=True)
class PTQJob(_ForwardJob):
    """PTQ damage + outliers + ABC of one (model, scheme). The model, its tokens and the quantized copy
    are loaded and built once for both parts; what an earlier attempt wrote is reused if it covers the
    evaluations asked for (`analysis.mc_items`, the lm-eval tasks of `analysis.harness`)."""

    ptq: PTQConfig
    analysis: AnalysisConfig
    stage = part = "ptq"

    @property
    def key(self) -> str:
        return f"{Path(self.dir).name}/{self.analysis.weights}/{self.ptq.name}"

    def done(self) -> Result | None:
        a, name = self.analysis, self.ptq.name
        damage, metrics = read_result(self.dir, a, name, "damage"), read_result(self.dir, a, name, "analysis")
        return {**damage, **metrics} if covers(damage, self.analysis) and metrics is not None else None  # else redo

    def run(self) -> tuple[Result, dict[str, float]]:
        path, qcfg, acfg = Path(self.dir), self.ptq, self.analysis
        loaded: LoadedRun | None = None
        parts = {}
        with locked(out_dir(path, acfg, qcfg.name)):
            t = time.perf_counter()
            damage = read_result(path, acfg, qcfg.name, "damage")
            if not covers(damage, acfg):
                loaded = LoadedRun(path, acfg.weights)
                damage = ptq_damage(path, qcfg, acfg, loaded)
            parts["ptq"] = time.perf_counter() - t
            t = time.perf_counter()
            metrics = read_result(path, acfg, qcfg.name, "analysis")
            if metrics is None:
                metrics = ptq_analysis(path, qcfg, acfg, loaded or LoadedRun(path, acfg.weights))
            parts["analysis"] = time.perf_counter() - t
        return {**damage, **metrics}, parts


@dataclass(frozen=True)
class OutliersJob(_ForwardJob):
    """The FP model's outlier metrics alone (MMR vs learning rate), for a study without sweep schemes."""

    stage, part = "outliers", "analysis"

    @property
    def key(self) -> str:
        return f"{Path(self.dir).name}/outliers"

    def done(self) -> Result | None:
        from optquant.files import read_json

        path = RunDir(self.dir).outliers("final")
        return read_json(path) if path.exists() else None

    def run(self) -> tuple[Result, dict[str, float]]:
        with locked(RunDir(self.dir).ptq()):
            return fp_outliers(Path(self.dir)), {}

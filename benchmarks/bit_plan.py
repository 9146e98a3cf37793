"""Benchmark: per-module bit plans at +0.25 / +0.5 / +1 average bits over W4, on the finished runs of a study.

For every run with final weights under STUDY/runs, at the PTQ scheme (default the paper's W4A4 RTN) with choices
4,8: the damage (Δ val loss on the run's own validation batches) of uniform W4 and of the plans of
- `abc`: the decomposition's score (quant/bit_plan.py, one ABC walk at 4 bits);
- `sqnr`: the weight-quantization error power ‖Ŵ − W‖²/‖W‖² at 4 bits (HAWQ-free, data-free);
- `mmr`, `kurtosis`: the outlier metrics of the module's input activations (metrics/outliers.py);
- `oracle`: greedy by measured damage (quantize all at 4, put one module at 8, measure; 1 + M val losses).
Each cheap score is a module's gain as it stands (the knapsack maximizes its sum under the budget). Reported: each
method's Δ val loss as mean ± sd [95 % t-interval] over the runs, its pooled cut 1 − ΣΔ_plan/ΣΔ_W4 (a per-run
ratio is meaningless where a small run's Δ_W4 is near 0 or negative), and a paired sign-flip test against `abc`.
Cost: `abc` is one walk (four evaluations per chain module on the calibration batches, as two stacked
calls); `oracle` is (1 + M) quantized validation passes.

Run: python benchmarks/bit_plan.py STUDY [--scheme w4a4-rtn] [--extra 0.25 0.5 1] [--runs N] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

import pandas as pd
import torch

from optquant.evaluate import val_loss
from optquant.metrics.outliers import outlier_metrics
from optquant.metrics.propagation import PropagationConfig, propagation_of
from optquant.ptq_stage import AnalysisConfig, LoadedRun, _batches, scheme_config
from optquant.quant.bit_plan import abc_gains, measured_gains, solve
from optquant.quant.layers import linear_layers
from optquant.quant.primitives import fake_quant
from optquant.quant.ptq import quantize_
from optquant.runs import RunDir
from optquant.stats import paired_test, summarize

CHOICES = (4, 8)
METHODS = ("abc", "sqnr", "mmr", "kurtosis", "oracle")


def cheap_gains(run: LoadedRun, qcfg, acfg: AnalysisConfig) -> dict[str, dict[str, dict[int, float]]]:
    layers = dict(linear_layers(run.model))
    spec = qcfg.for_module("").weight_spec
    sqnr = {n: ((fake_quant(m.weight.detach(), spec) - m.weight).square().sum() / m.weight.square().sum()).item()
            for n, m in layers.items()}
    calib = _batches(run.cfg, run.data.val, acfg.calib_batches, run.cfg.seed + 12345)
    rows = {r.name: r for r in outlier_metrics(run.model, calib) if r.kind == "linear"}
    out = {"sqnr": sqnr, "mmr": {n: rows[n].mmr for n in layers}, "kurtosis": {n: rows[n].kurtosis for n in layers}}
    return {k: {n: {4: 0.0, 8: v} for n, v in s.items()} for k, s in out.items()}


def full_gains(run: LoadedRun, qcfg, acfg: AnalysisConfig, method: str, params: dict[str, int], val) -> dict:
    """Every module's gain at 8 bits under `abc` (one ABC walk at 4 bits) or `oracle` (1 + M val losses)."""
    low = dataclasses.replace(qcfg, plan=tuple((n, 4) for n in params))
    if method == "abc":
        calib = _batches(run.cfg, run.data.val, acfg.calib_batches, run.cfg.seed + 12345)
        rows, _ = propagation_of(run.model, low, calib, PropagationConfig(granularity="linear"), run.calib(low, acfg))
        return abc_gains(rows, params, CHOICES)
    return measured_gains(params, CHOICES, lambda bits: damage_of(run, qcfg, acfg, bits, val))


def damage_of(run: LoadedRun, qcfg, acfg: AnalysisConfig, bits: dict[str, int], val) -> float:
    cfg = dataclasses.replace(qcfg, plan=tuple(bits.items()))
    return val_loss(quantize_(copy.deepcopy(run.model), cfg, run.calib(qcfg, acfg)), val).loss


def one_run(path: Path, scheme: str, extras: list[float]) -> list[dict]:
    acfg, qcfg = AnalysisConfig(), scheme_config(scheme)
    run = LoadedRun(path, "final")
    params = {n: m.weight.numel() for n, m in linear_layers(run.model)}
    val = _batches(run.cfg, run.data.val, run.cfg.train.eval_batches, run.cfg.seed + 12345)
    fp = val_loss(run.model, val).loss
    gains = cheap_gains(run, qcfg, acfg) | {m: full_gains(run, qcfg, acfg, m, params, val) for m in ("abc", "oracle")}
    uniform = damage_of(run, qcfg, acfg, {n: 4 for n in params}, val) - fp
    rows = []
    for extra in extras:
        row = {"run": path.name, "extra": extra, "uniform": uniform, "modules": len(params)}
        for method in METHODS:
            row[method] = damage_of(run, qcfg, acfg, solve(params, gains[method], 4 + extra, CHOICES), val) - fp
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--scheme", default="w4a4-rtn")
    ap.add_argument("--extra", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--runs", type=int, default=0, help="at most this many runs, evenly spaced by name (0 = all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = sorted(p for p in (args.study / "runs").iterdir() if RunDir(p).weights("final").exists())
    if args.runs and len(runs) > args.runs:
        step = (len(runs) - 1) / max(args.runs - 1, 1)
        runs = [runs[round(i * step)] for i in range(args.runs)]
    rows = [r for p in runs for r in one_run(p, args.scheme, args.extra)]
    df = pd.DataFrame(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"{len(runs)} runs, scheme {args.scheme}, choices {CHOICES}. Δloss of each plan (mean ± sd [95% CI]); "
          "p: paired sign-flip test against abc's Δloss; cut: 1 − ΣΔ_plan/ΣΔ_W4 over the runs")
    print(f"| +bits | uniform W4 | {' | '.join(METHODS)} |")
    print("|---|---|" + "---|" * len(METHODS))
    for extra, g in df.groupby("extra"):
        runs_ = g["run"]
        cells = []
        for m in METHODS:
            p = paired_test(g[m].set_axis(runs_), g["abc"].set_axis(runs_)).p
            cut = 1 - g[m].sum() / g["uniform"].sum()
            test = "" if m == "abc" else f", p {p:.3f}"
            cells.append(summarize(g[m].to_numpy()).text(4) + f", cut {cut:+.2f}{test}")
        print(f"| +{extra} | {summarize(g['uniform'].to_numpy()).text(4)} | {' | '.join(cells)} |")
    m = int(df["modules"].iloc[0])
    print(f"cost per run: abc one ABC walk; oracle {1 + m} quantized validation passes (M = {m} modules)")


if __name__ == "__main__":
    main()

"""Benchmark: per-module bit plans at +0.25 / +0.5 / +1 average bits over W4, on a study's Common-Loss models.

The models: every Common-Loss model of the study (results.parquet rows of kind "cl": every optimizer and seed whose
best-LR run reached its size's Common Loss) at the sizes asked (default femto and pico), its CL weights. At the
PTQ scheme (default the paper's W4A4 RTN) with choices 4,8, the damage (Δ val loss) of uniform W4 and of the
plans of
- `abc`: the decomposition's score (quant/bit_plan.py, one ABC walk at 4 bits);
- `sqnr`: the weight-quantization error power ‖Ŵ − W‖²/‖W‖² at 4 bits (data-free);
- `mmr`, `kurtosis`: the outlier metrics of the module's input activations (metrics/outliers.py);
- `hawq`: HAWQ-v2's tr(H_m)/n_m · ‖Q(W) − W‖², the trace by Hutchinson (4 Rademacher samples per calibration
  batch); `fisher`: the same with the empirical Fisher's trace (mean ‖∇_m ℓ‖² over the calibration sequences);
- `oracle`: by measured damage (quantize all at 4, put one module at 8, measure; 1 + M val losses on the run's own
  validation batches, as `optquant ptq` measures), each module's measured gain then planned by the same exact
  knapsack as the scores, not greedily (the issue's "greedy" picks by the same gains, less well under a budget).
Each cheap score is a module's gain as it stands (the knapsack maximizes its sum under the budget). Every plan's
damage is measured on *other* validation windows than the oracle's and the calibration's (seed + 54321 instead of
the study's seed + 12345, as many batches), so the oracle is not scored on the batches it was fitted to.

Reported per +bits and size (and both sizes pooled): each method's pooled cut 1 − ΣΔ_plan/ΣΔ_W4 over the models
with a 95 % percentile-bootstrap interval over models (a per-model ratio is meaningless where a model's Δ_W4 is
near 0); at the largest size, paired sign-flip tests of each method's Δ against abc's over the models, Holm over
the five cheap scores (sqnr, mmr, kurtosis, hawq, fisher; the oracle's p is its own). Cost: each method's
measured matmul FLOPs (torch.utils.flop_counter, backward passes included) over those of one FP forward of one
validation batch, "forward-pass equivalents", on the first model of each size (the count depends on shapes only);
and each score's CPU seconds on every model, which also count what FLOPs miss (the ABC gains' eigenproblems).

Rows are appended to --rows (JSON lines) model by model; a rerun skips the models already there.

Run: python benchmarks/bit_plan.py STUDY [--sizes femto pico] [--scheme w4a4-rtn] [--extra 0.25 0.5 1]
     [--models N] [--rows rows.jsonl [--print-only]]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.utils.flop_counter import FlopCounterMode

from optquant.errors import OptquantError
from optquant.evaluate import val_loss
from optquant.files import read_parquet
from optquant.metrics.outliers import outlier_metrics
from optquant.ptq_stage import AnalysisConfig, LoadedRun, _batches, scheme_config, score_gains
from optquant.quant.bit_plan import solve
from optquant.quant.layers import linear_layers
from optquant.quant.primitives import fake_quant
from optquant.quant.ptq import quantize_
from optquant.runs import RunDir, read_config
from optquant.stats import holm, paired_test, percentile_ci

CHOICES = (4, 8)
METHODS = ("abc", "sqnr", "mmr", "kurtosis", "hawq", "fisher", "oracle")
CHEAP = ("sqnr", "mmr", "kurtosis", "hawq", "fisher")  # the family Holm adjusts over
SCORED = ("abc", "hawq", "fisher", "oracle")  # through ptq_stage.score_gains, as `optquant bits --score`
HELDOUT = 54321  # the plans' damage: validation windows of seed + HELDOUT (the study's are seed + 12345)


def cl_models(study: Path, sizes: list[str]) -> pd.DataFrame:
    """(run_id, size, optimizer, seed) of the study's Common-Loss models at `sizes`: results.parquet's kind "cl"
    rows, or, before the study has written it, the runs the Common-Loss stage trains (train.stop_at_cl, done, with
    CL weights). Ordered by seed, optimizer, size, so that a partial run covers every optimizer first."""
    path = study / "results.parquet"
    if path.is_file():
        df = read_parquet(path)
        cl = df[(df["kind"] == "cl") & df["size"].isin(sizes)][["run_id", "size", "optimizer", "seed"]]
    else:
        rows = []
        for run in sorted((study / "runs").iterdir()) if (study / "runs").is_dir() else ():
            rd = RunDir(run)
            if rd.summary.exists() and rd.weights("cl").exists():
                cfg = read_config(run)
                if cfg.train.stop_at_cl and cfg.preset in sizes:
                    rows.append({"run_id": run.name, "size": cfg.preset, "optimizer": cfg.optim.name, "seed": cfg.seed})
        cl = pd.DataFrame(rows, columns=["run_id", "size", "optimizer", "seed"])
    cl = cl.drop_duplicates("run_id").sort_values(["seed", "optimizer", "size"], ignore_index=True)
    if cl.empty:
        raise OptquantError(f"{study}: no Common-Loss models at sizes {', '.join(sizes)}")
    return cl


def cheap_gains(run: LoadedRun, qcfg, acfg: AnalysisConfig, params, which=("sqnr", "mmr", "kurtosis")):
    """{score: gains} of the cheap per-module scores in `which` (the outlier pass only where MMR/kurtosis ask)."""
    layers = dict(linear_layers(run.model))
    spec = qcfg.for_module("").weight_spec
    out = {}
    if "sqnr" in which:
        out["sqnr"] = {n: ((fake_quant(layers[n].weight.detach(), spec) - layers[n].weight).square().sum()
                           / layers[n].weight.square().sum()).item() for n in params}
    if {"mmr", "kurtosis"} & set(which):
        calib = _batches(run.cfg, run.data.val, acfg.calib_batches, run.cfg.seed + 12345)
        rows = {r.name: r for r in outlier_metrics(run.model, calib) if r.kind == "linear"}
        out |= {k: {n: getattr(rows[n], k) for n in params} for k in ("mmr", "kurtosis")}
    return {k: {n: {4: 0.0, 8: v} for n, v in s.items()} for k, s in out.items() if k in which}


def damage_of(run: LoadedRun, qcfg, acfg: AnalysisConfig, bits: dict[str, int], val) -> float:
    cfg = dataclasses.replace(qcfg, plan=tuple(bits.items()))
    return val_loss(quantize_(copy.deepcopy(run.model), cfg, run.calib(qcfg, acfg)), val).loss


def gains_of(run: LoadedRun, qcfg, acfg, params, method: str):
    if method in SCORED:
        return score_gains(run, qcfg, acfg, params, CHOICES, method)
    return cheap_gains(run, qcfg, acfg, params, (method,))[method]


def measured(fn, count: bool) -> tuple[object, int, float]:
    """fn(), with `count` the matmul FLOPs it ran (backward passes included; else 0), and its CPU seconds (one
    thread: the work outside torch's matmuls too, e.g. the gains' eigenproblems in scipy, which FLOPs miss)."""
    start = time.process_time()
    if not count:
        return fn(), 0, time.process_time() - start
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops(), time.process_time() - start


def one_model(model: dict, study: Path, scheme: str, extras: list[float], with_cost: bool) -> list[dict]:
    acfg, qcfg = AnalysisConfig(weights="cl"), scheme_config(scheme)
    run = LoadedRun(study / "runs" / model["run_id"], "cl")
    params = {n: m.weight.numel() for n, m in linear_layers(run.model)}
    n_val = acfg.eval_batches or run.cfg.train.eval_batches
    val = _batches(run.cfg, run.data.val, n_val, run.cfg.seed + HELDOUT)
    fp = val_loss(run.model, val).loss
    gains, cost, cpu = {}, {}, {}
    one = measured(lambda: val_loss(run.model, val[:1]), with_cost)[1]  # one FP forward of one batch
    for m in METHODS:
        gains[m], flops, cpu[m] = measured(lambda m=m: gains_of(run, qcfg, acfg, params, m), with_cost)
        if with_cost:
            cost[m] = flops / one
    cache: dict[tuple, float] = {}  # methods that choose the same plan share its evaluation

    def damage(bits: dict[str, int]) -> float:
        key = tuple(sorted(bits.items()))
        if key not in cache:
            cache[key] = damage_of(run, qcfg, acfg, bits, val) - fp
        return cache[key]

    uniform = damage({n: 4 for n in params})
    rows = []
    for extra in extras:
        row = {**model, "extra": extra, "uniform": uniform, "modules": len(params), "val_batches": n_val,
               **{f"cost_{m}": c for m, c in cost.items()}, **{f"cpu_{m}": c for m, c in cpu.items()}}
        for method in METHODS:
            row[method] = damage(solve(params, gains[method], 4 + extra, CHOICES))
        rows.append(row)
    return rows


def pooled_cut(g: pd.DataFrame, m: str, n_boot: int = 4000) -> tuple[float, float, float]:
    """1 − ΣΔ_m/ΣΔ_W4 over the models of `g`, and its percentile-bootstrap 95 % interval over models."""
    d, u = g[m].to_numpy(float), g["uniform"].to_numpy(float)
    idx = np.random.default_rng(0).integers(0, len(d), size=(n_boot, len(d)))
    boot = 1 - d[idx].sum(axis=1) / u[idx].sum(axis=1)
    lo, hi = percentile_ci(boot, n_boot, 0.95) if len(d) > 1 else (np.nan, np.nan)
    return 1 - d.sum() / u.sum(), lo, hi


def tables(df: pd.DataFrame, sizes: list[str]) -> list[str]:
    out = [f"| +bits | size | models | uniform W4 Δloss | {' | '.join(METHODS)} |",
           "|---|---|---|---|" + "---|" * len(METHODS)]
    top = [s for s in sizes if s in set(df["size"])][-1]
    tests: dict[float, dict[str, tuple[float, float]]] = {}
    for extra, g in df.groupby("extra"):
        p = g[g["size"] == top].set_index("run_id")
        raw = {m: paired_test(p[m], p["abc"]) for m in METHODS if m != "abc"}
        adj = dict(zip(CHEAP, holm([raw[m].p for m in CHEAP]), strict=True)) | {"oracle": raw["oracle"].p}
        tests[extra] = {m: (raw[m].mean_diff, adj[m]) for m in raw}
        for size in [*[s for s in sizes if s in set(g["size"])], "all"]:
            h = g if size == "all" else g[g["size"] == size]
            cells = []
            for m in METHODS:
                cut, lo, hi = pooled_cut(h, m)
                cell = f"{cut:+.2f} [{lo:+.2f}, {hi:+.2f}]"
                if size == top and m != "abc":
                    diff, padj = tests[extra][m]
                    cell += f" ({'p_Holm' if m in CHEAP else 'p'} {padj:.3f}, {'worse' if diff > 0 else 'better'})"
                cells.append(cell)
            out.append(f"| +{extra:g} | {size} | {len(h)} | {h['uniform'].mean():.4f} | {' | '.join(cells)} |")
    return out


def goal(df: pd.DataFrame, sizes: list[str]) -> list[str]:
    """The issue's three goals at +0.5 bits, each measured."""
    g = df[df["extra"] == 0.5]
    if g.empty:
        return []
    top = [s for s in sizes if s in set(g["size"])][-1]
    abc, oracle = pooled_cut(g, "abc")[0], pooled_cut(g, "oracle")[0]
    p = g[g["size"] == top].set_index("run_id")
    raw = [paired_test(p[m], p["abc"]) for m in CHEAP]
    adj = holm([t.p for t in raw])
    beats = [m for m, t, a in zip(CHEAP, raw, adj, strict=True) if t.mean_diff > 0 and a < 0.05]
    cost = [c for c in ("cost_abc", "cost_oracle") if c in g]
    ratio = (g["cost_abc"] / g["cost_oracle"]).dropna().max() if len(cost) == 2 else float("nan")
    best = max(CHEAP, key=lambda m: pooled_cut(g, m)[0])
    return [f"goal at +0.5 bits, all models: abc cut {abc:+.2f} (goal ≥ +0.50: {'met' if abc >= 0.5 else 'missed'});"
            f" oracle {oracle:+.2f}, abc/oracle {abc / oracle:.2f} (goal ≥ 0.90: "
            f"{'met' if abc >= 0.9 * oracle else 'missed'}); abc cost / oracle cost {ratio:.3f} (goal ≤ 0.10: "
            f"{'met' if ratio <= 0.1 else 'missed'}); abc beats at {top} (p_Holm < 0.05): "
            f"{', '.join(beats) or 'none'} of {', '.join(CHEAP)}; best cheap score by cut: {best} "
            f"{pooled_cut(g, best)[0]:+.2f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--sizes", nargs="+", default=["femto", "pico"])
    ap.add_argument("--scheme", default="w4a4-rtn")
    ap.add_argument("--extra", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--rows", type=Path, help="per-model rows, JSON lines, appended as each model finishes")
    ap.add_argument("--reverse", action="store_true", help="measure the models in reverse order (a second process)")
    ap.add_argument("--print-only", action="store_true", help="tabulate the models already in --rows, compute none")
    ap.add_argument("--models", type=int, default=0, help="at most this many models per size, evenly spaced (0 = all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        models = cl_models(args.study, args.sizes)
    except OptquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.models:
        models = pd.concat(  # not groupby.apply: pandas 3 drops the grouping column there
            g.iloc[np.unique(np.linspace(0, len(g) - 1, min(args.models, len(g))).round().astype(int))]
            for _, g in models.groupby("size")).sort_values(["seed", "optimizer", "size"], ignore_index=True)
    done = [json.loads(ln) for ln in args.rows.read_text().splitlines()] if args.rows and args.rows.exists() else []
    rows, seen = list(done), {r["run_id"] for r in done}
    costed = {r["size"] for r in done if "cost_abc" in r}
    for model in models.to_dict("records")[:: -1 if args.reverse else 1]:
        if model["run_id"] in seen or args.print_only:
            continue
        new = one_model(model, args.study, args.scheme, args.extra, model["size"] not in costed)
        costed.add(model["size"])
        rows += new
        if args.rows:
            with args.rows.open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in new))
        print(f"done {model['run_id']} ({model['size']}, {model['optimizer']}, seed {model['seed']})", file=sys.stderr)
    df = pd.DataFrame(rows)
    df = df[df["run_id"].isin(models["run_id"])].drop_duplicates(["run_id", "extra"])  # two processes may overlap
    print(f"{df['run_id'].nunique()} Common-Loss models, scheme {args.scheme}, choices {CHOICES}. Cell: pooled cut "
          "1 − ΣΔ_plan/ΣΔ_W4 [95 % bootstrap over models]; at the largest size the paired sign-flip test of Δ_plan "
          "against abc's (Holm over the cheap scores), 'worse'/'better' the method's mean Δ against abc's")
    print("\n".join(tables(df, args.sizes)))
    for size, g in df.groupby("size"):
        c = g.dropna(subset=["cost_abc"]).iloc[0] if "cost_abc" in g and g["cost_abc"].notna().any() else None
        if c is not None:
            print(f"cost at {size} ({int(c['modules'])} modules, {int(c['val_batches'])} validation batches), "
                  "forward-pass equivalents: " + ", ".join(f"{m} {c[f'cost_{m}']:.1f}" for m in METHODS))
        if "cpu_abc" in g and g["cpu_abc"].notna().any():
            n = g.dropna(subset=["cpu_abc"])["run_id"].nunique()
            print(f"CPU seconds of the scores at {size}, median over {n} models (one thread; load inflates them): "
                  + ", ".join(f"{m} {g[f'cpu_{m}'].median():.2f}" for m in METHODS))
    print("\n".join(goal(df, args.sizes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

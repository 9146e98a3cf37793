"""Check: is every step size of a finished study tuned? Moves each one ×3 and ÷3 around the study's choice.

For each optimizer, at the study's smallest and largest size (or `--sizes`): the best-LR run of the first
seed, then one run per step size and direction, same seed, everything else equal:
- `lr` moves the main LR alone (each tied group's ratio is divided by the same factor, so the other groups
  keep their step size);
- a tied group's ratio (Muon's `adam_lr_ratio`, Scion's `embed_lr_ratio`, `vector_lr_ratio`) moves that
  group alone.
The study's choice holds if no move improves the final validation loss by more than the seeds' noise: 2 × the
standard deviation over seeds of the chosen point's final loss (the sd of one seed's loss; a difference of
two single-seed losses has sd √2·σ, so 2σ is about a one-sided 92 % band). Prints one table row per move.

Run: python benchmarks/tuning_check.py STUDY_DIR [--sizes zepto pico] [--workers 2]
Runs go to STUDY_DIR/tuning-check/runs (kept; a rerun reads them back).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import pandas as pd

from optquant.runs import read_config, run_dir
from optquant.study.executor import execute
from optquant.study.jobs import TrainJob

FACTORS = (3.0, 1 / 3)


def moves(cfg) -> dict[str, object]:
    """(step size, factor) label -> the moved config, for every step size of cfg's optimizer."""
    optim = cfg.optim
    ratios = [r for _, r in getattr(type(optim), "GROUP_LRS", {}).values() if getattr(optim, r) > 0]
    out = {}
    for f in FACTORS:
        tag = "×3" if f > 1 else "÷3"
        out[f"lr {tag}"] = replace(cfg, optim=replace(optim, lr=optim.lr * f, **{r: getattr(optim, r) / f
                                                                                    for r in ratios}))
        for r in ratios:
            out[f"{r} {tag}"] = replace(cfg, optim=replace(optim, **{r: getattr(optim, r) * f}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--sizes", nargs="+")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    root = args.study
    sizes = args.sizes or [json.loads((root / "study.json").read_text())["spec"]["sizes"][i] for i in (0, -1)]
    df = pd.read_parquet(root / "results.parquet")
    best = df[(df.kind == "fp") & df.best_lr & (df.metric == "final_val_loss") & (df.scheme == "none")]
    seed0 = int(best.seed.min())
    runs = root / "tuning-check" / "runs"
    plan, jobs = [], {}
    for (size, opt), g in best[best["size"].isin(sizes)].groupby(["size", "optimizer"]):
        chosen = g[g.seed == seed0].iloc[0]
        cfg = read_config(root / "runs" / chosen.run_id)
        cfg = replace(cfg, train=replace(cfg.train, keep_history=False))
        noise = 2 * statistics.stdev(g["value"]) if len(g) > 1 else float("nan")
        for label, moved in moves(cfg).items():
            path = run_dir(runs, moved)
            jobs[path.name] = TrainJob(moved, path)
            plan.append((size, opt, label, float(chosen.value), noise, path.name))
    results = execute(list(jobs.values()), "local", args.workers, root / "tuning-check" / "submitit")
    print(f"{'size':6} {'optimizer':8} {'move':20} {'chosen':>8} {'moved':>8} {'gain':>8} {'2σ seeds':>8}  holds")
    failed = 0
    for size, opt, label, chosen, noise, key in sorted(plan, key=lambda p: (sizes.index(p[0]), p[1], p[2])):
        r = results[key]
        loss = float(r["final_val_loss"]) if r.get("status") == "done" else float("inf")
        gain = chosen - loss  # > 0: the move is better than the study's choice
        holds = not gain > noise
        failed += not holds
        print(f"{size:6} {opt:8} {label:20} {chosen:8.4f} {loss:8.4f} {gain:+8.4f} {noise:8.4f}  "
              f"{'yes' if holds else 'NO'}")
    print(f"{len(plan) - failed} of {len(plan)} moves leave the study's choice within the seeds' noise")


if __name__ == "__main__":
    main()

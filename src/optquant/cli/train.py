"""`optquant train`: one run, resumed if killed, skipped if done (--force retrains, --dry-run plans)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

EPILOG = """examples:
  optquant train                                   # the 'tiny' preset with AdamW on the embedded corpus
  optquant train --preset nano --set train.steps=200
  optquant train --set optim.name=muon --set optim.lr=0.02
  optquant train --set qat.method=quest --set qat.w_bits=4 --set qat.a_bits=4
  optquant train --config run.toml --set seed=1
  optquant train --set optim.name=examples/lion.py:make_optimizer   # your optimizer (README: "Your optimizer")
  optquant train --set log.to=tensorboard          # or log.to=wandb (offline); needs optquant[tensorboard|wandb]

A run lives in OUT/<name>-<optimizer>-<confighash>/; rerunning the same command resumes a killed run
and skips a finished one (--force retrains it). Fields: see README ("Configuration")."""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train one model (FP, or QAT with --set qat.method=quest)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="size preset: zepto, atto, femto, pico, nano, micro, tiny (default), small, "
                   "50m, 125m, 350m, 500m, 760m, 1.5b")  # literal: the CLI imports torch only when it runs
    p.add_argument("--config", type=Path, help="TOML file of settings (tables = config sections)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a setting, e.g. --set optim.name=shampoo (repeatable); optim.name also takes "
                   "a plugin: module:function, file.py:function or an optquant.optimizers entry point")
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: runs)")
    p.add_argument("--force", action="store_true", help="retrain even if the run is done")
    p.add_argument("--dry-run", action="store_true", help="print the run's cost and peak memory, train nothing "
                   "(--set plan.gpu=a100 --set plan.mfu=0.35 choose the accelerator)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run, freed_memory="keep")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from optquant.config import resolve
    from optquant.runs import LOCK, locked, read_summary, run_dir
    from optquant.train import train

    if args.dry_run:
        from optquant.cost import cost_lines, run_cost, split_gpu_overrides
        from optquant.data import epochs, train_tokens

        plan, overrides = split_gpu_overrides(args.set or [])
        cfg = resolve(args.preset, args.config, overrides)
        lines = cost_lines(cfg, plan)
        corpus = train_tokens(cfg.data, cfg.model.vocab_size, raw=False)
        if corpus is not None:  # tokens drawn ÷ the corpus's training tokens (data.max_epochs refuses past it)
            need = run_cost(cfg, plan).tokens
            lines.append(f"  data.source={cfg.data.source}: {corpus:,} training tokens, {epochs(need, corpus):,.2f} "
                         f"epochs (data.max_epochs={cfg.data.max_epochs:g})")
        print("\n".join(lines))
        return 0
    cfg = resolve(args.preset, args.config, args.set or [])
    path = run_dir(args.out, cfg)
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 talks, locks and deletes
    if not args.force and (done := read_summary(path)) is not None:
        if main_rank:
            print(f"{path}: already done (use --force to retrain)")
            print(json.dumps(done, indent=2))
        return 0
    bar = tqdm(total=None, desc=path.name, unit="step", dynamic_ncols=True, disable=args.quiet or not main_rank)

    def on_step(info: dict) -> None:
        bar.total = info["total"]
        bar.update(info["step"] - bar.n)
        bar.set_postfix(loss=f"{info['loss']:.3f}", tok_s=f"{info['tokens_per_s']:.0f}")

    with locked(path, wait=False) if main_rank else contextlib.nullcontext():
        if args.force and main_rank:  # all but the lock (held here); the other ranks wait in train()'s barrier
            for child in path.iterdir():
                if child.name != LOCK:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        summary = train(cfg, path, on_step=on_step)
    bar.close()
    if main_rank:
        print(json.dumps(summary, indent=2))
        print(f"run directory: {path}")
        if summary["status"] == "diverged":
            print(f"optquant: {path.name} diverged at step {summary['diverged_step']}: "
                  f"{summary.get('diverged_reason')}", file=sys.stderr)
    return 0 if summary["status"] == "done" else 3

"""The `optquant` command: one subcommand per stage; each parses, builds configs and calls the library.

Bad input raises OptquantError anywhere below; main() prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

from optquant.errors import OptquantError

EPILOG_TRAIN = """examples:
  optquant train                                   # the 'tiny' preset with AdamW on the embedded corpus
  optquant train --preset nano --set train.steps=200
  optquant train --set optim.name=muon --set optim.lr=0.02
  optquant train --set qat.method=quest --set qat.w_bits=4 --set qat.a_bits=4
  optquant train --config run.toml --set seed=1

A run lives in OUT/<name>-<optimizer>-<confighash>/; rerunning the same command resumes a killed run
and skips a finished one (--force retrains it). Fields: see README ("Configuration")."""


EPILOG_STUDY = """examples:
  optquant study                                   # the default CPU study, into studies/cpu
  optquant study --preset smoke                    # the same pipeline in about a minute
  optquant study --set optimizers=adamw,muon,shampoo --set sizes=nano,micro
  optquant study --set lrs.muon=0.01,0.02,0.04 --set run=train.tokens_per_param=10
  optquant study --set sweeps.muon.optim.momentum=0.9,0.95   # a 1-D sweep at the smallest size
  optquant study --preset paper --set executor=slurm --set run=data.source=/data/climbmix"""


def _train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from optquant.config import resolve
    from optquant.runs import run_dir
    from optquant.train import train

    if args.dry_run:
        from optquant.budget import budget_lines, split_plan_overrides

        plan, overrides = split_plan_overrides(args.set or [])
        print("\n".join(budget_lines(resolve(args.preset, args.config, overrides), plan)))
        return 0
    cfg = resolve(args.preset, args.config, args.set or [])
    path = run_dir(args.out, cfg)
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 talks and deletes
    if args.force and path.exists() and main_rank:
        shutil.rmtree(path)  # the other ranks wait for this in train()'s process-group barrier
    if (path / "summary.json").exists() and not args.force:
        if main_rank:
            print(f"{path}: already done (use --force to retrain)")
            print((path / "summary.json").read_text())
        return 0
    bar = tqdm(total=None, desc=path.name, unit="step", dynamic_ncols=True, disable=args.quiet or not main_rank)

    def on_step(info: dict) -> None:
        bar.total = info["total"]
        bar.update(info["step"] - bar.n)
        bar.set_postfix(loss=f"{info['loss']:.3f}", tok_s=f"{info['tokens_per_s']:.0f}")

    summary = train(cfg, path, on_step=on_step)
    bar.close()
    if main_rank:
        print(json.dumps(summary, indent=2))
        print(f"run directory: {path}")
    return 0 if summary["status"] == "done" else 3


def _ptq_config(args: argparse.Namespace):
    from optquant.quant.ptq import PTQConfig

    return PTQConfig(method=args.method, w_bits=args.w_bits, a_bits=args.a_bits, format=args.format,
                     grid=args.grid, w_group_size=args.group_size, quantize_head=args.quantize_head,
                     rotation=args.rotation, act_order=args.act_order)


def _analysis_config(args: argparse.Namespace):
    from optquant.analysis import AnalysisConfig

    return AnalysisConfig(weights=args.weights, mc_items=args.mc_items)


def _ptq(args: argparse.Namespace) -> int:
    from optquant.analysis import out_dir, ptq_eval

    qcfg, acfg = _ptq_config(args), _analysis_config(args)
    result = ptq_eval(args.run_dir, qcfg, acfg)
    print(json.dumps(result, indent=2))
    print(f"written: {out_dir(args.run_dir, acfg, qcfg.name)}/summary.json")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from optquant.analysis import analyze, out_dir

    qcfg, acfg = _ptq_config(args), _analysis_config(args)
    result = analyze(args.run_dir, qcfg, acfg)
    print(json.dumps(result, indent=2))
    print(f"written: {out_dir(args.run_dir, acfg, qcfg.name)}/{{analysis.json,outliers.parquet,"
          "propagation.parquet}")
    return 0


def _study(args: argparse.Namespace) -> int:
    import time

    from tqdm import tqdm

    from optquant.config import load_toml
    from optquant.study.plan import run_study
    from optquant.study.spec import apply_study_overrides, estimate_jobs, study_preset

    toml_preset, toml_overrides = load_toml(args.config) if args.config else (None, [])
    spec = study_preset(args.preset or toml_preset or "cpu")
    if args.dry_run:
        from optquant.budget import split_plan_overrides
        from optquant.study.budget import study_lines

        plan, overrides = split_plan_overrides(toml_overrides + (args.set or []))
        print("\n".join(study_lines(apply_study_overrides(spec, overrides), plan)))
        return 0
    spec = apply_study_overrides(spec, toml_overrides + (args.set or []))
    root = args.out or Path("studies") / spec.name
    bar = tqdm(total=estimate_jobs(spec), unit="job", dynamic_ncols=True, disable=args.quiet)
    start = time.time()

    def on_event(event: dict) -> None:
        if event["event"] == "stage":
            bar.set_description(event["stage"])
            if bar.n + event["jobs"] > bar.total:  # grid extensions add jobs the estimate did not know
                bar.total = bar.n + event["jobs"]
                bar.refresh()
            return
        bar.update(1)
        result = event["result"]
        loss = result.get("final_val_loss", result.get("delta_val_loss"))
        status = result.get("status", "done")
        msg = f"[{time.time() - start:7.1f}s] {event['stage']}: {event['key']} {status}"
        if isinstance(loss, float):
            msg += f" ({'val loss' if 'final_val_loss' in result else 'Δ val loss'} {loss:.4f})"
        bar.set_postfix_str(event["key"][-40:])
        bar.write(msg)

    report = run_study(spec, root, on_event)
    bar.close()
    print(f"study done in {time.time() - start:.0f}s: {root}")
    print(f"report: {report}")
    return 0


def _verdict(fit: dict) -> str:
    reasons = (fit.get("diagnostics") or {}).get("reasons") or {}
    return "not identified: " + "; ".join(reasons.values()) if reasons else "identified"


def _fit(args: argparse.Namespace) -> int:
    from optquant.study.results import refit

    fits = refit(args.study_dir, args.interval)
    for opt, fit in fits["per_optimizer"].items():
        print(f"{opt:8s} rho_4bit={fit['rho'].get('4bit', float('nan')):.3f}  E={fit['E']:.3f}  "
              f"alpha={fit['alpha']:.3f}  A={fit['A']:.4g}  {_verdict(fit)}")
    if (joint := fits.get("joint")) is not None:
        rho = "  ".join(f"{o}={r.get('4bit', float('nan')):.3f}" for o, r in joint["rho"].items())
        print(f"joint (headline) rho_4bit: {rho}  {_verdict(joint)}")
    for what, error in fits["errors"].items():
        print(f"{what}: not fitted ({error})")
    print(f"written: {args.study_dir}/fits.json and correlations.parquet")
    return 0


def _report(args: argparse.Namespace) -> int:
    from optquant.report import render_report, report_markdown

    path = render_report(args.study_dir)
    print(report_markdown(args.study_dir))
    print(f"report: {path}")
    return 0


def _add_quant_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a finished run directory (from optquant train)")
    p.add_argument("--method", choices=["rtn", "gptq"], default="rtn")
    p.add_argument("--w-bits", type=int, default=4, help="weight bits (16 = not quantized)")
    p.add_argument("--a-bits", type=int, default=4, help="activation bits (16 = weight-only)")
    p.add_argument("--format", choices=["int", "mxfp4", "nvfp4"], default="int")
    p.add_argument("--grid", choices=["sym", "sym8", "odd", "asym"], default="sym",
                   help="integer grid: sym [-7,7] (default), sym8 [-8,7], odd (16 levels, no zero), asym")
    p.add_argument("--group-size", type=int, default=0, help="weight group size (0 = per output channel)")
    p.add_argument("--rotation", choices=["none", "hadamard"], default="none")
    p.add_argument("--act-order", action="store_true", help="GPTQ: quantize columns by decreasing Hessian")
    p.add_argument("--quantize-head", action="store_true", help="also quantize the LM head")
    p.add_argument("--weights", choices=["final", "cl"], default="final",
                   help="final weights or the Common-Loss checkpoint")
    p.add_argument("--mc-items", type=int, default=200, help="multiple-choice items (0 = skip)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optquant",
        description="How does the optimizer change a language model's robustness to quantization? "
        "Train LMs with six optimizers, quantize them, measure outliers and error propagation.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train one model (FP, or QAT with --set qat.method=quest)",
                       epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="size preset: femto, pico, nano, micro, tiny (default), small, "
                   "50m, 125m, 350m, 500m, 760m, 1.5b")
    p.add_argument("--config", type=Path, help="TOML file of settings (tables = config sections)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a setting, e.g. --set optim.name=shampoo (repeatable)")
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: runs)")
    p.add_argument("--force", action="store_true", help="retrain even if the run is done")
    p.add_argument("--dry-run", action="store_true", help="print the run's cost and peak memory, train nothing "
                   "(--set plan.gpu=a100 --set plan.mfu=0.35 choose the accelerator)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)

    p = sub.add_parser("ptq", help="quantize a trained run and measure the damage (val loss, MC accuracy)",
                       description="Post-training quantization of a run's model; the paper's scheme is "
                       "the default (W4A4 symmetric absmax RTN, weights per channel, activations per token).")
    _add_quant_flags(p)
    p.set_defaults(func=_ptq)
    p = sub.add_parser("analyze", help="outlier metrics (MMR, kurtosis) and the ABC error propagation",
                       description="Per-layer MMR/kurtosis of the FP model and the ABC decomposition "
                       "(R, A, B, C, gains G, G1, G2 per module) against its quantized copy.")
    _add_quant_flags(p)
    p.set_defaults(func=_analyze)
    p = sub.add_parser("study", help="the whole study: LR sweeps, Common Loss, PTQ, ABC, QAT, fits, report",
                       description="Runs (or resumes) the whole pipeline. Presets: smoke (about a minute), "
                       "cpu (the default; a 2-core CPU), gpu, paper. Rerunning a killed study redoes nothing "
                       "that finished.", epilog=EPILOG_STUDY, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["smoke", "cpu", "gpu", "paper"], help="study preset (default: cpu)")
    p.add_argument("--config", type=Path, help="TOML file of study settings")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a study setting (repeatable)")
    p.add_argument("--out", type=Path, help="study directory (default: studies/<preset>)")
    p.add_argument("--dry-run", action="store_true", help="print the jobs per stage, each run's cost and memory "
                   "and the GPU-hours, run nothing (--set plan.gpu=h100|a100|...)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_study)
    p = sub.add_parser("fit", help="(re)fit a study's scaling laws and correlations from results.parquet")
    p.add_argument("study_dir", type=Path)
    p.add_argument("--interval", choices=["bootstrap", "loo", "none"], default="bootstrap",
                   help="uncertainty of the fitted parameters (default: bootstrap)")
    p.set_defaults(func=_fit)
    p = sub.add_parser("report", help="(re)build a study's HTML report from its files")
    p.add_argument("study_dir", type=Path)
    p.set_defaults(func=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # torch notes once per process that RMSNorm under bf16 autocast (bf16 input, fp32 gain) is not fused;
    # it is expected and harmless, and would be the first line every user sees
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except OptquantError as e:
        print(f"optquant: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("optquant: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

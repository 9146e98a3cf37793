"""`optquant study` (the whole pipeline), `optquant fit` and `optquant report` (rebuilt from its files)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from optquant.errors import OptquantError

EPILOG = """examples:
  optquant study                                   # the default CPU study, into studies/cpu
  optquant study --preset smoke                    # the same pipeline in about a minute
  optquant study --set optimizers=adamw,muon,shampoo --set sizes=nano,micro
  optquant study --set lrs.muon=0.01,0.02,0.04 --set run=train.tokens_per_param=10
  optquant study --set sweeps.muon.optim.momentum=0.9,0.95   # a 1-D sweep at the smallest size
  optquant study --preset smoke --set optimizers=adamw,examples/lion.py:make_optimizer   # a plugin optimizer
  optquant study --preset paper --set executor=slurm --set run=data.source=/data/climbmix"""


def add_parsers(sub) -> None:
    p = sub.add_parser("study", help="the whole study: LR sweeps, Common Loss, PTQ, ABC, QAT, fits, report",
                       description="Runs (or resumes) the whole pipeline. Presets: smoke (about a minute), "
                       "cpu (the default; a 2-core CPU), gpu, paper. Rerunning a killed study redoes nothing "
                       "that finished.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--markdown", action="store_true",
                   help="print the headline tables as Markdown (for the README) instead of writing the HTML")
    p.set_defaults(func=_report)


def _study(args: argparse.Namespace) -> int:
    import time

    from tqdm import tqdm

    from optquant.config import load_toml
    from optquant.study.plan import run_study
    from optquant.study.spec import apply_study_overrides, estimate_jobs, study_preset
    from optquant.study.validate import validate_spec

    toml_preset, toml_overrides = load_toml(args.config) if args.config else (None, [])
    spec = study_preset(args.preset or toml_preset or "cpu")
    if args.dry_run:
        from optquant.budget import split_plan_overrides
        from optquant.study.budget import study_lines

        plan, overrides = split_plan_overrides(toml_overrides + (args.set or []))
        print("\n".join(study_lines(validate_spec(apply_study_overrides(spec, overrides)), plan)))
        return 0
    spec = validate_spec(apply_study_overrides(spec, toml_overrides + (args.set or [])))
    root = args.out or Path("studies") / spec.name
    bar = tqdm(total=estimate_jobs(spec), unit="job", dynamic_ncols=True, disable=args.quiet)
    start = time.time()

    def on_event(event: dict) -> None:
        if event["event"] == "warning":
            bar.write(f"optquant: warning: {event['message']}", file=sys.stderr)
            return
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


def _fit(args: argparse.Namespace) -> int:
    from optquant.report.fits import verdict
    from optquant.study.results import refit

    with _study_files(args.study_dir):
        fits = refit(args.study_dir, args.interval)
    for opt, fit in fits["per_optimizer"].items():
        print(f"{opt:8s} rho_4bit={fit['rho'].get('4bit', float('nan')):.3f}  E={fit['E']:.3f}  "
              f"alpha={fit['alpha']:.3f}  A={fit['A']:.4g}  {verdict(fit)}")
    if (joint := fits.get("joint")) is not None:
        rho = "  ".join(f"{o}={r.get('4bit', float('nan')):.3f}" for o, r in joint["rho"].items())
        print(f"joint (headline) rho_4bit: {rho}  {verdict(joint)}")
    for what, error in fits["errors"].items():
        print(f"{what}: not fitted ({error})")
    print(f"written: {args.study_dir}/fits.json and correlations.parquet")
    return 0


@contextlib.contextmanager
def _study_files(study_dir: Path):
    """Readable files of the wrong shape (a list where a table belongs, a missing column) are bad input."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise OptquantError(f"{study_dir}: a study file does not have the layout optquant writes "
                            f"({type(e).__name__}: {e}); rerun optquant study to rewrite it") from None


def _report(args: argparse.Namespace) -> int:
    from optquant.report import render_report, report_markdown

    if not any((Path(args.study_dir) / f).is_file() for f in ("study.json", "results.parquet")):
        raise OptquantError(f"{args.study_dir}: not a study directory (no study.json or results.parquet; "
                            "run optquant study first)")
    with _study_files(args.study_dir):
        if args.markdown:  # the headline tables for the README, from the same Table objects as the HTML page
            print(report_markdown(args.study_dir))
            return 0
        path = render_report(args.study_dir)
    print(f"report: {path}")
    return 0

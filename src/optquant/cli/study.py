"""`optquant study` (the whole pipeline), `optquant fit` and `optquant report` (rebuilt from its files)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

from optquant.errors import OptquantError

EPILOG = """examples:
  optquant study                                   # the default CPU study, into studies/cpu
  optquant study --preset smoke                    # the same pipeline at toy scale
  optquant study --set optimizers=adamw,muon,shampoo --set sizes=nano,micro
  optquant study --set lrs.muon=0.01,0.02,0.04 --set run=train.tokens_per_param=10
  optquant study --set sweeps.muon.optim.momentum=0.9,0.95   # a 1-D sweep at the smallest size
  optquant study --preset smoke --set optimizers=adamw,examples/lion.py:make_optimizer   # a plugin optimizer
  optquant study --preset gpu --set data.source=~/climbmix-tok --dry-run   # a corpus from optquant data prepare
  optquant study --preset paper --set executor=slurm --set data.source=/data/climbmix-tok"""


def add_parsers(sub) -> None:
    p = sub.add_parser("study", help="the whole study: LR sweeps, Common Loss, PTQ, ABC, QAT, fits, report",
                       description="Runs (or resumes) the whole pipeline. Presets: smoke (every stage at toy scale), "
                       "cpu (the default; a 2-core CPU), gpu, paper. Rerunning a killed study redoes nothing "
                       "that finished.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", metavar="NAME", help="study preset: smoke, cpu (the default), cpu-robust, "
                   "cpu-thorough, gpu or paper (docs/configuration.md, Study presets)")
    p.add_argument("--config", type=Path, help="TOML file of study settings")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a study setting (repeatable)")
    p.add_argument("--out", type=Path, help="study directory (default: studies/<preset>)")
    p.add_argument("--dry-run", action="store_true", help="print the jobs per stage, each run's cost and memory "
                   "and the GPU-hours, run nothing (--set plan.gpu=h100|a100|...)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_study, freed_memory="keep")
    p = sub.add_parser("fit", help="(re)fit a study's scaling laws and correlations from results.parquet")
    p.add_argument("study_dir", type=Path)
    p.add_argument("--interval", choices=["bootstrap", "loo", "none"], default="bootstrap",
                   help="uncertainty of the fitted parameters (default: bootstrap)")
    p.set_defaults(func=_fit, freed_memory="keep")
    p = sub.add_parser("report", help="(re)build a study's HTML report from its files")
    p.add_argument("study_dir", type=Path)
    p.add_argument("--markdown", action="store_true",
                   help="print the headline tables as Markdown (for the README) instead of writing the HTML")
    p.set_defaults(func=_report, freed_memory="keep")


def _study(args: argparse.Namespace) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from optquant.config import read_toml
    from optquant.study.plan import run_study
    from optquant.study.validate import validate_spec
    from optquant.study_spec import apply_study_overrides, study_preset

    toml_preset, toml_values = read_toml(args.config) if args.config else (None, {})
    given = [*toml_values.items(), *(args.set or [])]  # TOML's values as it typed them, then --set's strings
    spec = study_preset(args.preset or toml_preset or "cpu")
    if args.dry_run:
        from optquant.cost import split_gpu_overrides
        from optquant.study.dryrun import study_lines

        plan, overrides = split_gpu_overrides(given)
        print("\n".join(study_lines(validate_spec(apply_study_overrides(spec, overrides)), plan)))
        return 0
    spec = validate_spec(apply_study_overrides(spec, given))
    from optquant.study.dryrun import check_study_epochs

    check_study_epochs(spec)  # before anything trains: no size may repeat its corpus past data.max_epochs
    root = args.out or Path("studies") / spec.name
    progress = Progress(spec, args.quiet)
    with logging_redirect_tqdm([logging.getLogger()]) if progress.bar else contextlib.nullcontext():
        try:
            report = run_study(spec, root, progress.on_event)
        finally:
            progress.close()
    print(f"study done in {time.time() - progress.eta.start:.0f}s: {root}")
    print(f"report: {report}")
    return 0


def _clock(s: float) -> str:
    s = max(0, round(s))
    return f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else f"{s // 60} min {s % 60:02d} s" if s >= 60 \
        else f"{s} s"


class Progress:
    """The study's progress display: a bar driven by the cost model's share of estimated wall time
    (optquant.study.eta), priced by the study's probe and corrected by each job's timing record (the costs.jsonl
    line the executor hands to the job event: the file is not read back), with a clock that keeps
    counting between completions (a ticker thread) and warnings written above the bar. Without a usable
    terminal (not a tty, or under 40 columns, as under `script` or some CI runners): plain timed lines, a
    status line at each stage and every 30 s."""

    def __init__(self, spec, quiet: bool, stream=sys.stderr):
        from tqdm import tqdm

        from optquant.study.eta import CostETA

        self.eta, self.stream, self.quiet, self.stage = CostETA(spec, time.time()), stream, quiet, "start"
        try:
            cols = os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
        except (OSError, ValueError, AttributeError):
            cols = 0
        self.plain = cols < 40
        self.bar = None if quiet or self.plain else tqdm(
            total=1000, bar_format="{desc}: {percentage:3.0f}%|{bar}| {unit}", dynamic_ncols=True, file=stream)
        self.lock, self.stop, self.last_line = threading.Lock(), threading.Event(), 0.0
        self.ticker = threading.Thread(target=self._tick, daemon=True)
        if not quiet:
            self.ticker.start()

    def status(self, now: float) -> str:
        e = self.eta
        return (f"{_clock(now - e.start)} elapsed, ETA {_clock(e.eta(now))} · {e.jobs}/{e.total_jobs()} jobs "
                f"(estimated from the cost model)")

    def write(self, msg: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(msg, file=self.stream)
        else:
            print(msg, file=self.stream, flush=True)

    def _show(self, now: float) -> None:
        if self.bar is not None:
            self.bar.set_description_str(self.stage, refresh=False)
            self.bar.n = min(999, int(1000 * self.eta.fraction(now)))
            self.bar.unit = self.status(now)  # {unit} in bar_format: tqdm's postfix would start with ", "
            self.bar.refresh()
        elif self.plain and not self.quiet and now - self.last_line >= 30:
            self.last_line = now
            self.write(f"[{now - self.eta.start:7.1f}s] {self.stage}: {self.status(now)}")

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            with self.lock:
                self._show(time.time())

    def on_event(self, event: dict) -> None:
        from optquant.study.eta import plan_cells

        now = time.time()
        with self.lock:
            if event["event"] == "warning":
                self.write(f"optquant: warning: {event['message']}")
                return
            if event["event"] == "stage":
                self.stage = event["stage"]
                self.write(f"[{now - self.eta.start:7.1f}s] {self.stage}: {event['jobs']} jobs; "
                           f"{self.status(now)}")
                self.last_line = now
                self._show(now)
                return
            if event["event"] == "probe":  # before the first job: the prior in this machine's seconds
                if event["probe"] is not None and not self.eta.jobs:
                    self.eta.cells = plan_cells(self.eta.spec, event["probe"])
                return
            if event.get("timing") is not None:  # the executor's costs.jsonl line for the job that ran
                self.eta.record(event["timing"])
            else:  # answered from its files (a resumed study)
                self.eta.skip(event["job_stage"], now)
            result = event["result"]
            loss = result.get("final_val_loss", result.get("delta_val_loss"))
            msg = f"[{now - self.eta.start:7.1f}s] {event['stage']}: {event['key']} {result.get('status', 'done')}"
            if isinstance(loss, float):
                msg += f" ({'val loss' if 'final_val_loss' in result else 'Δ val loss'} {loss:.4f})"
            self.write(msg)
            self._show(now)

    def close(self) -> None:
        self.stop.set()
        if self.ticker.is_alive():
            self.ticker.join(timeout=2)
        if self.bar is not None:
            self.bar.close()


def _fit(args: argparse.Namespace) -> int:
    from optquant.report.scaling import verdict
    from optquant.runs import StudyDir
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
    files = StudyDir(args.study_dir)
    print(f"written: {files.fits} and {files.correlations.name}")
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
    from optquant.runs import StudyDir

    if not (files := StudyDir(args.study_dir)).is_study():
        raise OptquantError(f"{args.study_dir}: not a study directory (no {files.study.name} or "
                            f"{files.results.name}; run optquant study first)")
    with _study_files(args.study_dir):
        if args.markdown:  # the headline tables for the README, from the same Table objects as the HTML page
            print(report_markdown(args.study_dir))
            return 0
        path = render_report(args.study_dir)
    print(f"report: {path}")
    return 0

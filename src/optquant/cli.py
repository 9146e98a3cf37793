"""The `optquant` command: one subcommand per stage; each parses, builds configs and calls the library.

Bad input raises OptquantError anywhere below; main() prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import shutil
import sys
import typing
import warnings
from pathlib import Path

from optquant.errors import OptquantError

EPILOG_TRAIN = """examples:
  optquant train                                   # the 'tiny' preset with AdamW on the embedded corpus
  optquant train --preset nano --set train.steps=200
  optquant train --set optim.name=muon --set optim.lr=0.02
  optquant train --set qat.method=quest --set qat.w_bits=4 --set qat.a_bits=4
  optquant train --config run.toml --set seed=1
  optquant train --set optim.name=examples/lion.py:make_optimizer   # your optimizer (README: "Your optimizer")
  optquant train --set log.to=tensorboard          # or log.to=wandb (offline); needs optquant[tensorboard|wandb]

A run lives in OUT/<name>-<optimizer>-<confighash>/; rerunning the same command resumes a killed run
and skips a finished one (--force retrains it). Fields: see README ("Configuration")."""


EPILOG_STUDY = """examples:
  optquant study                                   # the default CPU study, into studies/cpu
  optquant study --preset smoke                    # the same pipeline in about a minute
  optquant study --set optimizers=adamw,muon,shampoo --set sizes=nano,micro
  optquant study --set lrs.muon=0.01,0.02,0.04 --set run=train.tokens_per_param=10
  optquant study --set sweeps.muon.optim.momentum=0.9,0.95   # a 1-D sweep at the smallest size
  optquant study --preset smoke --set optimizers=adamw,examples/lion.py:make_optimizer   # a plugin optimizer
  optquant study --preset paper --set executor=slurm --set run=data.source=/data/climbmix"""


def _train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from optquant.config import resolve
    from optquant.runs import locked, read_summary, run_dir
    from optquant.train import train

    if args.dry_run:
        from optquant.budget import budget_lines, split_plan_overrides

        plan, overrides = split_plan_overrides(args.set or [])
        print("\n".join(budget_lines(resolve(args.preset, args.config, overrides), plan)))
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
        if args.force and main_rank:
            _clear_run(path)  # the other ranks wait for this in train()'s process-group barrier
        summary = train(cfg, path, on_step=on_step)
    bar.close()
    if main_rank:
        print(json.dumps(summary, indent=2))
        print(f"run directory: {path}")
        if summary["status"] == "diverged":
            print(f"optquant: {path.name} diverged at step {summary['diverged_step']}: "
                  f"{summary.get('diverged_reason')}", file=sys.stderr)
    return 0 if summary["status"] == "done" else 3


def _clear_run(path: Path) -> None:
    """Everything in a run directory but its lock (held by this process)."""
    for child in path.iterdir():
        if child.name != ".lock":
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def _check_run_dir(path: Path) -> None:
    if not (Path(path) / "config.json").is_file():
        raise OptquantError(f"{path}: not a run directory (no config.json; give a directory made by optquant train)")


def _ptq_config(args: argparse.Namespace):
    from optquant.quant.ptq import PTQConfig

    return PTQConfig(method=args.method, w_bits=args.w_bits, a_bits=args.a_bits, format=args.format,
                     grid=args.grid, w_group_size=args.group_size, quantize_head=args.quantize_head,
                     rotation=args.rotation, act_order=args.act_order)


def _analysis_config(args: argparse.Namespace):
    from optquant.analysis import AnalysisConfig

    return AnalysisConfig(weights=args.weights, mc_items=args.mc_items)


def _hf_quant(args: argparse.Namespace, what: str) -> int:
    """`ptq --hf PATH` / `analyze --hf PATH`: the same analyses on a local Hugging Face causal LM."""
    from optquant.data import DataConfig
    from optquant.hf.analysis import HFSource, default_out, hf_analyze, hf_ptq_eval

    if args.run_dir is not None:
        raise OptquantError(f"{what}: give a run directory or --hf PATH, not both")
    if args.weights != "final":
        raise OptquantError(f"{what} --hf: --weights applies to optquant runs only")
    qcfg, acfg = _ptq_config(args), _analysis_config(args)
    src = HFSource(args.hf, DataConfig(source=args.data), seq_len=args.seq_len)
    out = args.out or default_out(args.hf)
    result = (hf_ptq_eval if what == "ptq" else hf_analyze)(src, qcfg, acfg, out)
    print(json.dumps(result, indent=2))
    print(f"written: {out / qcfg.name}/")
    return 0


def _needs_run_dir(args: argparse.Namespace, what: str) -> None:
    if args.run_dir is None:
        raise OptquantError(f"{what}: give a run directory (from optquant train) or --hf PATH")


def _quantized(args: argparse.Namespace, what: str) -> int:
    """`optquant ptq` (damage: summary.json) or `optquant analyze` (outliers + ABC) of one run or HF model."""
    from optquant.analysis import analyze, out_dir, ptq_eval
    from optquant.runs import locked

    if args.hf is not None:
        return _hf_quant(args, what)
    _needs_run_dir(args, what)
    qcfg, acfg = _ptq_config(args), _analysis_config(args)
    _check_run_dir(args.run_dir)
    out = out_dir(args.run_dir, acfg, qcfg.name)
    with locked(out, wait=False):
        result = (ptq_eval if what == "ptq" else analyze)(args.run_dir, qcfg, acfg)
    print(json.dumps(result, indent=2))
    written = "summary.json" if what == "ptq" else "{analysis.json,outliers.parquet,propagation.parquet}"
    print(f"written: {out}/{written}")
    return 0


def _ptq(args: argparse.Namespace) -> int:
    return _quantized(args, "ptq")


def _analyze(args: argparse.Namespace) -> int:
    return _quantized(args, "analyze")


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


def _verdict(fit: dict) -> str:
    reasons = (fit.get("diagnostics") or {}).get("reasons") or {}
    return "not identified: " + "; ".join(reasons.values()) if reasons else "identified"


def _fit(args: argparse.Namespace) -> int:
    from optquant.study.results import refit

    with _study_files(args.study_dir):
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


def _eval(args: argparse.Namespace) -> int:
    from optquant.checkpoint import atomic_write_json
    from optquant.harness import lm_eval_tasks, load_model

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    model, tok, eot = load_model(args.run_dir, args.hf, args.weights)
    result = lm_eval_tasks(model, tok, eot, tasks, include_path=args.include_path, limit=args.limit)
    for task, r in result.items():
        print(f"{task:20s} acc={r['acc']:.4f}±{r['acc_stderr'] or 0:.4f}  "
              f"acc_norm={r['acc_norm']:.4f}±{r['acc_norm_stderr'] or 0:.4f}  (n={r['n']})")
    out = args.out or (args.run_dir / "lm_eval.json" if args.run_dir else Path("hf-analysis") /
                       args.hf.resolve().name / "lm_eval.json")
    atomic_write_json(out, result)
    print(f"written: {out}")
    return 0


def _add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="zero-shot lm-eval tasks on a run or an HF folder (needs optquant[eval])",
                       description="Runs the real LM-Evaluation-Harness (lm-eval 0.4.x) offline through optquant's "
                       "adapter: the task data must be in the local Hugging Face cache, or the task local "
                       "(--include-path). Prints acc and acc_norm with standard errors and n.",
                       epilog="examples:\n  optquant eval runs/tiny-adamw-0123456789 --tasks piqa,hellaswag,arc_easy\n"
                       "  optquant eval --hf path/to/model --tasks mytask --include-path my_tasks/",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, nargs="?", help="a finished run directory (or use --hf)")
    p.add_argument("--hf", type=Path, metavar="PATH", help="a local Hugging Face causal LM folder (needs optquant[hf])")
    p.add_argument("--tasks", default="piqa,hellaswag,arc_easy", help="comma-separated lm-eval task names "
                   "(default: the paper's piqa,hellaswag,arc_easy)")
    p.add_argument("--include-path", type=Path, metavar="DIR", help="a folder of extra lm-eval task YAMLs")
    p.add_argument("--limit", type=int, help="score only the first N items of each task")
    p.add_argument("--weights", choices=["final", "cl"], default="final", help="a run's final or Common-Loss weights")
    p.add_argument("--out", type=Path, help="results JSON (default: RUN/lm_eval.json or hf-analysis/<name>/)")
    p.set_defaults(func=_eval)


def _export(args: argparse.Namespace) -> int:
    from optquant.hf.export import export_hf

    out = export_hf(args.run_dir, args.hf, args.weights)
    print(f"written: {out}/ (load with transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained)")
    return 0


def _add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="export a llama-variant run to a Hugging Face folder (needs optquant[hf])",
                       description="Writes the run's model as an exact LlamaForCausalLM (same logits) plus its "
                       "tokenizer.json. OLMo2-variant and QAT runs are refused: no HF architecture computes them.",
                       epilog="example:\n  optquant export runs/tiny-adamw-0123456789 --hf exported/tiny",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a finished run directory with model.arch=llama")
    p.add_argument("--hf", type=Path, required=True, metavar="OUT", help="output folder (Hugging Face format)")
    p.add_argument("--weights", choices=["final", "cl"], default="final",
                   help="final weights or the Common-Loss checkpoint")
    p.set_defaults(func=_export)


def _add_quant_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, nargs="?", help="a finished run directory (from optquant train), or use --hf")
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
    _add_hf_flags(p)


def _add_hf_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Hugging Face models (needs pip install 'optquant[hf]')")
    g.add_argument("--hf", type=Path, metavar="PATH", help="analyse a local Hugging Face causal LM folder "
                   "(Llama, Mistral, Qwen2, Qwen3, OLMo2) instead of a run; nothing is downloaded")
    g.add_argument("--data", default="embedded", metavar="SRC", help="with --hf: the text to evaluate on, "
                   "encoded with the folder's tokenizer (default: the embedded corpus; or .txt/.jsonl/.parquet)")
    g.add_argument("--seq-len", type=int, default=128, help="with --hf: tokens per window (default 128)")
    g.add_argument("--out", type=Path, help="with --hf: output directory (default: hf-analysis/<folder name>)")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage itself is one `--help` away)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
                   help="override a setting, e.g. --set optim.name=shampoo (repeatable); optim.name also takes "
                   "a plugin: module:function, file.py:function or an optquant.optimizers entry point")
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
    p.add_argument("--markdown", action="store_true",
                   help="print the headline tables as Markdown (for the README) instead of writing the HTML")
    p.set_defaults(func=_report)
    _add_export_parser(sub)
    _add_eval_parser(sub)
    return parser


def one_line(message: str) -> str:
    """`message` on one line: control characters (a newline in a key, a file name) are escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in message)


def _os_error(e: OSError) -> str:
    """One line for an OS error: what went wrong, where, and the hint a user needs."""
    where = " → ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    hint = {errno.ENOSPC: " (the disk is full: free space and rerun; finished work is kept)",
            errno.EROFS: " (choose a writable directory, e.g. with --out)",
            errno.EACCES: " (check the permissions, or choose another directory)",
            errno.EDQUOT: " (disk quota exceeded: free space and rerun; finished work is kept)"}.get(e.errno, "")
    return f"{where}: {e.strerror or e}{hint}" if where else f"{e.strerror or e}{hint}"


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()  # here, not at interpreter exit: a reader that left (`| head`) shows up below
    except BrokenPipeError:  # `optquant report | head`: the reader has what it wanted; stop quietly
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool ended by it


def _dispatch(argv: list[str] | None) -> int:
    # torch notes once per process that RMSNorm under bf16 autocast (bf16 input, fp32 gain) is not fused;
    # it is expected and harmless, and would be the first line every user sees
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except OptquantError as e:
        print(f"optquant: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as e:  # read-only or full disk, permissions: the path and what to do, on one line
        print(f"optquant: error: {one_line(_os_error(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("optquant: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a descriptor
        pass


if __name__ == "__main__":
    sys.exit(main())

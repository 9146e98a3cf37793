"""`optquant export` (a run as a Hugging Face folder) and `optquant eval` (lm-eval tasks): a trained model
handed to outside tools."""

from __future__ import annotations

import argparse
from pathlib import Path

from optquant.cli.quant import HFModel
from optquant.errors import OptquantError
from optquant.ranges import Natural, flag


def add_parsers(sub) -> None:
    p = sub.add_parser("export", help="export a llama-variant run to a Hugging Face folder (needs optquant[hf])",
                       description="Writes the run's model as an exact LlamaForCausalLM (same logits) plus its "
                       "tokenizer.json. OLMo2-variant and QAT runs are refused: no HF architecture computes them.",
                       epilog="example:\n  optquant export runs/tiny-adamw-0123456789 --hf exported/tiny",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a finished run directory with model.arch=llama")
    p.add_argument("--hf", type=Path, required=True, metavar="OUT", help="output folder (Hugging Face format)")
    p.add_argument("--weights", choices=["final", "cl"], default="final",
                   help="final weights or the Common-Loss checkpoint")
    p.add_argument("--force", action="store_true", help="overwrite an earlier export at OUT (never a run, a study "
                   "or another file)")
    p.set_defaults(func=_export, freed_memory=None)  # writes an HF folder (no training steps to speed up)
    p = sub.add_parser("eval", help="zero-shot lm-eval tasks on a run or an HF folder (needs optquant[eval])",
                       description="Runs the real LM-Evaluation-Harness (lm-eval 0.4.x) offline through optquant's "
                       "adapter: the task data must be in the local Hugging Face cache, or the task local "
                       "(--include-path). Prints acc and acc_norm with standard errors and n.",
                       epilog="examples:\n  optquant eval runs/tiny-adamw-0123456789 --tasks piqa,hellaswag,arc_easy\n"
                       "  optquant eval --hf path/to/model --tasks mytask --include-path my_tasks/",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, nargs="?", help="a finished run directory (or use --hf)")
    p.add_argument("--hf", type=Path, action=HFModel, metavar="PATH",
                   help="a local Hugging Face causal LM folder (needs optquant[hf])")
    p.add_argument("--tokenizer", type=Path, metavar="PATH", help="with --hf: a tokenizer folder or tokenizer.json "
                   "for a checkpoint without one (EOS: its own, else config.json's eos_token_id)")
    p.add_argument("--tasks", default="piqa,hellaswag,arc_easy", help="comma-separated lm-eval task names "
                   "(default: the paper's piqa,hellaswag,arc_easy)")
    p.add_argument("--include-path", type=Path, metavar="DIR", help="a folder of extra lm-eval task YAMLs")
    p.add_argument("--limit", type=flag(Natural), default=0, help="score only the first N items of each task "
                   "(default 0: every item, as a study's eval.limit)")
    p.add_argument("--weights", choices=["final", "cl"], default="final", help="a run's final or Common-Loss weights")
    p.add_argument("--out", type=Path, help="results JSON (default: RUN/lm_eval.json or hf-analysis/<name>/)")
    p.set_defaults(func=_eval, freed_memory="keep")


def _eval(args: argparse.Namespace) -> int:
    from optquant.files import atomic_write_json
    from optquant.harness import lm_eval_tasks
    from optquant.runs import RunDir

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:  # `--tasks ,` once wrote an empty result and exited 0
        raise OptquantError(f"eval: --tasks {args.tasks!r} names no task (e.g. --tasks piqa,hellaswag)")
    if args.tokenizer and args.hf is None:
        raise OptquantError("eval: --tokenizer goes with --hf (a run has its own tokenizer)")
    model, tok, eot, prefix = _load_model(args.run_dir, args.hf, args.weights, args.tokenizer)
    result = lm_eval_tasks(model, tok, eot, tasks, include_path=args.include_path, limit=args.limit or None,
                           prefix_id=prefix)
    for task, r in result.items():
        print(f"{task:20s} acc={r['acc']:.4f}±{r['acc_stderr'] or 0:.4f}  "
              f"acc_norm={r['acc_norm']:.4f}±{r['acc_norm_stderr'] or 0:.4f}  (n={r['n']})")
    out = args.out or (RunDir(args.run_dir).lm_eval if args.run_dir else Path("hf-analysis") /
                       args.hf.resolve().name / RunDir(args.hf).lm_eval.name)
    atomic_write_json(out, result)
    print(f"written: {out}")
    return 0


def _load_model(run_dir: Path | None, hf: Path | None, weights: str, tokenizer: Path | None):
    """(model, tokenizers.Tokenizer, EOS id, lm-eval's prefix id: None for a run, see harness.lm_eval_adapter)."""
    if (run_dir is None) == (hf is None):
        raise OptquantError("eval: give a run directory or --hf PATH (one of them)")
    if hf is not None:
        from optquant.hf import load_hf, load_hf_tokenizer

        return load_hf(hf, seq_len=2048), *load_hf_tokenizer(tokenizer or hf, model=hf)
    from optquant.ptq_stage import load_run_model, run_tokens

    cfg, model = load_run_model(run_dir, weights)
    data = run_tokens(run_dir, cfg)
    return model, data.tokenizer, data.eot_id, None


def _export(args: argparse.Namespace) -> int:
    from optquant.hf.export import export_hf

    out = export_hf(args.run_dir, args.hf, args.weights, force=args.force)
    print(f"written: {out}/ (load with transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained)")
    return 0

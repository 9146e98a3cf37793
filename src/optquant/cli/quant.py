"""`optquant ptq` (the damage: val loss, MC accuracy), `optquant analyze` (outliers, ABC) and `optquant bits`
(a per-module bit plan, quant/bit_plan.py) of one run or a local Hugging Face model (--hf)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from optquant.errors import OptquantError
from optquant.quant.choices import FORMATS, GRIDS, METHODS, ROTATIONS
from optquant.ranges import Natural, flag


class HFModel(argparse.Action):
    """--hf PATH, a Hugging Face model: the command gives freed memory back (freed_memory="return"). An HF run is
    bounded by memory, and malloc keeping its freed blocks makes a process keep its peak: the 0.5B bf16
    analyze grew ~0.7 GB of freed heap (issue 33)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.freed_memory = "return"


def add_parsers(sub) -> None:
    p = sub.add_parser("ptq", help="quantize a trained run and measure the damage (val loss, MC accuracy)",
                       description="Post-training quantization of a run's model; the paper's scheme is "
                       "the default (W4A4 symmetric absmax RTN, weights per channel, activations per token).")
    _add_flags(p)
    p.set_defaults(func=_quantized, freed_memory="keep")
    p = sub.add_parser("analyze", help="outlier metrics (MMR, kurtosis) and the ABC error propagation",
                       description="Per-layer MMR/kurtosis of the FP model and the ABC decomposition "
                       "(R, A, B, C, gains G, G1, G2 per module) against its quantized copy.")
    _add_flags(p)
    p.set_defaults(func=_quantized, freed_memory="keep")
    p = sub.add_parser("bits", help="a per-module bit plan at an average bit budget, from the ABC decomposition",
                       description="Bits per linear layer (from --choices) whose parameter-weighted average is at "
                       "most --avg-bits, ranked by each module's share of R_L (the error at the logits; --score "
                       "oracle: by measured damage). Writes plan.json for `optquant ptq --plan`, and optionally an "
                       "llm-compressor recipe and a torchao snippet. --w-bits is ignored: the choices set it.")
    _add_flags(p)
    p.add_argument("--avg-bits", type=float, required=True, help="the average weight bits, e.g. 4.5")
    p.add_argument("--choices", default="4,8", help="comma-separated bit widths a module may get (default 4,8)")
    p.add_argument("--score", choices=["abc", "oracle", "hawq", "fisher"], default="abc",
                   help="abc: the decomposition (one walk); oracle: each module's measured damage (many passes); "
                   "hawq: Hessian trace (Hutchinson) x ||Q(W)-W||^2; fisher: empirical Fisher trace x ||Q(W)-W||^2")
    p.add_argument("--plan-out", "--plan", dest="plan_out", type=Path, default=Path("plan.json"),
                   help="the plan file to write (default plan.json)")
    p.add_argument("--recipe", type=Path, help="also write the plan as an llm-compressor recipe (YAML)")
    p.add_argument("--torchao", type=Path, help="also write a torchao snippet applying the plan")
    p.set_defaults(func=_bits, freed_memory="keep")


# The PTQConfig fields the scheme's flags set (their dests); a flag not given leaves PTQConfig's default.
SCHEME_FLAGS = ("method", "w_bits", "a_bits", "format", "grid", "w_group_size", "rotation", "act_order",
                "quantize_head")


def _add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, nargs="?", help="a finished run directory (from optquant train), or use --hf")
    p.add_argument("--method", choices=METHODS)
    p.add_argument("--w-bits", type=int, help="weight bits (16 = not quantized)")
    p.add_argument("--a-bits", type=int, help="activation bits (16 = weight-only)")
    p.add_argument("--format", choices=FORMATS)
    p.add_argument("--grid", choices=GRIDS,
                   help="integer grid: sym [-7,7], scale absmax/7 (default, the paper's); sym8 [-8,7] (llama.cpp "
                   "Q4_0); full [-8,7], scale absmax/7.5 (llm-compressor, torchao); odd (16 levels, no zero); asym")
    p.add_argument("--group-size", type=flag(Natural), dest="w_group_size", metavar="GROUP_SIZE",
                   help="weight group size (0 = per output channel); a group at least a layer's input width is one "
                   "per row of it, one that does not divide a narrower width is refused (as llm-compressor's "
                   "compressed-tensors; torchao would leave such a layer FP)")
    p.add_argument("--rotation", choices=ROTATIONS)
    p.add_argument("--act-order", action="store_true", default=None,
                   help="GPTQ: quantize columns by decreasing Hessian")
    p.add_argument("--quantize-head", action="store_true", default=None, help="also quantize the LM head")
    p.add_argument("--weights", choices=["final", "cl"], default="final",
                   help="final weights or the Common-Loss checkpoint")
    p.add_argument("--mc-items", type=flag(Natural), default=200,
                   help="multiple-choice items (0 = skip; at most the validation split's distinct contexts)")
    if p.prog.split()[-1] == "ptq":
        p.add_argument("--plan", type=Path, help="a bit plan from optquant bits: each module at its planned bits "
                       "(the scheme is the plan's; --method/--w-bits/--a-bits/... are ignored)")
    g = p.add_argument_group("Hugging Face models (needs pip install 'optquant[hf]')")
    g.add_argument("--hf", type=Path, action=HFModel, metavar="PATH", help="analyse a local Hugging Face causal LM "
                   "folder (Llama, Mistral, Qwen2, Qwen3, OLMo2) instead of a run; nothing is downloaded")
    g.add_argument("--data", default="embedded", metavar="SRC", help="with --hf: the text to evaluate on, "
                   "encoded with the folder's tokenizer (default: the embedded corpus; or .txt/.jsonl/.parquet, or a "
                   "directory from optquant data prepare --tokenizer <the model's>)")
    g.add_argument("--tokenizer", type=Path, metavar="PATH", help="with --hf: a tokenizer folder or tokenizer.json "
                   "for a checkpoint without one (EOS: its own, else config.json's eos_token_id)")
    g.add_argument("--tokens", type=Path, metavar="FILE", help="with --hf: token ids instead of --data text, for the "
                   "evaluation windows: a 1-D integer .npy, or text of whitespace-separated integers")
    g.add_argument("--calib-tokens", type=Path, metavar="FILE", help="with --tokens: GPTQ's calibration ids, same "
                   "formats (default: the --tokens file)")
    g.add_argument("--seq-len", type=flag(Annotated[int, Meta(ge=2)]), help="with --hf: tokens per window, at most "
                   "config.json's max_position_embeddings (default 128, or that if smaller)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="with --hf: the weights' dtype (default: the checkpoint's own; float32 = the analysis in fp32)")
    g.add_argument("--out", type=Path, help="with --hf: output directory (default: hf-analysis/<folder name>)")


def _ptq_config(args: argparse.Namespace):
    from optquant.quant.ptq import PTQConfig

    if getattr(args, "plan", None) is not None:
        from optquant.files import read_json
        from optquant.quant.bit_plan import check_record

        ptq, _, bits = check_record(read_json(args.plan), str(args.plan))
        try:
            return PTQConfig(**ptq, plan=tuple(bits.items()))
        except TypeError as e:
            raise OptquantError(f"{args.plan}: its ptq record is not a scheme ({e})") from None
    return PTQConfig(**{f: getattr(args, f) for f in SCHEME_FLAGS if getattr(args, f) is not None})


def _analysis_config(args: argparse.Namespace):
    from optquant.ptq_stage import AnalysisConfig

    return AnalysisConfig(weights=args.weights, mc_items=args.mc_items)


HF_ONLY = {"data": "embedded", "tokenizer": None, "tokens": None, "calib_tokens": None, "seq_len": None,
           "dtype": "auto", "out": None}  # the --hf flags, at their defaults


def _run_dir(args: argparse.Namespace, what: str) -> Path:
    """The run directory `what` works on: one given, holding a run's config.json, and no --hf flag beside it
    (it would be ignored: refused instead)."""
    from optquant.runs import RunDir

    if args.run_dir is None:
        raise OptquantError(f"{what}: give a run directory (from optquant train) or --hf PATH")
    given = [f"--{k.replace('_', '-')}" for k, default in HF_ONLY.items() if getattr(args, k) != default]
    if given:
        raise OptquantError(f"{what}: {', '.join(given)} {'is' if len(given) == 1 else 'are'} for --hf only (a run "
                            "has its own data, window and output directory)")
    if not RunDir(args.run_dir).config.is_file():
        raise OptquantError(f"{args.run_dir}: not a run directory (no config.json; give a directory made by "
                            "optquant train)")
    return args.run_dir


def _seq_len(args: argparse.Namespace) -> int:
    """--seq-len (default 128, or the model's max_position_embeddings if smaller), at most that maximum."""
    from optquant.hf import check_hf_config

    if args.seq_len is None or not args.hf.is_dir():  # no folder: load_hf says so
        return args.seq_len or 128
    top = check_hf_config(args.hf).get("max_position_embeddings")
    if top is not None and args.seq_len > top:
        raise OptquantError(f"--seq-len {args.seq_len} exceeds {args.hf}'s max_position_embeddings ({top})")
    return args.seq_len


def _hf_quant(args: argparse.Namespace, what: str) -> int:
    """`ptq --hf PATH` / `analyze --hf PATH`: the same analyses on a local Hugging Face causal LM."""
    from optquant.data import DataConfig
    from optquant.hf.ptq_stage import HFSource, default_out, hf_analysis, hf_damage

    if args.run_dir is not None:
        raise OptquantError(f"{what}: give a run directory or --hf PATH, not both")
    if args.weights != "final":
        raise OptquantError(f"{what} --hf: --weights applies to optquant runs only")
    if args.tokens and (args.tokenizer or args.data != "embedded"):
        raise OptquantError(f"{what} --hf: --tokens replaces the text; give it without --tokenizer and --data")
    if args.tokens and what == "ptq" and args.mc_items:
        raise OptquantError("ptq --hf --tokens: the multiple-choice task needs text (its acc_norm counts characters): "
                            "add --mc-items 0, or give --data with --tokenizer")
    if args.calib_tokens and not args.tokens:
        raise OptquantError(f"{what} --hf: --calib-tokens goes with --tokens")
    qcfg, acfg = _ptq_config(args), _analysis_config(args)
    src = HFSource(args.hf, DataConfig(source=args.data), seq_len=_seq_len(args), tokenizer=args.tokenizer,
                   tokens=args.tokens, calib_tokens=args.calib_tokens, dtype=args.dtype)
    out = args.out or default_out(args.hf)
    result = (hf_damage if what == "ptq" else hf_analysis)(src, qcfg, acfg, out)
    print(json.dumps(result, indent=2))
    print(f"written: {out / qcfg.name}/")
    return 0


def _quantized(args: argparse.Namespace) -> int:
    """`optquant ptq` (damage: summary.json) or `optquant analyze` (outliers + ABC) of one run or HF model."""
    from optquant.ptq_stage import out_dir, ptq_analysis, ptq_damage
    from optquant.runs import PTQ_FILES, locked

    what = args.command
    if args.hf is not None:
        return _hf_quant(args, what)
    qcfg, acfg = _ptq_config(args), _analysis_config(args)
    out = out_dir(_run_dir(args, what), acfg, qcfg.name)
    with locked(out, wait=False):
        result = (ptq_damage if what == "ptq" else ptq_analysis)(args.run_dir, qcfg, acfg)
    print(json.dumps(result, indent=2))
    names = [PTQ_FILES[k] for k in (("damage",) if what == "ptq" else ("analysis", "outliers", "propagation"))]
    written = names[0] if len(names) == 1 else "{" + ",".join(names) + "}"
    print(f"written: {out}/{written}")
    return 0


def _bits(args: argparse.Namespace) -> int:
    """`optquant bits`: the plan of one run or HF model, written atomically to --plan-out (and the exports)."""
    from optquant.files import atomic_write_json, atomic_write_text
    from optquant.ptq_stage import LoadedRun, model_bits
    from optquant.quant.bit_plan import hf_names, llmcompressor_recipe, torchao_snippet, yaml_text

    try:
        choices = tuple(int(c) for c in args.choices.split(","))
    except ValueError:
        raise OptquantError(f"bits: --choices {args.choices!r} must be comma-separated integers, e.g. 4,8") from None
    qcfg, acfg = _ptq_config(args), _analysis_config(args)
    if (args.recipe or args.torchao) and (qcfg.rotation != "none" or qcfg.format != "int"):
        what = "a Hadamard rotation" if qcfg.rotation != "none" else f"--format {qcfg.format}"
        raise OptquantError(f"bits: --recipe and --torchao cannot hold {what} (they export integer schemes without a "
                            "rotation); plan without it to export")
    if args.hf is not None:
        from optquant.data import DataConfig
        from optquant.hf.ptq_stage import HFSource, _setup

        if args.run_dir is not None:
            raise OptquantError("bits: give a run directory or --hf PATH, not both")
        src = HFSource(args.hf, DataConfig(source=args.data), seq_len=_seq_len(args), tokenizer=args.tokenizer,
                       tokens=args.tokens, calib_tokens=args.calib_tokens, dtype=args.dtype)
        cfg, model, data = _setup(src, acfg, lazy=args.score == "abc" and qcfg.rotation == "none")
        run = LoadedRun.of(cfg, model, data, owned=True)
    else:
        run = LoadedRun(_run_dir(args, "bits"), acfg.weights)
    record = model_bits(run, qcfg, acfg, args.avg_bits, choices, args.score)
    atomic_write_json(args.plan_out, record)
    bits = {m: v["bits"] for m, v in record["modules"].items()}
    if args.recipe:
        atomic_write_text(args.recipe, yaml_text(llmcompressor_recipe(bits, record["ptq"], hf_names(bits))))
    if args.torchao:
        atomic_write_text(args.torchao, torchao_snippet(bits, hf_names(bits)))
    counts = {b: sum(v == b for v in bits.values()) for b in record["choices"]}
    print(f"plan: {', '.join(f'{n} modules at {b} bits' for b, n in counts.items())}; average "
          f"{record['plan_avg_bits']:.4f} bits (budget {args.avg_bits}), score {args.score}")
    print(f"written: {args.plan_out}" + "".join(f", {f}" for f in (args.recipe, args.torchao) if f))
    if (args.recipe or args.torchao) and qcfg.grid != "full":
        print(f"note: llm-compressor and torchao round on [-8, 7] with scale absmax/7.5 (--grid full), not --grid "
              f"{qcfg.grid}: their damage matches optquant's for a plan made with --grid full")
    if args.torchao and qcfg.a_bits < 16:
        print("note: the torchao snippet quantizes the weights only (its activations stay FP)")
    return 0

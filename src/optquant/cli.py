"""The `optquant` command: one subcommand per stage; each parses, builds configs and calls the library.

Bad input raises OptquantError anywhere below; main() prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
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


def _train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from optquant.config import resolve
    from optquant.runs import run_dir
    from optquant.train import train

    cfg = resolve(args.preset, args.config, args.set or [])
    path = run_dir(args.out, cfg)
    if args.force and path.exists():
        shutil.rmtree(path)
    if (path / "summary.json").exists():
        print(f"{path}: already done (use --force to retrain)")
        print((path / "summary.json").read_text())
        return 0
    bar = tqdm(total=None, desc=path.name, unit="step", dynamic_ncols=True, disable=args.quiet)

    def on_step(info: dict) -> None:
        bar.total = info["total"]
        bar.update(info["step"] - bar.n)
        bar.set_postfix(loss=f"{info['loss']:.3f}", tok_s=f"{info['tokens_per_s']:.0f}")

    summary = train(cfg, path, on_step=on_step)
    bar.close()
    print(json.dumps(summary, indent=2))
    print(f"run directory: {path}")
    return 0 if summary["status"] == "done" else 3


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
    p.add_argument("--preset", help="size preset: nano, micro, tiny (default), small, 50m ... 1.5b")
    p.add_argument("--config", type=Path, help="TOML file of settings (tables = config sections)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a setting, e.g. --set optim.name=shampoo (repeatable)")
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: runs)")
    p.add_argument("--force", action="store_true", help="retrain even if the run is done")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


_EXTRA_COMMANDS: list = []


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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

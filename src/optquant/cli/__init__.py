"""The `optquant` command: one subcommand per stage; each parses, builds configs and calls the library.

Bad input raises OptquantError anywhere below; main() prints it as one line and exits with status 2.
One file per group of subcommands: train.py, quant.py (ptq, analyze), study.py (study, fit, report),
models.py (export, eval), data.py (data prepare, data info); each registers its parsers and holds the
functions they call.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import typing
import warnings

from optquant.cli import data, models, quant, study, train
from optquant.errors import OptquantError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage itself is one `--help` away)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="optquant",
                     description="How does the optimizer change a language model's robustness to quantization? "
                     "Train LMs with six optimizers, quantize them, measure outliers and error propagation.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_parser(sub)
    quant.add_parsers(sub)
    study.add_parsers(sub)
    models.add_parsers(sub)
    data.add_parsers(sub)
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
        try:  # stdout to /dev/null, so the interpreter's final flush cannot raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a descriptor
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a tool ended by it


def _dispatch(argv: list[str] | None) -> int:
    # torch notes once per process that RMSNorm under bf16 autocast (bf16 input, fp32 gain) is not fused;
    # it is expected and harmless, and would be the first line every user sees
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)
    args = build_parser().parse_args(argv)
    if args.freed_memory:  # each command declares its policy (set_defaults); --hf (quant.HFModel) sets "return"
        from optquant import device

        # fewer page faults per step on CPU, or (--hf) freed memory back to the kernel; the same numbers (device.py)
        (device.keep_freed_memory if args.freed_memory == "keep" else device.return_freed_memory)()
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

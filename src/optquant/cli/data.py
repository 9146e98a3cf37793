"""`optquant data prepare` (a corpus → token shards + manifest, once) and `optquant data info` (what a prepared
directory holds)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from optquant.ranges import Count, Natural, flag

EPILOG = """examples:
  optquant data prepare ~/climbmix/*.parquet --out ~/climbmix-tok            # a 32k byte-level BPE on a 64 MB sample
  optquant data prepare ~/fineweb/ --out ~/fineweb-tok --tokenizer ~/models/Llama-3.2-1B --processes 16
  optquant data prepare 'shards/*.jsonl.zst' --out tok --executor slurm --jobs 64 --processes 8
  optquant study --preset gpu --set data.source=~/climbmix-tok --dry-run     # epochs per size from the manifest

Rerunning the same command resumes a killed prepare (finished files are kept); the directory is complete
when manifest.json exists. Train on it with --set data.source=DIR (several: DIR1,DIR2)."""


def add_parsers(sub) -> None:
    data = sub.add_parser("data", help="prepare a corpus once into token shards (data prepare), or describe one")
    verbs = data.add_subparsers(dest="data_command", required=True, metavar="VERB")
    p = verbs.add_parser("prepare", help="tokenize .txt/.jsonl(.gz/.zst)/.parquet files into token shards + a "
                         "manifest", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="files, directories or globs (quote a glob for "
                   "the executor to expand it)")
    p.add_argument("--out", type=Path, required=True, help="the prepared directory (new, or a killed prepare's)")
    p.add_argument("--tokenizer", metavar="PATH", default="", help="a tokenizer.json or a Hugging Face folder "
                   "holding one (default: train a byte-level BPE on a sample)")
    p.add_argument("--eot", default="", help="the end-of-document token of --tokenizer (default: its "
                   "tokenizer_config.json's eos_token, else <|endoftext|>, </s>, ...)")
    p.add_argument("--vocab-size", type=flag(Count), default=32000, help="the trained BPE's vocabulary (default 32000, "
                   "the gpu/paper presets')")
    p.add_argument("--sample-bytes", type=flag(Count), default=64 << 20, help="text the BPE is trained on, an equal "
                   "share from every file (default 64 MiB; bounds the trainer's memory)")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column of the text (default text)")
    p.add_argument("--val-fraction", type=flag(Annotated[float, Meta(gt=0, lt=1)]), default=0.05,
                   help="share of documents held out (default 0.05)")
    p.add_argument("--split-seed", type=flag(Natural), default=0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p.add_argument("--processes", type=flag(Count), default=cores, help="worker processes (per job; default: the "
                   "cores this process may use)")
    p.add_argument("--executor", choices=["local", "slurm", "submitit-local"], default="local",
                   help="local processes, or Slurm through submitit (submitit-local: the same on this machine)")
    p.add_argument("--jobs", type=flag(Count), default=1, help="cluster jobs the files are spread over (default 1)")
    p.set_defaults(func=_prepare, freed_memory=None)  # loads no torch, nor do its workers
    p = verbs.add_parser("info", help="the manifest of a prepared directory, checked: tokens, documents, tokenizer")
    p.add_argument("dir", type=Path)
    p.add_argument("--json", action="store_true", help="print the whole manifest")
    p.set_defaults(func=_info, freed_memory=None)


def _prepare(args: argparse.Namespace) -> int:
    from optquant.corpus.prepare import PrepareConfig, prepare
    cfg = PrepareConfig(**{f.name: getattr(args, f.name) for f in fields(PrepareConfig)})  # a flag per field
    manifest = prepare(args.sources, args.out, cfg)
    _print_summary(args.out, manifest)
    print(f"train on it: --set data.source={args.out}")
    return 0


def _print_summary(root: Path, m: dict) -> None:
    tok = m["tokenizer"]
    print(f"{root}: corpus {m['corpus_id'][:16]}, {len(m['sources'])} input files, {m['dtype']} shards")
    print(f"  tokenizer {tok['origin']}: {tok['vocab_size']:,} tokens, end-of-document {tok['eot']!r} "
          f"(id {tok['eot_id']}), sha256 {tok['sha256'][:16]}")
    for split, t in m["totals"].items():
        print(f"  {split:5} {t['tokens']:>16,} tokens {t['documents']:>13,} documents "
              f"{len(m['shards'][split]):>6} shards")


def _info(args: argparse.Namespace) -> int:
    from optquant.corpus.manifest import read_manifest

    manifest = read_manifest(args.dir)
    if args.json:
        print(json.dumps(manifest, indent=1))
    else:
        _print_summary(args.dir, manifest)
    return 0

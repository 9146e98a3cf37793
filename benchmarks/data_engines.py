"""Benchmark: which engine should `optquant data prepare` run on? The candidates the issue names, measured.

1. Does it install beside this project? `pip install --dry-run --report` of each candidate into the running
   environment (which has torch 2.13.0, numpy ≥ 2, tokenizers, transformers from the extras): what it would
   add, and which of the packages this project pins or needs it would replace.
2. For those that install cleanly: tokenization of the same generated parquet corpus (benchmarks/
   data_prepare.py's generator) with the same tokenizer on the same 2 processes, against optquant's own
   pipeline: wall seconds, tokens/s, peak RSS of the whole process tree, and the same tokens (count and id sum).
   datatrove runs as its docs show: ParquetReader → DocumentTokenizer (no shuffling, EOS appended) under
   LocalPipelineExecutor with one task per file.

Run: python benchmarks/data_engines.py [--gb 0.5] [--work DIR]  (needs datatrove and orjson installed to
measure it: pip install datatrove orjson). Under `flock /work/cpu.lock` on the shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from data_prepare import EOT, checksum, generate, measure, run_optquant  # noqa: E402

CANDIDATES = ("datatrove", "dolma", "litdata", "mosaicml-streaming")
WATCHED = ("torch", "numpy", "tokenizers", "transformers", "pyarrow")


def install_check(name: str) -> str:
    """What `pip install NAME` would do here: packages added, and the watched ones it would replace."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report",
                               str(report), name], capture_output=True, text=True)
        if proc.returncode:
            return f"does not resolve: {proc.stderr.strip().splitlines()[-1]}"
        items = json.loads(report.read_text())["install"]
    from importlib.metadata import PackageNotFoundError, version

    try:
        if not items:
            return f"already installed here ({name} {version(name)}), beside torch {version('torch')}"
    except PackageNotFoundError:
        pass
    changed = []
    for item in items:
        pkg, new = item["metadata"]["name"], item["metadata"]["version"]
        if pkg.lower() in WATCHED:
            try:
                changed.append(f"{pkg} {version(pkg)} → {new}")
            except PackageNotFoundError:
                changed.append(f"{pkg} (new) {new}")
    return f"{len(items)} packages; " + (f"replaces {', '.join(changed)}" if changed else "touches none of "
                                          f"{'/'.join(WATCHED)}")


def run_datatrove(files: list[Path], tok: Path, out: Path, processes: int) -> tuple[int, int]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    shutil.rmtree(out, ignore_errors=True)
    pipeline = [ParquetReader(str(files[0].parent), glob_pattern="*.parquet", text_key="text"),
                DocumentTokenizer(str(out / "tokens"), tokenizer_name_or_path=str(tok), eos_token=EOT,
                                  shuffle_documents=False)]
    LocalPipelineExecutor(pipeline, tasks=len(files), workers=processes, logging_dir=str(out / "logs")).run()
    n = s = 0
    for f in sorted((out / "tokens").glob("*.ds")):
        c = checksum(np.fromfile(f, dtype=np.uint16))
        n, s = n + c[0], s + c[1]
    return n, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--file-mb", type=float, default=64)
    ap.add_argument("--work", type=Path, default=Path("/tmp/optquant-engine-bench"))
    args = ap.parse_args()
    print("| candidate | pip install --dry-run here |\n|---|---|")
    for name in CANDIDATES:
        print(f"| {name} | {install_check(name)} |", flush=True)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    files = generate(args.work / "corpus", int(args.gb * 1e9), int(args.file_mb * 1e6))
    from optquant.corpus.prepare import PrepareConfig
    from optquant.corpus.sources import resolve_inputs
    from optquant.corpus.tokenizer import train_on_sample

    tok = args.work / "tokenizer.json"
    train_on_sample(resolve_inputs([str(f) for f in files]), PrepareConfig().split(), 32000, 64 << 20).save(str(tok))
    engines = {"optquant (tokenizers + pyarrow)": run_optquant}
    try:
        import datatrove  # noqa: F401
        import orjson  # noqa: F401

        engines["datatrove 0.10 DocumentTokenizer"] = run_datatrove
    except ImportError as e:
        print(f"datatrove not measured: {e}")
    rows, sums = [], set()
    for name, fn in engines.items():
        (n, s), wall, rss = measure(lambda fn=fn: fn(files, tok, args.work / "out", 2))
        sums.add((n, s))
        rows.append((name, wall, n / wall, rss))
    assert len(sums) == 1, f"the engines wrote different tokens: {sums}"
    n = next(iter(sums))[0]
    print(f"\n{sum(f.stat().st_size for f in files) / 1e9:.2f} GB of parquet in {len(files)} files, {n:,} tokens "
          f"(every engine the same count and id sum), 2 processes, load average {os.getloadavg()[0]:.1f}:\n")
    print("| engine | wall s | tokens/s | vs optquant | peak RSS |\n|---|---|---|---|---|")
    for name, wall, tps, rss in rows:
        print(f"| {name} | {wall:.0f} | {tps:,.0f} | {tps / rows[0][2]:.2f}× | {rss / 1e9:.2f} GB |")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

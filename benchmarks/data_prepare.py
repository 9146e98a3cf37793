"""Benchmark: `optquant data prepare` against the two ways people tokenize a corpus, side by side in one run.

The corpus is generated (≥ 2 GB by default): FineWeb-style parquet files (a `text` column, 64k-row groups) of
documents cut from the embedded corpus's real English (random runs of its lines), so BPE meets real words.
Every method gets the same tokenizer (a 32k byte-level BPE trained once, before timing, on a 64 MB sample
by optquant's recipe), the same files and the same cores, and must write the same tokens (checked: count
and id sum of every document's ids + EOT, the order aside):

- optquant: `optquant data prepare FILES --out DIR --tokenizer T --processes N` (a subprocess, as a user runs it);
- HF datasets: `load_dataset("parquet")` → `map(batched=True, num_proc=N)` → the ids written to one uint16
  file (nanoGPT's openwebtext/prepare.py);
- a `multiprocessing.Pool(N).imap(tokenize, docs, chunksize=16)` loop over `tokenizers`, the main process
  reading the parquet files and filling 100M-token shards (build-nanogpt's fineweb.py, with tokenizers in
  place of tiktoken).

Each worker encodes single-threaded (TOKENIZERS_PARALLELISM=false), so N processes mean N cores. Reported:
tokens/s, wall seconds, the peak RSS summed over the method's whole process tree (sampled every 0.1 s; it
counts shared library pages once per process, so it overstates), and optquant's 1 → 2 process speedup
measured on a quarter of the files (the peers' too with --peer-speedup). optquant's peak RSS at the quarter and the full
corpus (4× apart) shows the memory bound. Last, the training loader: windows/s drawn from the prepared
shards at the `gpu` preset's batch (256 windows of 1,025 tokens, data.get_batch), against what one H100
consumes at the dry run's step time (`optquant train --preset 50m/125m --dry-run`, MFU 0.4).

Run: python benchmarks/data_prepare.py [--gb 2] [--work DIR] [--keep]  (needs the `datasets` package:
pip install -e ".[eval]"); run it under `flock /work/cpu.lock` on the shared machine. The generated files
and outputs live under --work and are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

os.environ["TOKENIZERS_PARALLELISM"] = "false"
ROWS_PER_GROUP = 65536
EOT = "<|endoftext|>"


def generate(out: Path, total_bytes: int, file_bytes: int, seed: int = 0) -> list[Path]:
    """Parquet files of ~file_bytes of text each: documents of 5–80 consecutive lines of an embedded document."""
    from optquant.data import DataConfig, read_documents

    lines = [ln for _, t in read_documents(DataConfig()) for ln in t.splitlines() if ln.strip()]
    rng, files, written = np.random.default_rng(seed), [], 0
    out.mkdir(parents=True, exist_ok=True)
    while written < total_bytes:
        docs, size = [], 0
        while size < file_bytes:
            start, n = int(rng.integers(len(lines))), int(rng.integers(5, 80))
            doc = "\n".join(lines[start : start + n])
            docs.append(doc)
            size += len(doc)
        path = out / f"part-{len(files):05d}.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=ROWS_PER_GROUP)
        files.append(path)
        written += size
    return files


def measure(fn) -> tuple[object, float, int]:
    """(fn's result, wall seconds, peak RSS summed over this process's children and itself, sampled)."""
    me, peak, stop = psutil.Process(), [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            peak[0] = max(peak[0], total - base)
            stop.wait(0.1)

    base = me.memory_info().rss  # this benchmark's own memory is not the method's
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    stop.set()
    thread.join()
    return result, wall, peak[0]


def checksum(ids: np.ndarray) -> tuple[int, int]:
    return int(ids.size), int(ids.astype(np.int64).sum())


def run_optquant(files: list[Path], tok: Path, out: Path, processes: int) -> tuple[int, int]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "optquant.cli", "data", "prepare", *map(str, files), "--out", str(out),
           "--tokenizer", str(tok), "--processes", str(processes)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    m = json.loads((out / "manifest.json").read_text())
    n = s = 0
    for split in ("train", "val"):
        for e in m["shards"][split]:
            c = checksum(np.fromfile(out / e["file"], dtype=m["dtype"]))
            n, s = n + c[0], s + c[1]
    return n, s


def _encode_batch(batch: dict) -> dict:
    from tokenizers import Tokenizer

    global _TOK
    if "_TOK" not in globals():
        _TOK = Tokenizer.from_file(os.environ["BENCH_TOKENIZER"])
    eot = _TOK.token_to_id(EOT)
    ids = [[*e.ids, eot] for e in _TOK.encode_batch_fast(batch["text"], add_special_tokens=False)]
    return {"ids": ids, "len": [len(x) for x in ids]}


def run_datasets(files: list[Path], tok: Path, out: Path, processes: int) -> tuple[int, int]:
    import datasets

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ["BENCH_TOKENIZER"] = str(tok)
    ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                               cache_dir=str(out / "hf-cache"))
    ids = ds.map(_encode_batch, batched=True, num_proc=processes if processes > 1 else None,
                 remove_columns=["text"], desc=None)
    total = int(np.sum(ids["len"], dtype=np.int64))
    arr = np.memmap(out / "train.bin", dtype=np.uint16, mode="w+", shape=(total,))
    pos, shards = 0, 64
    for i in range(shards):  # nanoGPT's prepare.py: contiguous shards, concatenated into one memmap
        part = ids.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
        chunk = np.concatenate(part["ids"]) if len(part) else np.empty(0, np.uint16)
        arr[pos : pos + chunk.size] = chunk
        pos += chunk.size
    arr.flush()
    return checksum(np.asarray(arr))


def _encode_doc(text: str) -> np.ndarray:
    from tokenizers import Tokenizer

    global _TOK
    if "_TOK" not in globals():
        _TOK = Tokenizer.from_file(os.environ["BENCH_TOKENIZER"])
    return np.array([*_TOK.encode(text, add_special_tokens=False).ids, _TOK.token_to_id(EOT)], dtype=np.uint16)


def _docs(files: list[Path]):
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=4096, columns=["text"]):
            yield from batch.column(0).to_pylist()


def run_pool(files: list[Path], tok: Path, out: Path, processes: int) -> tuple[int, int]:
    import multiprocessing as mp

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ["BENCH_TOKENIZER"] = str(tok)
    shard_size, n, s, index = 100_000_000, 0, 0, 0
    buf, filled = np.empty(shard_size, np.uint16), 0
    with mp.get_context("spawn").Pool(processes) as pool:
        for ids in pool.imap(_encode_doc, _docs(files), chunksize=16):
            n, s = n + ids.size, s + int(ids.astype(np.int64).sum())
            while ids.size:
                take = min(ids.size, shard_size - filled)
                buf[filled : filled + take] = ids[:take]
                filled, ids = filled + take, ids[take:]
                if filled == shard_size:
                    np.save(out / f"shard_{index:06d}.npy", buf)
                    index, filled = index + 1, 0
    np.save(out / f"shard_{index:06d}.npy", buf[:filled])
    return n, s


METHODS = {"optquant data prepare": run_optquant, "HF datasets map(num_proc)": run_datasets,
           "Pool loop over tokenizers": run_pool}


def loader_rates(prepared: Path) -> list[str]:
    """Windows/s the training loader draws from the prepared shards vs what one H100 consumes per size."""
    import torch

    from optquant.cost import GPUConfig, run_cost
    from optquant.data import DataConfig, get_batch, load_tokens
    from optquant.study_spec import gpu, run_config

    spec = gpu()
    cfg = run_config(spec, spec.sizes[0], "adamw")
    data = load_tokens(DataConfig(source=str(prepared), cache_dir=str(prepared.parent / "cache")), 32000)
    gen, micro = torch.Generator().manual_seed(0), cfg.train.batch_size // cfg.train.grad_accum
    get_batch(data.train, micro, cfg.model.seq_len, gen)  # first touch of the maps
    times = []
    for _ in range(40):
        t0 = time.perf_counter()
        for _ in range(cfg.train.grad_accum):  # one optimizer step's windows
            get_batch(data.train, micro, cfg.model.seq_len, gen)
        times.append(time.perf_counter() - t0)
    per_step = float(np.median(times))
    rate = cfg.train.batch_size / per_step
    lines = [f"training loader: {cfg.train.batch_size} windows of {cfg.model.seq_len + 1} tokens per step in "
             f"{per_step * 1e3:.1f} ms (median of 40, 1 process): {rate:,.0f} windows/s",
             "| size | H100 s/step (dry run, MFU 0.4) | windows/s one H100 consumes | loader / H100 |",
             "|---|---|---|---|"]
    for size in spec.sizes:
        b = run_cost(run_config(spec, size, "adamw"), GPUConfig())
        need = cfg.train.batch_size / b.step_seconds
        lines.append(f"| {size} | {b.step_seconds:.3f} | {need:,.0f} | {rate / need:,.0f}× |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="generated corpus size (default 2 GB)")
    ap.add_argument("--file-mb", type=float, default=128, help="text per parquet file (default 128 MB)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/optquant-data-bench"))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--peer-speedup", action="store_true", help="also time the peers at 1 and 2 processes")
    args = ap.parse_args()
    work = args.work
    t0 = time.perf_counter()
    files = generate(work / "corpus", int(args.gb * 1e9), int(args.file_mb * 1e6))
    corpus = sum(f.stat().st_size for f in files)
    text = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    print(f"corpus: {len(files)} parquet files, {corpus / 1e9:.2f} GB on disk, {text:,} documents "
          f"(generated in {time.perf_counter() - t0:.0f} s); load average {os.getloadavg()[0]:.1f}", flush=True)
    from optquant.corpus.prepare import PrepareConfig
    from optquant.corpus.sources import resolve_inputs
    from optquant.corpus.tokenizer import train_on_sample

    tok = work / "tokenizer.json"
    inputs = resolve_inputs([str(f) for f in files])
    bpe, wall, rss = measure(lambda: train_on_sample(inputs, PrepareConfig().split(), 32000, 64 << 20))
    bpe.save(str(tok))
    print(f"tokenizer: optquant's 32k byte-level BPE on its default 64 MiB sample (what `data prepare` without "
          f"--tokenizer does first) in {wall:.0f} s, peak RSS +{rss / 1e9:.2f} GB over the benchmark's own", flush=True)
    quarter = files[: max(1, len(files) // 4)]
    rows, sums = [], {}
    for name in args.methods:
        fn = METHODS[name]
        runs = {}
        plan = (("quarter", quarter, 1), ("quarter", quarter, 2), ("full", files, 2))
        if name != "optquant data prepare" and not args.peer_speedup:
            plan = plan[2:]  # the peers' own speedup is not the question; --peer-speedup measures it too
        for label, subset, procs in plan:
            out = work / ("prepared" if (name, label) == ("optquant data prepare", "full") else "out")
            (n, s), wall, rss = measure(lambda fn=fn, subset=subset, procs=procs, out=out: fn(subset, tok, out, procs))
            shutil.rmtree(work / "out", ignore_errors=True)
            runs[(label, procs)] = (n, wall, rss)
            sums[(name, label)] = (n, s)
            print(f"  {name}: {label} corpus, {procs} process(es): {n:,} tokens in {wall:.0f} s, "
                  f"{n / wall:,.0f} tokens/s, peak RSS {rss / 1e9:.2f} GB; load {os.getloadavg()[0]:.1f}", flush=True)
        n, wall, rss = runs[("full", 2)]
        quarter_runs = ("quarter", 1) in runs
        speedup = runs[("quarter", 1)][1] / runs[("quarter", 2)][1] if quarter_runs else None  # same tokens: wall ratio
        rows.append((name, n, wall, n / wall, rss, runs[("quarter", 2)][2] if quarter_runs else None, speedup))
    for label in ("full", "quarter"):
        got = {v for (m, lab), v in sums.items() if lab == label}
        assert len(got) <= 1, f"the methods wrote different tokens on the {label} corpus: {got}"
    best_peer = max((r[3] for r in rows if r[0] != "optquant data prepare"), default=float("nan"))
    print(f"\n{corpus / 1e9:.2f} GB of parquet, {rows[0][1]:,} tokens (every method the same count and id sum), "
          "2 processes; speedup from 1 to 2 processes on the first quarter of the files:\n")
    print("| method | wall s | tokens/s | vs faster peer | peak RSS (full) | peak RSS (quarter) | 1→2 processes |")
    print("|---|---|---|---|---|---|---|")
    for name, _, wall, tps, rss, rss_q, speedup in rows:
        quarter = f"{rss_q / 1e9:.2f} GB | {speedup:.2f}×" if speedup else "— | —"
        print(f"| {name} | {wall:.0f} | {tps:,.0f} | {tps / best_peer:.2f}× | {rss / 1e9:.2f} GB | {quarter} |")
    if "optquant data prepare" in args.methods:
        print("\n" + "\n".join(loader_rates(work / "prepared")))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""`optquant data prepare`: a corpus tokenized once into token shards and a manifest (corpus/manifest.py).

    inputs (sorted names) → tokenizer (the user's, or a BPE on a bounded sample) → plan.json
    → one task per input file: stream its documents, split each by its id's hash, encode in batches,
      append to that file's train and val shards → a record per task → manifest.json, last

A task is one input file, and its shards are named by the file's index in the sorted input list, so the
shards do not depend on how many processes or cluster jobs run the tasks: `--processes N` runs N local
worker processes; `--executor slurm` submits the tasks through submitit as an array of jobs (`--jobs`),
each running its share with `--processes` workers (`submitit-local` runs the same path on this machine).
Each worker encodes single-threaded (TOKENIZERS_PARALLELISM=false), so N processes use N cores.

Memory is bounded by a batch of documents (`BATCH_BYTES` of text and its ids) per worker, the tokenizer,
and, for a trained BPE, the sample (`--sample-bytes`); never by the corpus. A shard is written to a
temporary file beside it, fsync'ed and renamed into place; a task's record is written after its shards,
and the manifest after every record. A killed prepare keeps every finished task: the same command
continues with the rest, after checking that the inputs and settings are those of the plan.

Engine: measured against HF datatrove, the one candidate that installs beside torch 2.13.0 and this
project's numpy and transformers (dolma, litdata and mosaicml-streaming do not); docs/benchmarks.md
("Corpus preparation") has the measurement and the reasons this is written on tokenizers + pyarrow.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from tokenizers import Tokenizer

from optquant.corpus.manifest import MANIFEST, SPLITS, read_manifest, write_manifest
from optquant.corpus.sources import EOT, Input, documents, resolve_inputs
from optquant.corpus.tokenizer import load_user_tokenizer, tokenizer_hash, train_on_sample
from optquant.data import DataConfig, is_val
from optquant.errors import OptquantError
from optquant.files import atomic_write_json, atomic_write_text, temp_path

log = logging.getLogger(__name__)
WORK = ".prepare"  # plan.json, one record per finished task, submitit's folder
BATCH_BYTES = 4 << 20  # text per encode call
SPLIT_RULE = ("a document is held out (val) when int(sha1(f'{split_seed}\\0{doc_id}')[:8]) / 2**64 < val_fraction; "
              "doc_id = '<input name>:<line, row or block index>'")


@dataclass(frozen=True)
class PrepareConfig:
    text_field: str = "text"  # jsonl field or parquet column holding the text
    val_fraction: float = 0.05
    split_seed: int = 0
    tokenizer: str = ""  # a tokenizer.json or a folder holding one; "" = train a byte-level BPE
    eot: str = ""  # the user tokenizer's end-of-document token ("" = from its config or the usual names)
    vocab_size: int = 32000  # of the trained BPE
    sample_bytes: int = 64 << 20  # text the BPE is trained on
    processes: int = 1  # local worker processes (per cluster job)
    executor: Literal["local", "slurm", "submitit-local"] = "local"
    jobs: int = 1  # cluster jobs the tasks are spread over (slurm, submitit-local)

    def split(self) -> DataConfig:
        return DataConfig(text_field=self.text_field, val_fraction=self.val_fraction, split_seed=self.split_seed)


@dataclass(frozen=True)
class Task:
    index: int
    input: Input
    out: str
    tokenizer: str  # path of the prepared tokenizer.json
    eot_id: int
    dtype: str
    split: DataConfig


def _record_path(out: Path, index: int) -> Path:
    return out / WORK / "tasks" / f"{index:06d}.json"


def shard_name(split: str, index: int) -> str:
    return f"{split}/{index:06d}.bin"


class _Shard:
    """One shard being written: to a temporary file beside it, renamed into place by `close`."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, temp_path(path)
        self.file = open(self.tmp, "xb")  # noqa: SIM115 - closed by close/discard
        self.sha, self.tokens, self.documents = hashlib.sha256(), 0, 0

    def write(self, ids: np.ndarray, docs: int) -> None:
        data = ids.tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens, self.documents = self.tokens + ids.size, self.documents + docs

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.tokens:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink()
        return {"tokens": self.tokens, "documents": self.documents, "sha256": self.sha.hexdigest()}

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


_load_tokenizer = functools.cache(Tokenizer.from_file)  # once per worker process


def _batches(task: Task) -> Iterator[tuple[str, list[str]]]:
    """(split, texts) batches of about BATCH_BYTES each, in file order per split."""
    pending: dict[str, list[str]] = {s: [] for s in SPLITS}
    size = dict.fromkeys(SPLITS, 0)
    for doc_id, text in documents(task.input, task.split.text_field):
        s = "val" if is_val(doc_id, task.split) else "train"
        pending[s].append(text)
        size[s] += len(text)
        if size[s] >= BATCH_BYTES:
            yield s, pending[s]
            pending[s], size[s] = [], 0
    for s in SPLITS:
        if pending[s]:
            yield s, pending[s]


def tokenize_file(task: Task) -> dict:
    """Run one task: its input's train and val shards, then its record. Returns the record."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process: N processes use N cores
    tok = _load_tokenizer(task.tokenizer)
    out = Path(task.out)
    shards = {s: _Shard(out / shard_name(s, task.index)) for s in SPLITS}
    eot, dtype = (task.eot_id,), np.dtype(task.dtype)
    try:
        for s, texts in _batches(task):
            ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
            count = sum(map(len, ids)) + len(ids)
            flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(x, eot) for x in ids), dtype, count)
            shards[s].write(flat, len(ids))
        written = {s: shards[s].close() for s in SPLITS}
    except BaseException:
        for shard in shards.values():
            shard.discard()
        raise
    record = {"index": task.index, "source": task.input.name, "bytes": task.input.size,
              **{s: {**w, "file": shard_name(s, task.index) if w["tokens"] else None} for s, w in written.items()}}
    atomic_write_json(_record_path(out, task.index), record)
    return record


def _read_record(out: Path, task: Task) -> dict | None:
    """A finished task's record, if it and its shards are intact (else the task runs again)."""
    try:
        record = json.loads(_record_path(out, task.index).read_text())
        itemsize = np.dtype(task.dtype).itemsize
        intact = record["source"] == task.input.name and all(
            record[s]["file"] is None or (out / record[s]["file"]).stat().st_size == record[s]["tokens"] * itemsize
            for s in SPLITS)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if intact else None


def _run_tasks(tasks: list[Task], processes: int) -> list[dict]:
    if processes <= 1 or len(tasks) <= 1:
        return [tokenize_file(t) for t in tasks]
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(min(processes, len(tasks))) as pool:
        return list(pool.imap_unordered(tokenize_file, tasks))


def _submit(tasks: list[Task], cfg: PrepareConfig, folder: Path) -> None:
    """Spread `tasks` over `cfg.jobs` submitit jobs (a Slurm array, or local), each with cfg.processes workers."""
    import submitit

    cluster = "local" if cfg.executor == "submitit-local" else None
    executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    executor.update_parameters(timeout_min=24 * 60, cpus_per_task=cfg.processes)
    groups = [tasks[i :: cfg.jobs] for i in range(min(cfg.jobs, len(tasks)))]
    for job in executor.map_array(_run_tasks, groups, [cfg.processes] * len(groups)):
        job.result()


def _plan(out: Path, inputs: list[Input], cfg: PrepareConfig) -> dict:
    """What this prepare is: the inputs, the settings and the tokenizer. A resumed prepare must match it."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("processes", "executor", "jobs")}
    plan = {"inputs": [[i.name, i.size] for i in inputs], "settings": settings}
    path = out / WORK / "plan.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = None
        if not isinstance(old, dict) or {k: old.get(k) for k in plan} != plan:
            raise OptquantError(f"{out} holds a prepare of other inputs or settings ({path}); choose another --out "
                                "or delete it")
        return old
    if out.exists() and any(p.name != WORK for p in out.iterdir()):
        raise OptquantError(f"--out {out} exists and is not empty; choose a new directory")
    if cfg.tokenizer:
        tok, eot = load_user_tokenizer(Path(cfg.tokenizer), cfg.eot or None)
    else:
        log.info("training a %d-token byte-level BPE on ≤ %d bytes of the train split", cfg.vocab_size,
                 cfg.sample_bytes)
        tok, eot = train_on_sample(inputs, cfg.split(), cfg.vocab_size, cfg.sample_bytes), EOT
    atomic_write_text(out / "tokenizer.json", tok.to_str())
    vocab = tok.get_vocab_size()
    saved = Tokenizer.from_file(str(out / "tokenizer.json"))
    plan["tokenizer"] = {"file": "tokenizer.json", "sha256": tokenizer_hash(saved),
                         "vocab_size": vocab, "eot": eot, "eot_id": tok.token_to_id(eot),
                         "origin": cfg.tokenizer or f"byte-level BPE trained on ≤ {cfg.sample_bytes} bytes"}
    plan["dtype"] = "uint16" if vocab <= 1 << 16 else "uint32"
    atomic_write_json(path, plan)
    return plan


def prepare(sources: list[str], out: Path, cfg: PrepareConfig) -> dict:
    """Prepare `sources` into `out` (resuming a killed prepare); returns the manifest."""
    out = Path(out).expanduser()
    inputs = resolve_inputs(sources)
    if (out / MANIFEST).is_file() and (out / WORK / "plan.json").is_file():
        _plan(out, inputs, cfg)  # the same prepare, already complete
        return read_manifest(out)
    plan = _plan(out, inputs, cfg)
    tok_file = out / "tokenizer.json"
    if tokenizer_hash(Tokenizer.from_file(str(tok_file))) != plan["tokenizer"]["sha256"]:
        raise OptquantError(f"{tok_file} is not the tokenizer this prepare began with; delete {out} and start again")
    for s in SPLITS:
        (out / s).mkdir(parents=True, exist_ok=True)
    tasks = [Task(i, inp, str(out), str(tok_file), plan["tokenizer"]["eot_id"], plan["dtype"], cfg.split())
             for i, inp in enumerate(inputs)]
    todo = sorted((t for t in tasks if _read_record(out, t) is None), key=lambda t: -t.input.size)  # longest first
    log.info("%d of %d input files to tokenize", len(todo), len(tasks))
    if todo and cfg.executor == "local":
        _run_tasks(todo, cfg.processes)
    elif todo:
        _submit(todo, cfg, out / WORK / "submitit")
    records = [_read_record(out, t) for t in tasks]
    if any(r is None for r in records):
        raise OptquantError(f"{out}: some tasks did not finish (see {out / WORK}); run the same command again")
    return write_manifest(out, _manifest(plan, records))


def _manifest(plan: dict, records: list[dict]) -> dict:
    shards = {s: [{"file": r[s]["file"], "source": r["source"], **r[s]} for r in records if r[s]["file"]]
              for s in SPLITS}  # each: file, source, tokens, documents, sha256
    totals = {s: {k: sum(e[k] for e in shards[s]) for k in ("tokens", "documents")} for s in SPLITS}
    settings = plan["settings"]
    split = {"rule": SPLIT_RULE, **{k: settings[k] for k in ("val_fraction", "split_seed", "text_field")}}
    return {"tokenizer": plan["tokenizer"], "dtype": plan["dtype"], "split": split,
            "sources": [{"name": n, "bytes": b} for n, b in plan["inputs"]], "shards": shards, "totals": totals,
            "settings": settings}


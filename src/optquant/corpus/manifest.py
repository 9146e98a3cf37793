"""A prepared corpus as training reads it: the manifest, checked, and its shards memory-mapped as one stream.

`optquant data prepare` (corpus/prepare.py) writes a directory of token shards (`train/NNNNNN.bin`,
`val/NNNNNN.bin`: raw little-endian uint16, or uint32 for a vocabulary above 65,536, EOT after every
document; one shard per input file and split) and `manifest.json`, written last: its presence means the
directory is complete. The manifest names the tokenizer (`tokenizer.json` beside it, its sha256), the
split rule, the sources, and every shard's tokens, documents and sha256. Its `corpus_id` is the sha256
of the rest of it, so it identifies the corpus without reading a raw file again.

Opening checks, cheaply, everything a run relies on: the manifest against its own id (an edit), the
tokenizer's hash, every shard's size against its token count (a truncated or appended shard). A shard's
content hash is checked the first time it is opened with a given size and mtime on this machine (a stamp
under the token cache), so an edited shard is found once and a study's many runs do not re-read it.

`ShardedTokens` is the concatenation of a split's shards, memory-mapped (nothing is read until a window
is): `windows(starts, length)` gathers windows at any offsets, across shard boundaries. Several prepared
directories given together (`data.source=A,B`) are one stream each split, if their tokenizers agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optquant.errors import OptquantError
from optquant.files import atomic_write_json

MANIFEST = "manifest.json"
FORMAT = "optquant-prepared-corpus"
VERSION = 1
SPLITS = ("train", "val")


def is_prepared(source: str) -> bool:
    """Whether data.source names prepared directories (one, or several joined by commas)."""
    return source != "embedded" and all((Path(p).expanduser() / MANIFEST).is_file() for p in source.split(","))


def corpus_id(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "corpus_id"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_manifest(root: Path) -> dict:
    """The manifest of prepared directory `root`, checked against its id and for the fields training reads."""
    path = root / MANIFEST
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
        ok = (isinstance(m, dict) and m.get("format") == FORMAT and isinstance(m.get("shards"), dict)
              and all(isinstance(m["shards"].get(s), list) for s in SPLITS))
    except (OSError, ValueError) as e:
        raise OptquantError(f"{path}: not a readable manifest ({e}); prepare the corpus again") from None
    if not ok:
        raise OptquantError(f"{path}: not an optquant prepared-corpus manifest; prepare the corpus again")
    if m.get("version") != VERSION:
        raise OptquantError(f"{path}: manifest version {m.get('version')!r}, this optquant reads {VERSION}")
    if m.get("corpus_id") != corpus_id(m):
        raise OptquantError(f"{path} was edited after it was written (its corpus_id does not match its content); "
                            "prepare the corpus again")
    return m


@dataclass(frozen=True)
class Shard:
    path: Path
    tokens: int
    sha256: str


def check_shards(shards: list[Shard], itemsize: int, cid: str, cache: Path) -> None:
    """Every shard has the size its token count says; its content hash is checked once per (size, mtime)."""
    stamp_file = cache / "verified" / f"{cid}.json"
    try:
        stamps = json.loads(stamp_file.read_text())
    except (OSError, ValueError):
        stamps = {}
    changed = False
    for s in shards:
        try:
            st = s.path.stat()
        except OSError:
            raise OptquantError(f"{s.path}: a shard the manifest lists is missing; prepare the corpus again") from None
        if st.st_size != s.tokens * itemsize:
            raise OptquantError(f"{s.path} has {st.st_size} bytes but the manifest says {s.tokens} tokens "
                                f"({s.tokens * itemsize} bytes): truncated or edited; prepare the corpus again")
        key, seen = str(s.path.resolve()), [st.st_size, st.st_mtime_ns, s.sha256]
        if stamps.get(key) != seen:
            if file_sha256(s.path) != s.sha256:
                raise OptquantError(f"{s.path}: its content does not match the manifest's sha256 (edited); "
                                    "prepare the corpus again")
            stamps[key], changed = seen, True
    if changed:
        atomic_write_json(stamp_file, stamps)


class ShardedTokens:
    """One split of a prepared corpus: its shards as a single read-only token stream."""

    def __init__(self, shards: list[Shard], dtype: str):
        self.shards = [s for s in shards if s.tokens]
        self.dtype = np.dtype(dtype)
        self.begins = np.cumsum([0] + [s.tokens for s in self.shards])
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.begins[-1])

    def _map(self, i: int) -> np.ndarray:
        if i not in self._maps:
            shard = self.shards[i]
            self._maps[i] = np.memmap(shard.path, dtype=self.dtype, mode="r", shape=(shard.tokens,))
        return self._maps[i]

    def read(self, start: int, length: int) -> np.ndarray:
        """tokens[start : start + length] as int64, across shard boundaries."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside a stream of {len(self)}")
        out, i, done = np.empty(length, np.int64), int(np.searchsorted(self.begins, start, "right") - 1), 0
        while done < length:
            local = start + done - int(self.begins[i])
            piece = self._map(i)[local : local + length - done]
            out[done : done + piece.size] = piece
            done, i = done + piece.size, i + 1
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int64: the window at each start offset. Windows inside one shard are gathered
        per shard in one indexing; the few that cross a shard boundary are read piece by piece."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), np.int64)
        shard = np.searchsorted(self.begins, starts, "right") - 1
        local = starts - self.begins[shard]
        inside = local + length <= self.begins[shard + 1] - self.begins[shard]
        for i in np.unique(shard[inside]):
            rows = np.flatnonzero(inside & (shard == i))
            out[rows] = self._map(int(i))[local[rows, None] + np.arange(length)]
        for r in np.flatnonzero(~inside):
            out[r] = self.read(int(starts[r]), length)
        return out

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a prepared corpus is read by windows or contiguous slices")
        start, stop, _ = key.indices(len(self))
        return self.read(start, max(0, stop - start))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.read(0, len(self)).astype(dtype or np.int64, copy=False)


@dataclass(frozen=True)
class Prepared:
    """What data.load_tokens needs of one or more prepared directories."""

    train: ShardedTokens
    val: ShardedTokens
    tokenizer_file: Path
    vocab_size: int  # the tokenizer's
    eot_id: int
    corpus_id: str
    manifests: tuple[dict, ...]


def joint_id(manifests: list[dict] | tuple[dict, ...]) -> str:
    """The corpus_id of one prepared directory, or of several given together."""
    return manifests[0]["corpus_id"] if len(manifests) == 1 else \
        hashlib.sha256("".join(m["corpus_id"] for m in manifests).encode()).hexdigest()


def source_id(source: str) -> str:
    """The corpus_id of prepared `source` (comma-separated), from its manifests alone."""
    return joint_id([read_manifest(Path(p).expanduser()) for p in source.split(",")])


def open_prepared(source: str, cache: Path) -> Prepared:
    """The prepared directories of `source` (comma-separated), checked; one stream per split."""
    roots = [Path(p).expanduser() for p in source.split(",")]
    manifests = [read_manifest(r) for r in roots]
    first = manifests[0]["tokenizer"]
    for root, m in zip(roots[1:], manifests[1:], strict=True):
        if m["tokenizer"]["sha256"] != first["sha256"] or m["dtype"] != manifests[0]["dtype"]:
            raise OptquantError(f"{roots[0]} and {root} were prepared with different tokenizers (sha256 "
                                f"{first['sha256'][:12]} vs {m['tokenizer']['sha256'][:12]}); prepare both with "
                                "the same --tokenizer to train on them together")
    tok_file = roots[0] / first["file"]
    try:
        ok = file_sha256(tok_file) == first["sha256"]
    except OSError:
        ok = False
    if not ok:
        raise OptquantError(f"{tok_file}: missing or not the tokenizer the manifest names; prepare the corpus again")
    cid = joint_id(manifests)
    dtype = manifests[0]["dtype"]
    splits = {s: [Shard(r / e["file"], int(e["tokens"]), e["sha256"]) for r, m in zip(roots, manifests, strict=True)
                  for e in m["shards"][s]] for s in SPLITS}
    check_shards(splits["train"] + splits["val"], np.dtype(dtype).itemsize, cid, cache)
    for s in SPLITS:
        if not any(x.tokens for x in splits[s]):
            raise OptquantError(f"{source}: the {s} split is empty; prepare more documents or another --val-fraction")
    return Prepared(ShardedTokens(splits["train"], dtype), ShardedTokens(splits["val"], dtype), tok_file,
                    int(first["vocab_size"]), int(first["eot_id"]), cid, tuple(manifests))


def write_manifest(root: Path, manifest: dict) -> dict:
    """Seal `manifest` with its corpus_id and write it atomically, last."""
    manifest = {**manifest, "format": FORMAT, "version": VERSION}
    manifest["corpus_id"] = corpus_id(manifest)
    atomic_write_json(root / MANIFEST, manifest)
    return manifest


def train_tokens(source: str) -> int:
    """The training tokens of prepared `source`, from the manifest alone (the dry run's count)."""
    return sum(int(e["tokens"]) for p in source.split(",")
               for e in read_manifest(Path(p).expanduser())["shards"]["train"])


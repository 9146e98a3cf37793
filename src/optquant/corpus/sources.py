"""The files of a corpus to prepare, and their documents, streamed in bounded memory.

A source is a file, a directory (searched recursively) or a glob. The formats are those web corpora ship
in: `.txt` (documents separated by the literal `<|endoftext|>`, as data.py reads them), `.jsonl` and its
compressed forms `.jsonl.gz` / `.jsonl.zst` (one JSON object per line, the text in `text_field`), and
`.parquet`, read one record batch of one row group at a time, never a whole file (a ClimbMix or FineWeb
file is 1–2 GB). pyarrow decompresses gzip and zstd, so no codec package is needed.

A document's id is `<name>:<index>`: the file's name relative to its source, and the line, row or block
index counted over every line, row or block, kept or not (data.py's rule for a user's files, so the
train/val split by id hash is the same whether a directory is read raw or prepared). Empty and
whitespace-only documents and null fields are skipped. Damage is one error naming the file and the line,
row group or block: a malformed JSON line, a missing field, a damaged parquet file, invalid UTF-8.

Left out on purpose: remote file systems (s3://, hf://: copy or mount the files first), CSV, WARC/HTML
extraction, and splitting one file over several tasks (a task is one file; web corpora ship as many).
"""

from __future__ import annotations

import glob
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from optquant.errors import OptquantError

EOT = "<|endoftext|>"
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
BLOCK = 1 << 23  # bytes read at a time from a .txt file
BATCH_ROWS = 4096  # parquet rows per record batch

Document = tuple[str, str]  # (stable id, text)


class Input(NamedTuple):
    name: str  # relative to its source (a directory, a glob's fixed prefix, or a file's own directory)
    path: Path
    size: int  # bytes, recorded in the plan: a changed file is noticed on resume


def suffix(path: Path | str) -> str | None:
    """The supported suffix `path` ends in, or None."""
    name = str(path)
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def _under(root: Path) -> list[tuple[str, Path]]:
    return [(p.relative_to(root).as_posix(), p) for p in sorted(root.rglob("*")) if p.is_file() and suffix(p)]


def resolve_inputs(sources: list[str]) -> list[Input]:
    """Every input file of `sources`, sorted by name; a file reached twice counts once. Raises if a source
    matches nothing, a file has an unsupported type, or two different files get the same name."""
    found: dict[str, Path] = {}
    for source in sources:
        path = Path(source).expanduser()
        if glob.has_magic(source):  # names relative to the pattern's fixed prefix
            root = Path(*path.parts[: next(i for i, p in enumerate(path.parts) if glob.has_magic(p))])
            hits = [Path(p) for p in sorted(glob.glob(str(path), recursive=True))]
            files = [(h.relative_to(root).as_posix(), h) for h in hits if h.is_file() and suffix(h)]
            files += [(p.relative_to(root).as_posix(), p) for h in hits if h.is_dir() for _, p in _under(h)]
        elif path.is_dir():
            files = _under(path)
        elif path.is_file():
            if not suffix(path):
                raise OptquantError(f"{path}: unsupported file type; use one of {', '.join(SUFFIXES)}")
            files = [(path.name, path)]
        else:
            raise OptquantError(f"data source {source} " + ("is not a file or directory (a FIFO or device)"
                                                            if path.exists() else "does not exist"))
        if not files:
            raise OptquantError(f"no {', '.join(SUFFIXES)} files in {source}")
        for name, p in files:
            if name in found and found[name].resolve() != p.resolve():
                raise OptquantError(f"two input files are both named {name} ({found[name]} and {p}); give "
                                    "their common parent directory as the source instead")
            found[name] = p
    inputs = [Input(name, p, p.stat().st_size) for name, p in sorted(found.items())]
    for inp in inputs:
        if not inp.size:
            raise OptquantError(f"{inp.path} is empty (0 bytes): a failed download or copy? Remove it or replace it")
    return inputs


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OptquantError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _txt(inp: Input) -> Iterator[tuple[int, str | None]]:
    """Blocks between EOT markers. The marker is ASCII, so cutting the bytes at it never splits a character."""
    marker, index, tail = EOT.encode(), 0, b""
    with open(inp.path, "rb") as f:
        while chunk := f.read(BLOCK):
            parts = (tail + chunk).split(marker)
            tail = parts.pop()
            for part in parts:
                yield index, _utf8(part, f"{inp.path} block {index}")
                index += 1
    yield index, _utf8(tail, f"{inp.path} block {index}")


def _binary_lines(path: Path) -> io.BufferedReader:
    if path.name.endswith((".gz", ".zst")):
        import pyarrow as pa

        try:
            return io.BufferedReader(pa.input_stream(str(path), compression="detect"))
        except (pa.ArrowException, OSError) as e:
            raise OptquantError(f"{path}: cannot open the compressed stream ({str(e).splitlines()[0]})") from None
    return open(path, "rb")  # noqa: SIM115 - closed by the caller's with-block


def json_text(line: str, where: str, field: str, hint: str) -> str | None:
    """The `field` of one JSON line (None for a blank line or a null); errors name `where` (the file and line)."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise OptquantError(f"{where} is not valid JSON: {e.msg}") from None
    if not isinstance(row, dict) or field not in row:
        raise OptquantError(f"{where} has no field {field!r} ({hint})")
    if row[field] is not None and not isinstance(row[field], str):
        raise OptquantError(f"{where}: field {field!r} is not a string")
    return row[field]


def _jsonl(inp: Input, field: str) -> Iterator[tuple[int, str | None]]:
    import pyarrow as pa

    n = 0
    try:
        with _binary_lines(inp.path) as f:
            for n, raw in enumerate(f, start=1):
                where = f"{inp.path} line {n}"
                yield n - 1, json_text(_utf8(raw, where), where, field, "set --text-field")
    except (pa.ArrowException, OSError, EOFError) as e:  # a truncated or damaged compressed stream
        raise OptquantError(f"{inp.path}: damaged after line {n} ({str(e).splitlines()[0]})") from None


def _parquet(inp: Input, field: str) -> Iterator[tuple[int, str | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(inp.path)
    except (pa.ArrowException, OSError) as e:
        raise OptquantError(f"{inp.path} is not a readable parquet file ({str(e).splitlines()[0]})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise OptquantError(f"{inp.path} has no column {field!r} (columns: {', '.join(schema.names)}; "
                            "set --text-field)")
    tp = schema.field(field).type
    if not (pa.types.is_string(tp) or pa.types.is_large_string(tp)):
        raise OptquantError(f"{inp.path}: column {field!r} has type {tp}, not string")
    row = 0
    for group in range(pf.num_row_groups):
        try:
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=[field]):
                column = batch.column(0)
                column.validate(full=True)  # invalid UTF-8 is an ArrowInvalid here, not a wrong string later
                for text in column.to_pylist():
                    yield row, text
                    row += 1
        except (pa.ArrowException, OSError) as e:
            raise OptquantError(f"{inp.path} row group {group} (rows from {row}) is damaged or not UTF-8 "
                                f"({str(e).splitlines()[0]})") from None


def documents(inp: Input, field: str) -> Iterator[Document]:
    """The non-empty documents of one input file as (id, text), in file order, streamed."""
    kind = suffix(inp.path)
    blocks = _txt(inp) if kind == ".txt" else _parquet(inp, field) if kind == ".parquet" else _jsonl(inp, field)
    for index, text in blocks:
        if text is not None and text.strip():
            yield f"{inp.name}:{index}", text

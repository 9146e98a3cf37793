"""Reading and writing the files a run or study leaves behind, and reading the user's TOML: a damaged file is
one error naming it, never a traceback; every write is atomic.

A file is written in a temporary directory `.<name>.<host>.<pid>.<random>.tmp` beside its target, given
the mode the umask asks for (never the 0600 of temp files), then renamed into place. A writer removes
its temporary when it fails; one killed with SIGKILL leaves it, and the next write of the same target
removes it (its pid is dead).

Light on imports (no torch; pandas only for parquet) so that the report and the config can use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import shutil
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optquant.errors import OptquantError

if TYPE_CHECKING:
    import pandas as pd

NUMBER = (int, float)  # a number (check_record: never a bool)


def finite_json(obj: Any) -> Any:
    """`obj` with every NaN/±inf float replaced by None: JSON has no such numbers (json.dumps would
    write `Infinity`, which strict parsers reject)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


def open_nofollow(path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open that never follows a symbolic link planted at `path` (a shared, group-writable directory):
    a link there is one error naming it, and its target is left untouched."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.EEXIST and Path(path).is_symlink()):
            raise OptquantError(f"{path} is a symbolic link; optquant never writes through one (remove it "
                                "and rerun)") from None
        raise


def check_record(where: Path | str, record: dict, fields: dict[str, tuple[type, ...]], hint: str = "",
                 finite: bool = True) -> None:
    """Each of `fields` present in `record` has one of its types (bool is not a number; with `finite`,
    neither is NaN or ±inf): the types its writer guarantees. Another type is an error naming the file
    (`where`) and the field."""
    for name, types in fields.items():
        value = record.get(name)
        if name in record and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
                               or (finite and isinstance(value, float) and not math.isfinite(value))):
            raise OptquantError(f"{where}: field {name!r} is {value!r}, not what optquant writes "
                                f"({' or '.join('null' if t is type(None) else t.__name__ for t in types)}){hint}")


MAX_TEXT_BYTES = 64 << 20  # a JSON or TOML file read whole: far above any optquant writes or a user types


def regular_file(path: Path, kind: str) -> int:
    """The size of `path`, a regular file; missing, a directory, a FIFO or a device (whose read may block or never
    end: /dev/zero) is one error naming what it is."""
    try:
        mode, size = (st := os.stat(path)).st_mode, st.st_size
    except FileNotFoundError:
        raise OptquantError(f"{path}: file not found") from None
    if not stat.S_ISREG(mode):
        raise OptquantError(f"{path}: is {_what(mode)}, not a {kind} file")
    return size


def _what(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")


def read_text(path: Path, kind: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a `kind` ("JSON", "TOML") file; not a regular file, over `limit` bytes or not UTF-8 is
    one error."""
    if (size := regular_file(path, kind)) > limit:
        raise OptquantError(f"{path}: {size:,} bytes, too large for a {kind} file (at most {limit >> 20} MB)")
    try:
        return Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise OptquantError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise OptquantError(f"{path}: is a directory, not a {kind} file") from None
    except UnicodeDecodeError as e:
        raise OptquantError(f"{path}: not valid {kind} (not UTF-8: {e.reason} at byte {e.start})") from None


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path, "JSON"))
    except json.JSONDecodeError as e:
        raise OptquantError(f"{path}: not valid JSON ({e})") from None


def read_parquet(path: Path) -> pd.DataFrame:
    """A parquet file as a DataFrame; a missing, truncated or foreign file is one clear error."""
    import pandas as pd
    import pyarrow as pa

    try:
        return pd.read_parquet(path)
    except FileNotFoundError:
        raise OptquantError(f"{path}: file not found") from None
    except (pa.ArrowException, OSError, ValueError) as e:
        raise OptquantError(f"{path}: not a readable parquet file ({str(e).splitlines()[0] if str(e) else e!r})") \
            from None


def check_numeric_columns(df: pd.DataFrame, path: Path, columns: tuple[str, ...]) -> None:
    """Each of `columns` (where present) holds numbers or nulls, as the study's writer guarantees: a string
    in a value column is an error naming the file, column and row, never a table gone blank."""
    import pandas as pd

    for column in (c for c in columns if c in df.columns):
        values = df[column]
        bad = values.notna() if values.dtype == bool else values.notna() & pd.to_numeric(values, errors="coerce").isna()
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            raise OptquantError(f"{path}: column {column!r} holds {values.iloc[row]!r} at row {row}, not a number; "
                                "rerun optquant study to rewrite it")


def parse_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. An unparsable *last* line is an append cut short by a crash and is
    dropped (the resumed run recomputes it); damage anywhere else is an error naming the line."""
    try:
        lines = [ln for ln in Path(path).read_bytes().decode("utf-8", "replace").split("\n") if ln.strip()]
    except FileNotFoundError:
        return []
    records = []
    for n, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] < 0:
                raise ValueError("not an evaluation record")
        except ValueError as e:
            if n == len(lines):
                break
            raise OptquantError(f"{path} line {n} is corrupt ({e}); delete the run directory to retrain") from None
        check_record(f"{path} line {n}", record, dict.fromkeys(("train_loss", "val_loss", "lr", "tokens"), NUMBER),
                     "; delete the run directory to retrain", finite=False)  # a diverged run logs inf
        records.append(record)
    return records


# ---- atomic writes
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def temp_path(path: Path) -> Path:
    """A fresh temporary name beside `path` (not created); stale ones of killed writers on this host (their pid
    no longer runs) are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}.{socket.gethostname()}."
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        rest = tmp.name[len(prefix):].split(".") if tmp.name.startswith(prefix) else []
        if len(rest) == 3 and rest[0].isdigit() and not _pid_alive(int(rest[0])):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
    return path.parent / f"{prefix}{os.getpid()}.{secrets.token_hex(4)}.tmp"


def umask() -> int:
    """The process's umask, read without changing it where Linux allows (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Any) -> None:
    """Call `write(tmp)` to create the file at `tmp`, then rename it over `path` atomically.

    `tmp` lies in a private temporary directory beside `path`, so that whatever a writer (or a library
    under it, like safetensors with its own temporaries) leaves on a kill is one directory with a name
    the next write recognises and removes. The file gets mode 0o666 & ~umask, like any file the user
    creates. The temporary is removed if anything fails; a full disk is reported as such, naming the file.
    A directory, FIFO, device or socket at `path` is refused, not replaced (as root, `--recipe /dev/full` once
    put a file in place of the device)."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if not stat.S_ISREG(mode := os.lstat(path).st_mode) and not stat.S_ISLNK(mode):
            raise OptquantError(f"{path}: is {_what(mode)}; optquant writes a file there (choose a file path)")
    tmp_dir = temp_path(path)
    tmp_dir.mkdir()
    tmp = tmp_dir / path.name
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is not None and str(tmp_dir) in str(e.filename):  # name the file the user knows
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _write_text(tmp: Path, text: str) -> None:
    with open(tmp, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: _write_text(tmp, text))


def atomic_write_json(path: Path, obj: Any) -> None:
    text = json.dumps(finite_json(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
    atomic_write_text(path, text + "\n")


def write_parquet(path: Path, df: pd.DataFrame) -> None:
    atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))

"""Reading the files a run or study leaves behind, and the user's TOML: a damaged file is one error naming
it, never a traceback.

Light on imports (no torch; pandas only for parquet) so that the report and the config can use it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optquant.errors import OptquantError

if TYPE_CHECKING:
    import pandas as pd


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


def read_text(path: Path, kind: str) -> str:
    """The UTF-8 text of a `kind` ("JSON", "TOML") file; missing, a directory or not UTF-8 is one error."""
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
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an evaluation record")
        except ValueError as e:
            if n == len(lines):
                break
            raise OptquantError(f"{path} line {n} is corrupt ({e}); delete the run directory to retrain") from None
        records.append(record)
    return records

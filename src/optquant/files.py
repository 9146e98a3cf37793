"""Reading the files a run or study leaves behind: a damaged file is one error naming it, never a traceback.

Light on imports (pandas, no torch) so that the report can use it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from optquant.errors import OptquantError


def read_parquet(path: Path) -> pd.DataFrame:
    """A parquet file as a DataFrame; a missing, truncated or foreign file is one clear error."""
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

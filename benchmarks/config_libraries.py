"""The configuration-library candidates of issue 29 (pydantic v2, msgspec), as docs/benchmarks.md reports them.

    python benchmarks/config_libraries.py

Import time: fresh `python -c "import X"` processes, interleaved, median of 15, less the median of a process that
imports only tomllib (which config.py imports anyway). Errors: the text each library gives for three bad inputs.
"""

import statistics
import subprocess
import sys
import time
from typing import Annotated

ROUNDS = 15


def import_seconds(module: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - start


def main() -> None:
    import msgspec
    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    times: dict[str, list[float]] = {"pydantic": [], "msgspec": [], "tomllib": []}
    for _ in range(ROUNDS):
        for module, seconds in times.items():
            seconds.append(import_seconds(module))
    base = statistics.median(times["tomllib"])
    extra = {m: statistics.median(s) - base for m, s in times.items() if m != "tomllib"}
    for module, seconds in extra.items():
        print(f"import {module}: +{seconds * 1000:.0f} ms (median of {ROUNDS}, over python + tomllib)")
    print(f"ratio pydantic / msgspec: {extra['pydantic'] / extra['msgspec']:.1f}")

    class Strict(BaseModel):
        model_config = ConfigDict(strict=True, frozen=True, extra="forbid")
        name: str = "adamw"
        w_bits: int = 4
        lr: Annotated[float, Field(gt=0)] = 1e-3

    class Struct(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        name: str = "adamw"
        w_bits: int = 4
        lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-3

    for bad in ({"name": ["muon"]}, {"w_bits": "4"}, {"lr": -1.0}):
        try:
            Strict(**bad)
        except ValidationError as e:
            error, lines = e.errors()[0], len(str(e).splitlines())
            print(f"pydantic {bad}: {'.'.join(map(str, error['loc']))}: {error['msg']} (str(e): {lines} lines)")
        try:
            msgspec.convert(bad, Struct)
        except msgspec.ValidationError as e:
            print(f"msgspec {bad}: {e}")


if __name__ == "__main__":
    main()

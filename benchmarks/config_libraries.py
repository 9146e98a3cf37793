"""The configuration-library candidates of issue 29 (pydantic v2, msgspec), as docs/benchmarks.md reports them.

    python benchmarks/config_libraries.py [--lines]

Import time: fresh `python -c "import X"` processes, interleaved, median of 15, less the median of a process that
imports only tomllib (which config.py imports anyway). Errors: the text each library gives for three bad inputs.
Lines: config.py's library-specific functions (`_convert`, `_choices`, `parse_value` on msgspec) against the same two
written on pydantic (`pydantic_convert`, `pydantic_parse_value` below: the prototype behind the choice), and the
messages each gives on a real RunConfig.
"""

import contextlib
import inspect
import json
import math
import statistics
import subprocess
import sys
import time
import typing
from typing import Annotated, Any

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


def pydantic_convert(cls: type, data: Any, prefix: str = "") -> Any:
    """config._convert on pydantic: strict validation of a dict needs its JSON mode (strict Python mode wants an
    instance of the dataclass, and refuses a list for a tuple), so the optimizer object and NaN cannot pass through."""
    import pydantic

    from optquant.errors import OptquantError

    try:
        return pydantic.TypeAdapter(cls).validate_json(json.dumps(data), strict=True)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        raise OptquantError(f"{prefix}{'.'.join(map(str, error['loc']))}={error['input']!r}: {error['msg']}") from None


def pydantic_parse_value(value: str, tp: Any, path: str) -> Any:
    """config.parse_value on pydantic's lax mode (which reads yes/no and on/off itself, but not 1e3 as an int)."""
    import pydantic

    from optquant.errors import OptquantError

    text = value.strip()
    if typing.get_origin(tp) in (tuple, list):
        text = [v.strip() for v in text.strip("()[]").split(",") if v.strip()]
    try:
        out = pydantic.TypeAdapter(tp).validate_python(text)
    except pydantic.ValidationError as e:
        if isinstance(text, str) and text.lower() in ("none", "null"):
            with contextlib.suppress(pydantic.ValidationError):
                return pydantic.TypeAdapter(tp).validate_python(None)
        raise OptquantError(f"--set {path}={value}: {e.errors()[0]['msg']}") from None
    if any(isinstance(v, float) and not math.isfinite(v) for v in (out if isinstance(out, tuple | list) else [out])):
        raise OptquantError(f"--set {path}={value}: must be a finite number")
    return out


def lines() -> None:
    from optquant import config

    ours = sum(len(inspect.getsource(f).splitlines()) for f in (config._convert, config._choices, config.parse_value))
    theirs = sum(len(inspect.getsource(f).splitlines()) for f in (pydantic_convert, pydantic_parse_value))
    print(f"library-specific lines: msgspec {ours + 1} (with _WORDS), pydantic {theirs} (docstrings included)")
    from optquant.errors import OptquantError

    for value in ("fp8", 1e3):
        for convert in (pydantic_convert, config._convert):
            try:
                convert(config.TrainConfig, {"precision": value} if value == "fp8" else {"steps": "1e3"}, "train.")
            except OptquantError as e:
                print(f"{convert.__name__}: {e}")
    print("pydantic --set 1e3 as an int:", end=" ")
    try:
        print(pydantic_parse_value("1e3", int, "train.steps"))
    except OptquantError as e:
        print(e)
    print("msgspec --set 1e3 as an int:", config.parse_value("1e3", int, "train.steps"))


if __name__ == "__main__":
    main() if "--lines" not in sys.argv else lines()

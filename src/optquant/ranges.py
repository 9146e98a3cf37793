"""Value ranges of config fields, declared in their annotations (`lr: Positive = 3e-3`): msgspec checks them
whenever a config is built (config.py) and docs/configuration.py prints them. A field without one has only its
type checked (and a float must be finite). Ranges used once are written where the field is (`Meta(ge=2)`).
"""

import argparse
import math
from typing import Annotated

from msgspec import Meta

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
Unit = Annotated[float, Meta(ge=0, lt=1)]  # [0, 1): a momentum, a beta, a fraction of the steps
Probability = Annotated[float, Meta(gt=0, le=1)]  # (0, 1]
Count = Annotated[int, Meta(ge=1)]
Natural = Annotated[int, Meta(ge=0)]
NonEmpty = Annotated[str, Meta(min_length=1)]
SEED_MAX = 2**31 - 1  # numpy seeds must fit 32 bits; offsets are added to a run's seed
Seed = Annotated[int, Meta(ge=0, le=SEED_MAX)]


def flag(tp):
    """An argparse `type=` for a command-line flag that means a config field: its text converted and range-checked
    by msgspec as the field's `--set` value is (`--limit -1` → `argument --limit: -1: Expected `int` >= 0`)."""
    import msgspec

    def parse(text: str):
        try:
            value = msgspec.convert(text, tp, strict=False)
        except msgspec.ValidationError as e:
            raise argparse.ArgumentTypeError(f"{text}: {e}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number")
        return value

    return parse

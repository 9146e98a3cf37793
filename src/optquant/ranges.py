"""Value ranges of config fields, declared in their annotations (`lr: Positive = 3e-3`): msgspec checks them
whenever a config is built (config.py) and docs/configuration.py prints them. A field without one has only its
type checked (and a float must be finite). Ranges used once are written where the field is (`Meta(ge=2)`).
"""

from typing import Annotated

from msgspec import Meta

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
Unit = Annotated[float, Meta(ge=0, lt=1)]  # [0, 1): a momentum, a beta, a fraction of the steps
Probability = Annotated[float, Meta(gt=0, le=1)]  # (0, 1]
Count = Annotated[int, Meta(ge=1)]
Natural = Annotated[int, Meta(ge=0)]
NonEmpty = Annotated[str, Meta(min_length=1)]
Seed = Annotated[int, Meta(ge=0, le=2**31 - 1)]  # numpy seeds must fit 32 bits; offsets are added to it

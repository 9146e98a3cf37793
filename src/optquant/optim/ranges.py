"""Value ranges of config fields, as `config.validate` checks them: (low, high, low inclusive, high inclusive).

An optimizer config declares its fields' ranges in `RANGES: ClassVar[dict[str, Range]]`, by field name;
`lr` is checked for every optimizer (config.py). A field without a range has only its type checked.
"""

import math

Range = tuple[float, float, bool, bool]
POSITIVE: Range = (0.0, math.inf, False, False)
NONNEG: Range = (0.0, math.inf, True, False)
ONE_UP: Range = (1, math.inf, True, False)
UNIT: Range = (0.0, 1.0, True, False)  # [0, 1)
PROBABILITY: Range = (0.0, 1.0, False, True)  # (0, 1]

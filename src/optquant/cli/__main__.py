"""`python -m optquant.cli`, as the console script runs it."""

import sys

from optquant.cli import main

sys.exit(main())

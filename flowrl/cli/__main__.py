"""`python -m flowrl.cli ...`: the same as `flowrl ...`."""

import sys

from flowrl.cli import main

sys.exit(main())

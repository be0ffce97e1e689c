"""The experiments in benchmarks/ are scripts, not a package: put their folder on the path so that
their tests can import them (as `python benchmarks/<script>.py` does for the scripts themselves)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

"""Fixtures of the rollout-server tests (helpers in rollout_server_helpers.py)."""

from __future__ import annotations

import pytest
from rollout_server_helpers import serving


@pytest.fixture(scope="module")
def served(tiny_sd3_path):
    """One server for a test module's tests that leave its weights alone."""
    with serving(tiny_sd3_path) as server:
        yield server

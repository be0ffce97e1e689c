"""Style holds without anyone remembering it: the tree is ruff-formatted and ruff's lint rules
(pyproject.toml, [tool.ruff]) pass. Fix a failure with `ruff format . && ruff check --fix .`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff is part of the test extras: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_tree_is_ruff_formatted():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}{result.stderr}"


def test_ruff_lint_passes():
    result = _ruff("check", ".")
    assert result.returncode == 0, f"run `ruff check --fix .`:\n{result.stdout}{result.stderr}"

"""Shared by the toy models' tests: a folder's files by content, to compare two builds."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder`."""
    return {
        str(file.relative_to(folder)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(folder.rglob("*"))
        if file.is_file()
    }

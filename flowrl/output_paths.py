"""The rule every flowrl command follows before it writes a folder or a file.

A command writes into a folder only when the folder is missing, empty, or marked as written by that
same command: it leaves a marker file (`.flowrl-<command>`, e.g. `.flowrl-tiny`) listing the files
it wrote. Anything else, for example a real checkpoint someone points `make-tiny` at, is refused
with `OutputExistsError`, whose message names the folder and the `--overwrite` flag. A single output
file that already exists is refused the same way, and a path that cannot be written (under a file,
in a folder without write permission) with a ValueError naming it, before anything is built. With overwrite, flowrl writes its files next to
(and over same-named) existing ones; it never deletes a file it did not write.

It knows paths and markers only, nothing about what the commands write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class OutputExistsError(ValueError):
    """The output path holds things flowrl did not write; the message names the path and the flag."""


def marker_path(folder: str | Path, command: str) -> Path:
    return Path(folder) / f".flowrl-{command}"


def read_marker(folder: str | Path, command: str) -> dict | None:
    """What `write_marker` recorded in `folder` for `command`, or None (no marker, or unreadable)."""
    try:
        record = json.loads(marker_path(folder, command).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_marker(folder: str | Path, command: str, files: list[str], **info) -> None:
    """Mark `folder` as written by `command`; `files` are the relative paths it wrote."""
    record = {**info, "files": sorted(files)}
    marker_path(folder, command).write_text(json.dumps(record, indent=1) + "\n")


def is_foreign_folder(folder: str | Path, command: str) -> bool:
    """True when `folder` exists and holds anything while carrying no marker of `command`."""
    folder = Path(folder)
    if not folder.exists():
        return False
    if not folder.is_dir():
        return True
    return any(folder.iterdir()) and read_marker(folder, command) is None


def check_writable(path: str | Path) -> None:
    """ValueError naming `path` when it cannot be created or written: its nearest existing folder is
    a file, or not writable. Checked before anything is built, so a long job never ends in a
    traceback at its first write."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing != path and not existing.is_dir():
        raise ValueError(f"{path} cannot be created: {existing} is a file, not a folder; choose another output path")
    folder = existing if existing.is_dir() else existing.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{path} cannot be written: {folder} is not writable by you; choose a folder you can write to")


def check_output_folder(folder: str | Path, command: str, overwrite: bool, flag: str = "--overwrite") -> None:
    """Raise OutputExistsError when `command` may not write into `folder` (see the module docstring),
    ValueError when it cannot be written at all (`check_writable`)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputExistsError(f"{folder} is a file, not a folder; choose another output folder")
    check_writable(folder)
    if overwrite or not is_foreign_folder(folder, command):
        return
    names = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise OutputExistsError(
        f"{folder} is not empty ({shown}) and has no {marker_path(folder, command).name} marker, so flowrl did not "
        f"write it; choose an empty or new folder, or pass {flag} to write into it (files of the same name are "
        "replaced, nothing else is deleted)"
    )


def prepare_output_folder(folder: str | Path, command: str, overwrite: bool, flag: str = "--overwrite") -> Path:
    """`check_output_folder`, then delete the files `command`'s marker lists (its previous output: a
    re-run replaces it whole, no stale file stays behind); returns the folder, created."""
    check_output_folder(folder, command, overwrite, flag)
    folder = Path(folder)
    previous = read_marker(folder, command)
    if previous is not None:
        remove_listed_files(folder, previous.get("files", []))  # the marker stays until the new one replaces it
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def check_output_file(path: str | Path, overwrite: bool, flag: str = "--overwrite") -> None:
    """Raise OutputExistsError when `path` exists and overwrite is off, ValueError when it cannot
    be written (`check_writable`)."""
    path = Path(path)
    if path.is_dir():
        raise OutputExistsError(f"{path} is a folder; pass a file path")
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{path} already exists; choose another path, or pass {flag} to replace it")
    check_writable(path)


def file_sizes(folder: str | Path) -> dict[str, int]:
    """{relative path: size} of every file under `folder`, markers excluded ({} when it is missing)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {
        file.relative_to(folder).as_posix(): file.stat().st_size
        for file in folder.rglob("*")
        if file.is_file() and not file.name.startswith(".flowrl-")
    }


def remove_listed_files(folder: str | Path, names: list[str]) -> None:
    """Delete the files a marker listed (inside `folder` only), then the folders this left empty."""
    root = Path(folder).resolve()
    for name in names:
        file = (root / name).resolve()
        if root not in file.parents:
            continue
        file.unlink(missing_ok=True)
        for parent in file.parents:
            if parent == root or not parent.is_dir() or any(parent.iterdir()):
                break
            parent.rmdir()

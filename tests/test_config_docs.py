"""The configuration reference has one home, the field docstrings: every field of every section
has one, and docs/config.md's tables are exactly what they generate (flowrl.config.reference)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flowrl.config.reference import BLOCK, documented_sections, field_docs, render, section_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_every_field_has_a_docstring_and_a_row():
    for path in documented_sections():
        table = section_table(path)  # raises naming an undocumented field
        assert table.count("\n| `") == table.count("\n") - 2, path


def test_the_config_page_is_what_the_docstrings_generate():
    text = PAGE.read_text()
    assert render(text) == text, "run `flowrl config docs --write docs/config.md`"
    generated = {m.group(2) for m in BLOCK.finditer(text)}
    assert generated == {*documented_sections(), "removed"} - {"rollout.val_sampling"}


def test_field_docs_reads_the_string_under_each_field_only():
    @dataclasses.dataclass
    class Section:
        documented: int = 1
        """Has one."""
        bare: int = 2

    assert field_docs(Section) == {"documented": "Has one."}


def test_config_docs_write_rewrites_only_the_generated_blocks(tmp_path):
    from flowrl.cli import main

    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- generated: config.trainer.ema -->\nstale\n<!-- end generated -->\noutro\n")
    assert main(["config", "docs", "--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "stale" not in text
    assert "| `update_every` | `8` |" in text
    with pytest.raises(SystemExit):
        main(["config", "docs", "--bogus"])

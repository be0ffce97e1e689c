"""`flowrl data ocr`: quoted target text in every prompt, ground truth, determinism, the CLI."""

from __future__ import annotations

import json

import pytest

from flowrl.cli import main
from flowrl.data.ocr_prompts import SCENE_TEMPLATES, make_ocr_rows
from flowrl.data.ocr_words import OCR_WORDS


def test_rows_quote_their_ground_truth_from_our_word_list():
    rows = make_ocr_rows(300, seed=0)
    words = set(OCR_WORDS)
    for row in rows:
        assert set(row) == {"prompt", "ground_truth", "data_source"} and row["data_source"] == "ocr"
        assert row["prompt"].count(f'"{row["ground_truth"]}"') == 1
        assert row["prompt"].count('"') == 2  # exactly one quoted span: the target is unambiguous
        assert all(word.lower() in words for word in row["ground_truth"].split())
    assert len({row["ground_truth"] for row in rows}) > 250  # varied targets
    assert len({row["prompt"].replace(row["ground_truth"], "") for row in rows}) == len(SCENE_TEMPLATES)
    assert len(set(OCR_WORDS)) == len(OCR_WORDS)
    assert all(3 <= len(word) <= 8 and word.isalpha() and word.islower() for word in OCR_WORDS)


def test_same_seed_same_rows_other_seed_other_rows():
    assert make_ocr_rows(20, seed=3) == make_ocr_rows(20, seed=3)
    assert make_ocr_rows(20, seed=3) != make_ocr_rows(20, seed=4)
    with pytest.raises(ValueError, match="num_rows"):
        make_ocr_rows(0)


def test_cli_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "sub" / "ocr.jsonl"
    assert main(["data", "ocr", "--num", "7", "--out", str(out), "--seed", "5"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == make_ocr_rows(7, seed=5)
    assert "wrote 7 rows" in capsys.readouterr().out
    assert main(["data", "ocr", "--num", "0", "--out", str(tmp_path / "bad.jsonl")]) == 2

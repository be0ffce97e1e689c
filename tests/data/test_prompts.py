"""Prompt datasets (txt, jsonl, parquet) and the resumable prompt sampler."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrl.data.prompts import TINY_PROMPTS, PromptSampler, load_prompt_rows

ROWS = [
    {"prompt": 'a sign that says "OPEN"', "ground_truth": "OPEN", "data_source": "ocr", "level": 1},
    {"prompt": "a cat", "negative_prompt": "blurry"},
]


def _check(rows):
    assert [r["raw_prompt"] for r in rows] == [r["prompt"] for r in ROWS]
    assert rows[0]["ground_truth"] == "OPEN" and rows[0]["data_source"] == "ocr" and rows[0]["level"] == 1
    assert rows[1]["negative_prompt"] == "blurry" and rows[1]["ground_truth"] is None
    assert rows[1]["data_source"] == "default"


def test_jsonl_and_parquet_keep_the_standard_fields(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    _check(load_prompt_rows(jsonl))
    parquet = tmp_path / "p.parquet"
    columns = {key: [row.get(key) for row in ROWS] for key in dict.fromkeys(k for row in ROWS for k in row)}
    pq.write_table(pa.Table.from_pydict(columns), parquet)
    _check(load_prompt_rows(parquet))


def test_txt_custom_field_and_limits(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\nthird\n")
    assert [r["raw_prompt"] for r in load_prompt_rows(txt, max_prompts=2)] == ["first", "second"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"caption": "x"}) + "\n")
    assert load_prompt_rows(jsonl, prompt_field="caption")[0]["raw_prompt"] == "x"
    with pytest.raises(ValueError, match="data.prompt_field"):
        load_prompt_rows(jsonl)
    assert len(load_prompt_rows(None)) == len(TINY_PROMPTS)


def test_bad_jsonl_line_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_prompt_rows(bad)


def test_sampler_covers_each_epoch_and_resumes_exactly():
    rows = [{"raw_prompt": f"p{i}"} for i in range(7)]
    sampler = PromptSampler(rows, prompts_per_step=3, shuffle=True, seed=5)
    straight = [[r["raw_prompt"] for r in sampler.next_rows()] for _ in range(7)]  # 21 rows = 3 epochs
    flat = [p for step in straight for p in step]
    for epoch in range(3):
        assert sorted(flat[epoch * 7 : (epoch + 1) * 7]) == sorted(r["raw_prompt"] for r in rows)
    assert flat[:7] != flat[7:14]  # reshuffled per epoch
    assert sampler.epochs_done == 3

    first = PromptSampler(rows, 3, True, 5)
    for _ in range(4):
        first.next_rows()
    resumed = PromptSampler(rows, 3, True, 5)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [[r["raw_prompt"] for r in resumed.next_rows()] for _ in range(3)] == straight[4:]
    with pytest.raises(ValueError, match="dataset of 7 prompts"):
        PromptSampler(rows[:5], 3).load_state_dict(first.state_dict())

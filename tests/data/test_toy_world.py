"""The toy world: captions read back to what wrote them, scenes fit their captions exactly and
repeat for a seed, the split keeps RL and evaluation prompts apart from pretraining and from each
other, and `flowrl data toy` writes prompt files the trainer reads."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from flowrl.cli import main
from flowrl.data.prompts import load_prompt_rows
from flowrl.data.toy_render import render_caption, render_scene, sample_scene
from flowrl.data.toy_split import (
    HELD_OUT_PAIRS,
    VAL_EXTRA,
    VAL_QUOTAS,
    all_captions,
    names_held_out_pair,
    pretraining_examples,
    prompt_rows,
    split_captions,
)
from flowrl.data.toy_world import CATEGORIES, COLOURS, SHAPES, Caption, Group, parse_caption, world_words


def test_every_caption_reads_back_to_itself_and_has_its_category():
    captions = all_captions()
    assert set(captions) == set(CATEGORIES)
    for category, group in captions.items():
        for caption in group:
            assert caption.category == category
            assert parse_caption(caption.text) == caption
            assert parse_caption("  " + caption.text.upper() + " ") == caption
            assert set(caption.text.split()) <= set(world_words())
    assert len(COLOURS) >= 6 and len(SHAPES) >= 3
    assert parse_caption("an orange square").groups == (Group(1, "orange", "square"),)
    assert parse_caption("three blue squares").text == "three blue squares"


@pytest.mark.parametrize(
    "text, message",
    [
        ("a pink circle", "unknown colour 'pink'"),
        ("a red hexagon", "unknown shape 'hexagon'"),
        ("three red circle", "mixes singular and plural"),
        ("red circle", "should be 'a', 'an' or a number"),
        ("a red circle and", "an object is missing"),
        ("a red circle and a red circle", "could be the same objects"),
        ("four red circles and a blue square", "at most 4"),
        ("two red circles to the left of a square", "one object relative to one other"),
        ("", "is empty"),
    ],
)
def test_bad_captions_are_named_with_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_caption(text)
    assert repr(text) in str(error.value)


def test_scenes_repeat_for_a_seed_and_draw_exactly_the_palette():
    caption = parse_caption("a red circle to the left of a blue square")
    first, again = render_caption(caption, seed=7), render_caption(caption, seed=7)
    assert first.shape == (48, 48, 3) and first.dtype == np.uint8
    assert np.array_equal(first, again) and not np.array_equal(first, render_caption(caption, seed=8))
    colours = {tuple(pixel) for pixel in first.reshape(-1, 3)}
    assert colours == {(255, 255, 255), COLOURS["red"], COLOURS["blue"]}  # no anti-aliasing


def test_scene_objects_keep_apart_and_inside_and_follow_the_relation():
    rng = random.Random(0)
    for relation in ("left_of", "right_of", "above", "below"):
        caption = Caption((Group(1, "red", "circle"), Group(1, "blue", "square")), relation)
        for _ in range(50):
            a, b = sample_scene(caption, rng)
            (ax, ay), (bx, by) = a.center, b.center
            along = {"left_of": bx - ax, "right_of": ax - bx, "above": by - ay, "below": ay - by}[relation]
            assert along > (a.size + b.size) / 2
    for _ in range(50):
        objects = sample_scene(parse_caption("four yellow triangles"), rng)
        assert len(objects) == 4
        for obj in objects:
            assert 0 <= obj.x0 and obj.x0 + obj.size <= 48 and 0 <= obj.y0 and obj.y0 + obj.size <= 48
    assert render_scene(objects).shape == (48, 48, 3)


def test_split_is_disjoint_and_rl_prompts_are_novel():
    split = split_captions()
    pretrain, train, val = (set(split[name]) for name in ("pretrain", "train", "val"))
    assert not (pretrain & train) and not (pretrain & val) and not (train & val)
    assert len(val) == sum(VAL_QUOTAS.values()) + sum(VAL_EXTRA.values()) == 192 and len(train) > 3 * len(val)
    assert not any(names_held_out_pair(caption) for caption in pretrain)
    # Both RL sets ask for held-out pairs and for unseen compositions of familiar ones.
    for rl_set in (train, val):
        assert any(names_held_out_pair(c) for c in rl_set) and not all(names_held_out_pair(c) for c in rl_set)
    assert {c.category for c in val} == set(VAL_QUOTAS)
    assert split_captions() == split  # fixed


def test_pretraining_never_draws_a_held_out_pair():
    from flowrl.rewards.shapes import detect_objects

    seen = set()
    for text, picture in pretraining_examples(300, seed=3):
        objects = detect_objects(picture)
        assert len(objects) == parse_caption(text).num_objects
        seen |= {(obj.colour, obj.shape) for obj in objects}
    assert not (seen & HELD_OUT_PAIRS) and len(seen) >= 10
    assert [text for text, _ in pretraining_examples(20, seed=3)] == [
        text for text, _ in pretraining_examples(20, seed=3)
    ]


def test_cli_writes_the_splits_as_prompt_files(tmp_path, capsys):
    val = tmp_path / "toy_val.jsonl"
    assert main(["data", "toy", "--split", "val", "--out", str(val)]) == 0
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    assert rows == prompt_rows("val")
    assert all(row["prompt"] == row["ground_truth"] and row["data_source"] == "toy" for row in rows)
    # The first rows already cover every category (interleaved).
    assert {row["category"] for row in rows[:8]} == set(VAL_QUOTAS)
    loaded = load_prompt_rows(val)
    assert [row["raw_prompt"] for row in loaded] == [row["prompt"] for row in rows]
    assert loaded[0]["ground_truth"] == rows[0]["ground_truth"]
    train = tmp_path / "toy_train.jsonl"
    assert main(["data", "toy", "--split", "train", "--out", str(train), "--num", "5"]) == 0
    assert len(train.read_text().splitlines()) == 5
    assert main(["data", "toy", "--split", "pretrain", "--out", str(tmp_path / "p.jsonl")]) == 2
    assert "--num" in capsys.readouterr().err
    assert main(["data", "toy", "--split", "val", "--out", str(val)]) == 2  # exists: refused

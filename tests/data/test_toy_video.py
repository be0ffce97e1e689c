"""The video toy world: captions read back to what wrote them, clips move their object the
caption's way and repeat for a seed, the split keeps RL and evaluation prompts apart from
pretraining and from each other, and the committed prompt files are the split's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flowrl.cli import main
from flowrl.data.toy_video import DIRECTIONS, NUM_FRAMES, parse_motion_caption, render_clip, video_words
from flowrl.data.toy_video_split import (
    all_motion_captions,
    pretraining_clips,
    split_motion_captions,
    video_prompt_rows,
)
from flowrl.data.toy_world import COLOURS, SHAPES

PROMPTS = Path(__file__).resolve().parents[2] / "flowrl" / "data" / "toy_prompts"


def test_every_caption_reads_back_to_itself():
    captions = all_motion_captions()
    assert len(set(captions)) == len(COLOURS) * len(SHAPES) * len(DIRECTIONS)
    for caption in captions:
        assert parse_motion_caption(caption.text) == caption
        assert parse_motion_caption(" " + caption.text.upper()) == caption
        assert set(caption.text.split()) <= set(video_words())
    assert parse_motion_caption("an orange square moving up").text == "an orange square moving up"


@pytest.mark.parametrize(
    "text, message",
    [
        ("a red circle moving sideways", "unknown direction 'sideways'"),
        ("a pink circle moving up", "unknown colour 'pink'"),
        ("two red circles moving up", "one object of a named colour"),
        ("a circle moving up", "one object of a named colour"),
        ("a red circle", "moving <direction>"),
        ("", "is empty"),
    ],
)
def test_bad_captions_are_named_with_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_motion_caption(text)
    assert repr(text) in str(error.value)


def test_clips_move_their_object_the_captions_way_and_repeat_for_a_seed():
    for index, caption in enumerate(all_motion_captions()):
        clip = render_clip(caption, seed=index)
        assert clip.shape == (NUM_FRAMES, 48, 48, 3) and clip.dtype == np.uint8
        colours = {tuple(pixel) for pixel in clip.reshape(-1, 3)}
        assert colours == {(255, 255, 255), COLOURS[caption.colour]}  # exact palette
        centres = []
        for frame in clip:
            ys, xs = np.nonzero((frame != 255).any(axis=-1))
            assert 0 < xs.min() and xs.max() < 47 and 0 < ys.min() and ys.max() < 47  # inside, whole
            centres.append((xs.mean(), ys.mean()))
        dx, dy = DIRECTIONS[caption.direction]
        along = [x * dx + y * dy for x, y in centres]
        assert all(b - a >= 7 for a, b in zip(along, along[1:]))  # two cells in four equal steps
    again = all_motion_captions()[5]
    assert np.array_equal(render_clip(again, 3), render_clip(again, 3))
    assert not np.array_equal(render_clip(again, 3), render_clip(again, 4))
    with pytest.raises(ValueError, match="4k \\+ 1"):
        render_clip(again, 0, num_frames=4)


def test_split_is_disjoint_and_keeps_every_word_in_pretraining():
    split = split_motion_captions()
    pretrain, train, val = (set(split[name]) for name in ("pretrain", "train", "val"))
    assert not (pretrain & train) and not (pretrain & val) and not (train & val)
    assert pretrain | train | val == set(all_motion_captions())
    # Each held-out caption composes a colour-shape pair, a colour-direction and a shape-direction
    # combination that pretraining shows apart.
    for caption in train | val:
        assert any(c.colour == caption.colour and c.shape == caption.shape for c in pretrain)
        assert any(c.colour == caption.colour and c.direction == caption.direction for c in pretrain)
        assert any(c.shape == caption.shape and c.direction == caption.direction for c in pretrain)
    drawn = {text for text, _ in pretraining_clips(200, seed=1)}
    assert drawn <= {c.text for c in pretrain}
    assert split_motion_captions() == split


def test_committed_prompt_files_are_the_split_and_the_cli_writes_them(tmp_path, capsys):
    for name in ("train", "val"):
        committed = [json.loads(line) for line in (PROMPTS / f"video_{name}.jsonl").read_text().splitlines()]
        assert committed == video_prompt_rows(name)
    out = tmp_path / "val.jsonl"
    assert main(["data", "toy-video", "--split", "val", "--out", str(out)]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == video_prompt_rows("val")
    assert main(["data", "toy-video", "--split", "pretrain", "--out", str(tmp_path / "p.jsonl")]) == 2
    assert "--num" in capsys.readouterr().err

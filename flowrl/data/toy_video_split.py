"""The video toy world's fixed split: which motion captions pretraining sees, RL trains on, and
evaluation holds out.

The world has 72 captions: 6 colours x 3 shapes x 4 directions (flowrl.data.toy_video). For every
colour-shape pair, `HELD_OUT_PER_PAIR` of its four directions are never shown in pretraining
(seeded by `SPLIT_SEED`, redrawn until every colour-direction and shape-direction combination
still appears in pretraining): each held-out caption is a new composition of a colour, a shape and
a direction that pretraining showed apart. The held-out captions are split, seeded, into the
held-out evaluation prompts (`NUM_VAL`) and the RL training prompts (the rest): disjoint, and
neither seen in pretraining.

The autoencoder is a codec, so it sees clips of every caption (`codec_clips`); only the
transformer's pretraining (`pretraining_clips`) is kept away from the held-out captions.

`video_prompt_rows(split)` gives a split's rows as prompt files hold them: {"prompt",
"ground_truth" (the caption, which the shapes_video reward reads), "data_source": "toy_video",
"category": "motion"}.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

import numpy as np

from flowrl.data.toy_render import IMAGE_SIZE
from flowrl.data.toy_video import DIRECTIONS, NUM_FRAMES, MotionCaption, render_clip
from flowrl.data.toy_world import COLOURS, SHAPES

SPLIT_SEED = 0
HELD_OUT_PER_PAIR = 2  # directions of each colour-shape pair never shown in pretraining
NUM_VAL = 18  # held-out evaluation prompts; the other held-out captions are the RL prompts
DATA_SOURCE = "toy_video"
CATEGORY = "motion"
SPLITS = ("train", "val", "pretrain")


def all_motion_captions() -> tuple[MotionCaption, ...]:
    """Every caption of the video world, in a fixed order."""
    return tuple(
        MotionCaption(colour, shape, direction) for shape in SHAPES for colour in COLOURS for direction in DIRECTIONS
    )


def _covers_every_combination(pretrain: list[MotionCaption]) -> bool:
    colour_ways = {(c.colour, c.direction) for c in pretrain}
    shape_ways = {(c.shape, c.direction) for c in pretrain}
    return len(colour_ways) == len(COLOURS) * len(DIRECTIONS) and len(shape_ways) == len(SHAPES) * len(DIRECTIONS)


@functools.lru_cache(maxsize=1)
def split_motion_captions() -> dict[str, tuple[MotionCaption, ...]]:
    """{"pretrain", "train", "val"}: disjoint caption sets (module docstring); fixed by SPLIT_SEED."""
    rng = random.Random(SPLIT_SEED)
    while True:
        held_out = []
        for shape in SHAPES:
            for colour in COLOURS:
                held_out += [MotionCaption(colour, shape, d) for d in rng.sample(list(DIRECTIONS), HELD_OUT_PER_PAIR)]
        pretrain = [c for c in all_motion_captions() if c not in set(held_out)]
        if _covers_every_combination(pretrain):
            break
    val = rng.sample(held_out, NUM_VAL)
    train = [c for c in held_out if c not in set(val)]
    return {"pretrain": tuple(pretrain), "train": tuple(train), "val": tuple(val)}


def motion_caption_row(caption: MotionCaption) -> dict:
    return {"prompt": caption.text, "ground_truth": caption.text, "data_source": DATA_SOURCE, "category": CATEGORY}


def video_prompt_rows(split: str, num: int | None = None, seed: int = 0) -> list[dict]:
    """The rows of `split` ("train", "val": all, or the first `num`; "pretrain": `num` captions
    drawn with `seed` as pretraining draws them)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    if num is not None and num < 1:
        raise ValueError(f"num={num} must be >= 1")
    captions = split_motion_captions()[split]
    if split == "pretrain":
        if num is None:
            raise ValueError("the pretrain split is drawn at random: give the number of rows (--num)")
        rng = random.Random(seed)
        return [motion_caption_row(rng.choice(captions)) for _ in range(num)]
    return [motion_caption_row(caption) for caption in captions[:num]]


def _clips(
    captions: tuple[MotionCaption, ...], num: int, seed: int, image_size: int, num_frames: int
) -> Iterator[tuple[str, np.ndarray]]:
    rng = random.Random(seed)
    for _ in range(num):
        caption = rng.choice(captions)
        yield caption.text, render_clip(caption, rng.getrandbits(32), image_size, num_frames)


def pretraining_clips(
    num: int, seed: int, image_size: int = IMAGE_SIZE, num_frames: int = NUM_FRAMES
) -> Iterator[tuple[str, np.ndarray]]:
    """`num` (caption text, (F, H, W, 3) uint8 clip) pairs of the pretraining split, the same for the same seed."""
    return _clips(split_motion_captions()["pretrain"], num, seed, image_size, num_frames)


def codec_clips(
    num: int, seed: int, image_size: int = IMAGE_SIZE, num_frames: int = NUM_FRAMES
) -> Iterator[np.ndarray]:
    """`num` clips of any caption (the autoencoder's data, module docstring), the same for the same seed."""
    return (clip for _, clip in _clips(all_motion_captions(), num, seed, image_size, num_frames))

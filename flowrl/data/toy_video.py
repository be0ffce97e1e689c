"""The toy world in motion: one object moving in a straight line, captions, their rules, and clips.

A caption names one object by colour and shape and the direction it moves, in the image world's
words (flowrl.data.toy_world) plus "moving" and four directions: "a red circle moving right",
"an orange square moving up". `parse_motion_caption(text)` reads one back (ValueError naming the
caption and the word at fault), `MotionCaption.text` writes it, and `motion_requirements(caption)`
lists what a clip of it must show (flowrl.rewards.shapes_video checks them): the object has the
caption's colour in every frame, its shape in every frame, it moves the caption's way, and each
frame holds exactly one object.

`render_clip(caption, seed)` draws `NUM_FRAMES` frames (4k + 1, as Wan's 4x temporal compression
needs) with the image world's renderer (flowrl.data.toy_render): the object starts in a cell of
the 3 x 3 grid on the side it leaves from (a seeded row or column, jittered inside the cell, as
the image world places objects) and travels `TRAVEL_CELLS` cells in equal steps, so the first and
last frames are two cells apart and every object pixel has its palette colour. Same seed, same
pixels.

It knows words, rules and pixels, nothing about the split (flowrl.data.toy_video_split) or models.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from flowrl.data.toy_render import GRID, IMAGE_SIZE, SceneObject, object_in_cell, render_scene
from flowrl.data.toy_world import COLOURS, SHAPES, Group, parse_caption, world_words

NUM_FRAMES = 5  # 4k + 1 frames: the first frame alone, then one latent frame per 4 (Wan's VAE)
TRAVEL_CELLS = 2  # grid cells the object travels from the first frame to the last
# direction -> (dx, dy) in pixels' axes (y down)
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
MOVING = "moving"


def video_words() -> tuple[str, ...]:
    """Every word a motion caption may use (the video toy model's tokenizer holds each as one token)."""
    return tuple(sorted({*world_words(), MOVING, *DIRECTIONS}))


@dataclass(frozen=True)
class MotionCaption:
    """One object of `colour` and `shape` moving towards `direction` (a DIRECTIONS key)."""

    colour: str
    shape: str
    direction: str

    @property
    def text(self) -> str:
        return f"{Group(1, self.colour, self.shape).phrase} {MOVING} {self.direction}"


def parse_motion_caption(text: str) -> MotionCaption:
    """The MotionCaption a text describes (case and extra spaces ignored); ValueError naming the
    caption and what is wrong with it."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"caption {text!r} is empty; write e.g. 'a red circle moving right'")
    words = text.lower().split()
    if len(words) < 3 or words[-2] != MOVING:
        raise ValueError(f"caption {text!r} is not '<a|an> <colour> <shape> moving <direction>'")
    if words[-1] not in DIRECTIONS:
        raise ValueError(
            f"caption {text!r}: unknown direction {words[-1]!r}; the directions are {', '.join(DIRECTIONS)}"
        )
    try:
        caption = parse_caption(" ".join(words[:-2]))
    except ValueError as error:
        raise ValueError(f"caption {text!r}: {error}") from None
    (group,) = caption.groups if len(caption.groups) == 1 else (None,)
    if group is None or group.count != 1 or group.colour is None:
        raise ValueError(f"caption {text!r} names {caption.text!r}; a clip shows one object of a named colour")
    return MotionCaption(group.colour, group.shape, words[-1])


@dataclass(frozen=True)
class MotionRequirement:
    """One check of a clip against its caption; kind: "colour", "shape", "motion" or "total"."""

    kind: str
    description: str


def motion_requirements(caption: MotionCaption) -> tuple[MotionRequirement, ...]:
    """The checks a clip of `caption` must pass (module docstring), in a fixed order."""
    return (
        MotionRequirement("colour", f"the object is {caption.colour} in every frame"),
        MotionRequirement("shape", f"the object is a {caption.shape} in every frame"),
        MotionRequirement("motion", f"the object moves {caption.direction}"),
        MotionRequirement("total", "exactly one object in every frame"),
    )


def sample_track(
    caption: MotionCaption, rng: random.Random, image_size: int = IMAGE_SIZE, num_frames: int = NUM_FRAMES
) -> tuple[SceneObject, ...]:
    """The object in each frame of a random clip of `caption` (module docstring)."""
    if caption.colour not in COLOURS or caption.shape not in SHAPES or caption.direction not in DIRECTIONS:
        raise ValueError(f"{caption} holds a colour, shape or direction the world does not have")
    if num_frames < 2 or (num_frames - 1) % 4:
        raise ValueError(f"num_frames={num_frames} must be 4k + 1 with k >= 1 (5, 9, 13, ...)")
    dx, dy = DIRECTIONS[caption.direction]
    across = rng.randrange(GRID)  # the row (horizontal motion) or column (vertical) it keeps
    first = 0 if dx + dy > 0 else GRID - 1  # the cell it leaves from along its axis
    column, row = (first, across) if dx else (across, first)
    gap = max(2, round(0.04 * image_size))
    start = object_in_cell(rng, caption.shape, caption.colour, row * GRID + column, image_size, gap)
    travel = TRAVEL_CELLS * image_size / GRID
    steps = [round(travel * frame / (num_frames - 1)) for frame in range(num_frames)]
    return tuple(replace(start, x0=start.x0 + dx * step, y0=start.y0 + dy * step) for step in steps)


def render_track(track: Iterable[SceneObject], image_size: int = IMAGE_SIZE) -> np.ndarray:
    """(F, image_size, image_size, 3) uint8: one frame per object position."""
    return np.stack([render_scene([obj], image_size) for obj in track])


def render_clip(
    caption: MotionCaption, seed: int, image_size: int = IMAGE_SIZE, num_frames: int = NUM_FRAMES
) -> np.ndarray:
    """(F, H, W, 3) uint8: a clip of `caption`, the same for the same seed."""
    return render_track(sample_track(caption, random.Random(seed), image_size, num_frames), image_size)

"""The toy world's pictures: a scene that fits a caption, drawn exactly with PIL (no weights).

`sample_scene(caption, rng, image_size, allowed_pairs)` places the caption's objects in distinct
cells of a 3 x 3 grid, each jittered inside its cell (sizes a fifth to a quarter of the image side;
the cells keep a gap of a few pixels between objects, so every object is its own connected
component), with colours drawn for groups of any colour from `allowed_pairs` (the pretraining
split excludes some colour-shape pairs). The grid keeps the world small enough for a small model:
where objects go is one of nine choices, not a continuum. A relation is drawn unambiguously: the
objects are apart along its axis by more than their half-sizes and a gap, and at most half as far
along the other axis. `render_scene(objects, image_size)` draws them without anti-aliasing, so
every object pixel has its palette colour exactly. Same rng state, same scene, same pixels.

It knows the caption structures of flowrl.data.toy_world and pixels, nothing about models.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from flowrl.data.toy_world import BACKGROUND, COLOURS, SHAPES, Caption

MIN_SIZE, MAX_SIZE = 0.2, 0.28  # object side, as a share of the image side
GRID = 3  # cells per side
IMAGE_SIZE = 48  # the default side: a 16-pixel cell is one 2 x 2 patch of the toy model's 6 x 6 latent
_GAP = 0.04  # least distance between two objects' boxes, as a share of the image side
_MAX_TRIES = 200


@dataclass(frozen=True)
class SceneObject:
    """An object drawn in the box [x0, x0 + size) x [y0, y0 + size) (pixels, y down)."""

    shape: str
    colour: str
    x0: int
    y0: int
    size: int

    @property
    def center(self) -> tuple[float, float]:
        return self.x0 + (self.size - 1) / 2, self.y0 + (self.size - 1) / 2


def _gap_ok(a: SceneObject, b: SceneObject, gap: int) -> bool:
    """Whether the two boxes are at least `gap` pixels apart along some axis."""
    apart_x = max(a.x0, b.x0) - min(a.x0 + a.size, b.x0 + b.size)
    apart_y = max(a.y0, b.y0) - min(a.y0 + a.size, b.y0 + b.size)
    return max(apart_x, apart_y) >= gap


def relation_holds_strongly(a: SceneObject, b: SceneObject, relation: str, gap: int) -> bool:
    """The unambiguous form of "a <relation> b" that scenes are drawn with (module docstring)."""
    (ax, ay), (bx, by) = a.center, b.center
    primary, secondary = {
        "left_of": (bx - ax, by - ay),
        "right_of": (ax - bx, by - ay),
        "above": (by - ay, bx - ax),
        "below": (ay - by, bx - ax),
    }[relation]
    return primary >= (a.size + b.size) / 2 + gap and abs(secondary) <= primary / 2


def object_in_cell(rng: random.Random, shape: str, colour: str, cell: int, image_size: int, gap: int) -> SceneObject:
    """An object of a random size at a random place inside grid cell `cell` (row-major), at least
    gap / 2 pixels from the cell's sides."""
    left, top = image_size * (cell % GRID) / GRID, image_size * (cell // GRID) / GRID
    side = image_size / GRID
    size = rng.randint(round(MIN_SIZE * image_size), min(round(MAX_SIZE * image_size), int(side) - gap))
    room = side - size - gap  # free pixels along each axis, gap / 2 kept on either side
    x0 = int(left + gap / 2 + rng.random() * room)
    y0 = int(top + gap / 2 + rng.random() * room)
    return SceneObject(shape, colour, x0, y0, size)


def _colours_for(shape: str, colour: str | None, allowed_pairs) -> list[str]:
    if colour is not None:
        return [colour]
    colours = [name for name in COLOURS if allowed_pairs is None or (name, shape) in allowed_pairs]
    if not colours:
        raise ValueError(f"no colour of a {shape} is allowed by allowed_pairs; allow at least one")
    return colours


def sample_scene(
    caption: Caption,
    rng: random.Random,
    image_size: int = IMAGE_SIZE,
    allowed_pairs: Iterable[tuple[str, str]] | None = None,
) -> tuple[SceneObject, ...]:
    """The objects of a random scene that `caption` describes exactly (module docstring)."""
    allowed = None if allowed_pairs is None else set(allowed_pairs)
    gap = max(2, round(_GAP * image_size))
    wanted = [
        (group.shape, _colours_for(group.shape, group.colour, allowed))
        for group in caption.groups
        for _ in range(group.count)
    ]
    for _ in range(_MAX_TRIES):
        cells = rng.sample(range(GRID * GRID), len(wanted))
        placed = [
            object_in_cell(rng, shape, rng.choice(colours), cell, image_size, gap)
            for (shape, colours), cell in zip(wanted, cells)
        ]
        if not all(_gap_ok(a, b, gap) for i, a in enumerate(placed) for b in placed[i + 1 :]):
            continue
        if caption.relation is None or relation_holds_strongly(placed[0], placed[1], caption.relation, gap):
            return tuple(placed)
    raise RuntimeError(f"could not place a scene of {caption.text!r} in {image_size}x{image_size} pixels")


def render_scene(objects: Iterable[SceneObject], image_size: int = IMAGE_SIZE) -> np.ndarray:
    """(image_size, image_size, 3) uint8: the objects on the white background, exact colours."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        if obj.shape not in SHAPES:
            raise ValueError(f"unknown shape {obj.shape!r}; the shapes are {', '.join(SHAPES)}")
        fill = COLOURS[obj.colour]
        x1, y1 = obj.x0 + obj.size - 1, obj.y0 + obj.size - 1
        if obj.shape == "square":
            draw.rectangle((obj.x0, obj.y0, x1, y1), fill=fill)
        elif obj.shape == "circle":
            draw.ellipse((obj.x0, obj.y0, x1, y1), fill=fill)
        else:  # an upright isosceles triangle filling its box
            draw.polygon(((obj.x0, y1), (x1, y1), ((obj.x0 + x1) / 2, obj.y0)), fill=fill)
    return np.asarray(image, dtype=np.uint8).copy()


def render_caption(caption: Caption, seed: int, image_size: int = IMAGE_SIZE, allowed_pairs=None) -> np.ndarray:
    """One picture of `caption`, the same for the same seed."""
    return render_scene(sample_scene(caption, random.Random(seed), image_size, allowed_pairs), image_size)

"""The toy world's exact evaluator, and the `shapes` reward built on it (weight-free, milliseconds).

`detect_objects(image)` finds the objects of a picture: every pixel takes the nearest colour of
the world's palette (background included) when it lies within `tolerance` of it (RGB distance;
blurred edges, mixtures of two colours, stay unassigned), same-colour pixels form connected
components (8-neighbour), components smaller than `min_area` (a share of the image) are noise, and
each remaining one is classified by the shape template nearest to its mask: the mask's bounding
box is area-averaged onto a 6 x 6 grid and compared (mean absolute difference) with the same grid
of an ideal square (all filled), circle (pi/4 of it, the corners empty) and upright triangle (half
of it, the top corners empty). A mask far from all three (`_MAX_TEMPLATE_DISTANCE`), or in an
elongated box, is no shape. Unlike the fill ratio alone, this keeps its verdict when a decoder's
blur eats a pixel of every edge.

`check_caption(objects, caption)` checks each requirement of flowrl.data.toy_world.requirements:
a group is present, a group of several has exactly its count, the relation holds (GenEval's rule:
the centres' offset, less a tenth of the two boxes' sizes, points mostly along the relation's
axis), and the picture holds exactly the caption's number of objects.

`ShapesReward` (`reward.name=shapes`) reads the caption from the row's `ground_truth`, else from
its prompt, and scores the share of requirements that hold ("partial", the training reward) and
whether all hold ("strict", GenEval's accuracy); `score` picks which one is the total, and both are
reported as components.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

import numpy as np

from flowrl.data.toy_world import BACKGROUND, COLOURS, Caption, parse_caption, requirements
from flowrl.rewards.base import RowwiseReward

_PALETTE = np.array([BACKGROUND, *COLOURS.values()], dtype=np.float32)  # index 0: the background
_COLOUR_NAMES = ("background", *COLOURS)
_GRID = 6  # the shape templates' resolution
_MAX_TEMPLATE_DISTANCE = 0.2
_MAX_ASPECT = 1.6  # a box longer than this on one side holds no shape of the world
_NEIGHBOURS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]


@dataclass(frozen=True)
class DetectedObject:
    """A connected component of one palette colour; shape None: it fills its box like no shape."""

    colour: str
    shape: str | None
    area: int
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 (inclusive)

    @property
    def center(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2

    @property
    def dims(self) -> tuple[int, int]:
        x0, y0, x1, y1 = self.box
        return x1 - x0 + 1, y1 - y0 + 1


def palette_labels(image_hwc: np.ndarray, tolerance: float) -> np.ndarray:
    """(H, W) int: the index of each pixel's nearest palette colour (0 background), -1 beyond tolerance."""
    pixels = image_hwc.astype(np.float32)[:, :, None, :]
    distances = np.sqrt(((pixels - _PALETTE) ** 2).sum(axis=-1))
    labels = distances.argmin(axis=-1)
    return np.where(distances.min(axis=-1) <= tolerance, labels, -1)


def template_grid(mask: np.ndarray) -> np.ndarray:
    """(_GRID, _GRID) share of each cell of the (h, w) bool mask's box that the mask covers
    (exact area averaging: every pixel is split into _GRID x _GRID parts first)."""
    height, width = mask.shape
    fine = mask.astype(np.float64).repeat(_GRID, axis=0).repeat(_GRID, axis=1)
    return fine.reshape(_GRID, height, _GRID, width).mean(axis=(1, 3))


def _ideal_templates(resolution: int = 60) -> dict[str, np.ndarray]:
    y, x = np.mgrid[0:resolution, 0:resolution] + 0.5
    half = resolution / 2
    masks = {
        "square": np.ones((resolution, resolution), dtype=bool),
        "circle": (x - half) ** 2 + (y - half) ** 2 <= half**2,
        "triangle": np.abs(x - half) <= y / 2,  # apex at the top centre, base along the bottom
    }
    return {shape: template_grid(mask) for shape, mask in masks.items()}


_TEMPLATES = _ideal_templates()


def classify_shape(mask: np.ndarray) -> str | None:
    """The shape of the template nearest to the (h, w) bool mask of one object, or None (module docstring)."""
    height, width = mask.shape
    if max(height, width) > _MAX_ASPECT * min(height, width):
        return None
    grid = template_grid(mask)
    distances = {shape: float(np.abs(grid - template).mean()) for shape, template in _TEMPLATES.items()}
    nearest = min(distances, key=distances.get)
    return nearest if distances[nearest] < _MAX_TEMPLATE_DISTANCE else None


def detect_objects(image_hwc: np.ndarray, tolerance: float = 64.0, min_area: float = 0.003) -> list[DetectedObject]:
    """The objects of an (H, W, 3) uint8 picture, in scan order (module docstring)."""
    labels = palette_labels(image_hwc, tolerance)
    height, width = labels.shape
    smallest = max(4, round(min_area * height * width))
    seen = np.zeros(labels.shape, dtype=bool)
    objects = []
    for y, x in zip(*np.nonzero(labels > 0)):
        if seen[y, x]:
            continue
        label = labels[y, x]
        seen[y, x] = True
        queue, ys, xs = deque([(y, x)]), [y], [x]
        while queue:
            cy, cx = queue.popleft()
            for dy, dx in _NEIGHBOURS:
                ny, nx = cy + dy, cx + dx
                if 0 <= ny < height and 0 <= nx < width and not seen[ny, nx] and labels[ny, nx] == label:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
                    ys.append(ny)
                    xs.append(nx)
        if len(ys) < smallest:
            continue
        box = (int(min(xs)), int(min(ys)), int(max(xs)), int(max(ys)))
        mask = np.zeros((box[3] - box[1] + 1, box[2] - box[0] + 1), dtype=bool)
        mask[np.asarray(ys) - box[1], np.asarray(xs) - box[0]] = True
        shape = classify_shape(mask)
        objects.append(DetectedObject(_COLOUR_NAMES[label], shape, len(ys), box))
    return objects


def relation_holds(a: DetectedObject, b: DetectedObject, relation: str) -> bool:
    """Whether `a` is `relation` (left_of, right_of, above, below) of `b` (GenEval's rule)."""
    offset = np.subtract(a.center, b.center)
    norm = float(np.hypot(*offset))
    if norm == 0.0:
        return False
    revised = np.maximum(np.abs(offset) - 0.1 * np.add(a.dims, b.dims), 0.0) * np.sign(offset) / norm
    dx, dy = revised
    return {"left_of": dx < -0.5, "right_of": dx > 0.5, "above": dy < -0.5, "below": dy > 0.5}[relation]


def check_caption(objects: list[DetectedObject], caption: Caption) -> list[bool]:
    """One bool per requirement of `caption` (flowrl.data.toy_world.requirements), in its order."""
    members = [[obj for obj in objects if group.matches(obj.colour, obj.shape)] for group in caption.groups]
    results = []
    for requirement in requirements(caption):
        if requirement.kind == "present":
            results.append(len(members[requirement.group]) > 0)
        elif requirement.kind == "count":
            results.append(len(members[requirement.group]) == caption.groups[requirement.group].count)
        elif requirement.kind == "relation":
            results.append(any(relation_holds(a, b, caption.relation) for a in members[0] for b in members[1]))
        else:  # total
            results.append(len(objects) == caption.num_objects)
    return results


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Caption:
    return parse_caption(text)


def caption_of(prompt: str, metadata: dict, ground_truth_key: str = "ground_truth", parse=_parsed, reward="shapes"):
    """The caption a row asks for, read by `parse`: its ground_truth when set, else its prompt;
    ValueError naming the text and the field it came from when it is not a caption of the world."""
    text = metadata.get(ground_truth_key)
    field = ground_truth_key
    if text is None or (isinstance(text, str) and not text.strip()):
        text, field = prompt, "prompt"
    try:
        return parse(str(text))
    except ValueError as error:
        raise ValueError(f"{error} (from the row's {field}; the {reward} reward reads toy-world captions)") from None


def check_detection_options(reward: str, score: str, scores: tuple, tolerance: float, min_area: float) -> None:
    """The options every detecting reward of the toy worlds takes, each bad value named."""
    if score not in scores:
        raise ValueError(f"{reward} option score={score!r} is not one of {scores}")
    if not float(tolerance) > 0:
        raise ValueError(f"{reward} option tolerance={tolerance!r} must be > 0 (an RGB distance, e.g. 64)")
    if not 0 <= float(min_area) < 1:
        raise ValueError(f"{reward} option min_area={min_area!r} must be in [0, 1) (a share of the pixels)")


class ShapesReward(RowwiseReward):
    """Scores a picture against its toy-world caption (module docstring).

    score: "partial" (the share of requirements that hold) or "strict" (1 when all hold).
    tolerance: RGB distance within which a pixel takes a palette colour; min_area: the smallest
    object, as a share of the image's pixels."""

    name = "shapes"
    SCORES = ("partial", "strict")

    def __init__(
        self,
        score: str = "partial",
        tolerance: float = 64.0,
        min_area: float = 0.003,
        ground_truth_key: str = "ground_truth",
    ):
        check_detection_options(self.name, score, self.SCORES, tolerance, min_area)
        self.score = score
        self.tolerance = float(tolerance)
        self.min_area = float(min_area)
        self.ground_truth_key = ground_truth_key

    def evaluate(self, image_hwc: np.ndarray, prompt: str, metadata: dict) -> tuple[float, float]:
        """(partial, strict) of one (H, W, 3) uint8 picture."""
        caption = caption_of(prompt, metadata, self.ground_truth_key)
        results = check_caption(detect_objects(image_hwc, self.tolerance, self.min_area), caption)
        return sum(results) / len(results), float(all(results))

    def score_row(self, image_hwc: np.ndarray, prompt: str, metadata: dict) -> float:
        partial, strict = self.evaluate(image_hwc, prompt, metadata)
        return partial if self.score == "partial" else strict

    def score_batch_with_components(self, images: np.ndarray, prompts: list[str], metadata: list[dict]):
        from flowrl.rewards.base import RewardError

        scores = np.empty((len(prompts), 2), dtype=np.float64)
        for row, (image, prompt, meta) in enumerate(zip(images, prompts, metadata)):
            try:
                scores[row] = self.evaluate(np.ascontiguousarray(image.transpose(1, 2, 0)), prompt, meta)
            except Exception as error:
                raise RewardError(self.name, row, error) from error
        components = {"partial": scores[:, 0], "strict": scores[:, 1]}
        return components[self.score], components

"""The video toy world's exact evaluator, and the `shapes_video` reward built on it (weight-free).

Each frame's objects are found by flowrl.rewards.shapes' `detect_objects` (nearest palette colour
within a tolerance, connected components, nearest shape template); the clip's object in a frame is
its largest one. `check_motion(frames_objects, caption)` checks the requirements of
flowrl.data.toy_video.motion_requirements:

- colour: in every frame the object has the caption's colour;
- shape: in every frame it has the caption's shape;
- motion: its centre moves the caption's way: from the first frame to the last by at least
  `min_travel` of the image side along the direction, at most half as far across it, and no frame
  steps back along it by more than a twentieth of the side (the renders move two thirds of the
  side in equal steps);
- total: every frame holds exactly one object.

`ShapesVideoReward` (`reward.name=shapes_video`, takes videos (B, F, 3, H, W)) reads the caption
from the row's `ground_truth`, else from its prompt, and scores the share of requirements that hold
("partial", the training reward) and whether all hold ("strict"), both reported as components,
as the image world's `shapes` reward does.
"""

from __future__ import annotations

import functools

import numpy as np

from flowrl.data.toy_video import DIRECTIONS, MotionCaption, motion_requirements, parse_motion_caption
from flowrl.rewards.base import Reward, RewardError
from flowrl.rewards.shapes import DetectedObject, caption_of, check_detection_options, detect_objects

_MAX_BACKSTEP = 0.05  # the most a frame may step against the direction, as a share of the side


def _largest(objects: list[DetectedObject]) -> DetectedObject | None:
    return max(objects, key=lambda obj: obj.area) if objects else None


def moves(track: list[tuple[float, float]], direction: str, image_size: int, min_travel: float) -> bool:
    """Whether the centres `track` (x, y per frame, y down) move towards `direction` (module docstring)."""
    dx, dy = DIRECTIONS[direction]
    along = [x * dx + y * dy for x, y in track]  # the position along the direction
    across = [x * dy + y * dx for x, y in track]
    travel = along[-1] - along[0]
    steps_ok = all(b - a >= -_MAX_BACKSTEP * image_size for a, b in zip(along, along[1:]))
    return travel >= min_travel * image_size and abs(across[-1] - across[0]) <= travel / 2 and steps_ok


def check_motion(
    frames_objects: list[list[DetectedObject]], caption: MotionCaption, image_size: int, min_travel: float
) -> list[bool]:
    """One bool per requirement of `caption` (flowrl.data.toy_video.motion_requirements), in its order."""
    main = [_largest(objects) for objects in frames_objects]
    seen = all(obj is not None for obj in main)
    results = []
    for requirement in motion_requirements(caption):
        if requirement.kind == "colour":
            results.append(seen and all(obj.colour == caption.colour for obj in main))
        elif requirement.kind == "shape":
            results.append(seen and all(obj.shape == caption.shape for obj in main))
        elif requirement.kind == "motion":
            results.append(seen and moves([obj.center for obj in main], caption.direction, image_size, min_travel))
        else:  # total
            results.append(all(len(objects) == 1 for objects in frames_objects))
    return results


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> MotionCaption:
    return parse_motion_caption(text)


class ShapesVideoReward(Reward):
    """Scores a clip against its motion caption (module docstring).

    score: "partial" or "strict"; tolerance and min_area: as the `shapes` reward's; min_travel: the
    least distance the object's centre must move along its direction, as a share of the side."""

    name = "shapes_video"
    takes_videos = True
    scores_rows_one_by_one = True
    SCORES = ("partial", "strict")

    def __init__(
        self,
        score: str = "partial",
        tolerance: float = 64.0,
        min_area: float = 0.003,
        min_travel: float = 0.25,
        ground_truth_key: str = "ground_truth",
    ):
        check_detection_options(self.name, score, self.SCORES, tolerance, min_area)
        if not 0 < float(min_travel) < 1:
            raise ValueError(f"shapes_video option min_travel={min_travel!r} must be in (0, 1) (a share of the side)")
        self.score = score
        self.tolerance = float(tolerance)
        self.min_area = float(min_area)
        self.min_travel = float(min_travel)
        self.ground_truth_key = ground_truth_key

    def _caption(self, prompt: str, metadata: dict) -> MotionCaption:
        return caption_of(prompt, metadata, self.ground_truth_key, parse=_parsed, reward=self.name)

    def cannot_score(self, metadata: dict) -> str | None:
        try:
            self._caption(str(metadata.get("prompt", "")), metadata)
        except ValueError as error:
            return str(error)
        return None

    def evaluate(self, video_fhwc: np.ndarray, prompt: str, metadata: dict) -> tuple[float, float]:
        """(partial, strict) of one (F, H, W, 3) uint8 clip."""
        caption = self._caption(prompt, metadata)
        if video_fhwc.shape[0] < 2:
            raise ValueError(f"a clip of {video_fhwc.shape[0]} frame shows no motion; sample at least 5 frames")
        frames = [detect_objects(frame, self.tolerance, self.min_area) for frame in video_fhwc]
        results = check_motion(frames, caption, video_fhwc.shape[2], self.min_travel)
        return sum(results) / len(results), float(all(results))

    def score_batch_with_components(self, images: np.ndarray, prompts: list[str], metadata: list[dict]):
        videos = images[:, None] if images.ndim == 4 else images
        scores = np.empty((len(prompts), 2), dtype=np.float64)
        for row, (video, prompt, meta) in enumerate(zip(videos, prompts, metadata)):
            if self.is_cancelled:
                raise RewardError(self.name, row, "scoring was cancelled: the run is stopping")
            try:
                scores[row] = self.evaluate(np.ascontiguousarray(video.transpose(0, 2, 3, 1)), prompt, meta)
            except Exception as error:
                raise RewardError(self.name, row, error) from error
        components = {"partial": scores[:, 0], "strict": scores[:, 1]}
        return components[self.score], components

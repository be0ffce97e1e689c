"""Rewards on videos, (B, F, 3, H, W) uint8 (a video model's samples, flowrl.models.wan).

- `per_frame`: any image reward applied to each frame (or to chosen frames), the frames' scores
  aggregated by a named rule: `mean`, `min` (the worst frame), or `frames` (the mean over the
  frames listed in `frames`; negative indices count from the end). Options:
  {reward: NAME or {name, options}, aggregate: mean|min|frames, frames: [i, ...]}.
- `temporal_consistency`: weight-free frame-to-frame agreement, 1 - the mean absolute change of a
  pixel between consecutive frames (as a fraction of 255), in [0, 1]: 1 for a still video, lower
  for flicker. It says nothing about whether the video shows the prompt, so it is a regulariser
  beside a content reward (reward.components), not a goal of its own.

An image (B, 3, H, W) given to either is a one-frame video.
"""

from __future__ import annotations

import numpy as np

from flowrl.rewards.base import Reward, RewardError, build_reward

AGGREGATIONS = ("mean", "min", "frames")


def _as_videos(images: np.ndarray) -> np.ndarray:
    return images[:, None] if images.ndim == 4 else images


class PerFrameReward(Reward):
    name = "per_frame"
    takes_videos = True

    def __init__(self, reward, aggregate: str = "mean", frames: list[int] | None = None):
        if aggregate not in AGGREGATIONS:
            raise ValueError(f"per_frame option aggregate={aggregate!r} is unknown; use one of {AGGREGATIONS}")
        if (aggregate == "frames") != (frames is not None):
            raise ValueError(
                f"per_frame option frames={frames!r} with aggregate={aggregate!r}: list the frames to score "
                "(e.g. frames=[0, -1]) exactly when aggregate=frames"
            )
        if frames is not None and (
            not frames or not all(isinstance(i, int) and not isinstance(i, bool) for i in frames)
        ):
            raise ValueError(f"per_frame option frames={frames!r} must be a non-empty list of frame indices")
        self.inner = reward if isinstance(reward, Reward) else build_reward(reward)
        if self.inner.takes_videos:
            raise ValueError(f"per_frame option reward={self.inner.name!r} scores videos already; use it directly")
        self.aggregate = aggregate
        self.frames = frames

    @property
    def scores_rows_one_by_one(self) -> bool:
        return self.inner.scores_rows_one_by_one

    def cancel(self) -> None:
        super().cancel()
        self.inner.cancel()

    def cannot_score(self, metadata: dict) -> str | None:
        return self.inner.cannot_score(metadata)

    def _frame_indices(self, num_frames: int) -> list[int]:
        if self.frames is None:
            return list(range(num_frames))
        bad = [i for i in self.frames if not -num_frames <= i < num_frames]
        if bad:
            raise ValueError(
                f"per_frame option frames={self.frames} has indices {bad} outside a {num_frames}-frame video"
            )
        return [i % num_frames for i in self.frames]

    def score_batch_with_components(self, images, prompts, metadata):
        videos = _as_videos(images)
        batch, num_frames = videos.shape[:2]
        chosen = self._frame_indices(num_frames)
        frames = videos[:, chosen].reshape(batch * len(chosen), *videos.shape[2:])
        repeat = len(chosen)
        try:
            scores = self.inner(frames, [p for p in prompts for _ in chosen], [m for m in metadata for _ in chosen])
        except RewardError as error:  # name the video's row, not the frame's
            raise error.with_row_index(None if error.row_index is None else error.row_index // repeat) from error
        scores = scores.reshape(batch, repeat)
        total = scores.min(axis=1) if self.aggregate == "min" else scores.mean(axis=1)
        return total, {self.name: total}


class TemporalConsistency(Reward):
    name = "temporal_consistency"
    takes_videos = True

    def score_batch(self, images, prompts, metadata):
        videos = _as_videos(images)
        if videos.shape[1] < 2:
            return np.ones(videos.shape[0])
        change = np.abs(np.diff(videos.astype(np.int16), axis=1)).mean(axis=(1, 2, 3, 4))
        return 1.0 - change / 255.0

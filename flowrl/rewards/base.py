"""The reward interface, the failure type, and the registry that builds rewards by name.

A reward maps a batch of images (B, 3, H, W) uint8 (or videos (B, F, 3, H, W): flowrl.rewards.video),
their prompts and per-row metadata (for example `ground_truth`, `data_source`) to one float64 score
per image. Subclasses implement
`score_batch` (whole batch at once) or, through `RowwiseReward`, `score_row` (one image at a
time, so one bad row can be named and, for optional rewards, turned into NaN alone).

Failure policy (issue 5, item 8): anything that goes wrong inside a reward surfaces as a
`RewardError` carrying the reward name, the row index (None when the whole batch failed) and
the cause. Callers decide: a required reward raises it, an optional one turns the failed rows
into NaN via `score_or_nan`. A reward never returns a silent 0 for a failure.

This module does not import torch, rapidocr or transformers: the registry maps names to
"module:attribute" strings that are imported only when that reward is built.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import numpy as np


class RewardError(RuntimeError):
    """A reward failed. `row_index` is the batch row that failed, or None for the whole batch."""

    def __init__(self, reward_name: str, row_index: int | None, cause: BaseException | str):
        self.reward_name = reward_name
        self.row_index = row_index
        self.cause = cause
        where = "the whole batch" if row_index is None else f"row {row_index}"
        cause_text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"reward {reward_name!r} failed on {where}: {cause_text}")

    def with_row_index(self, row_index: int | None) -> RewardError:
        """The same failure re-addressed to another row numbering (e.g. a batch's global rows)."""
        moved = RewardError(self.reward_name, row_index, self.cause)
        moved.__cause__ = self.__cause__
        return moved


def as_uint8_images(images: Any) -> np.ndarray:
    """Validate (B, 3, H, W) uint8 images, or (B, F, 3, H, W) videos, (numpy or torch) and return
    them as a numpy array."""
    torch = sys.modules.get("torch")  # if torch was never imported, `images` cannot be a tensor
    if torch is not None and isinstance(images, torch.Tensor):
        images = images.detach().cpu().numpy()
    if not isinstance(images, np.ndarray):
        raise ValueError(f"images must be a numpy array or torch tensor, got {type(images).__name__}")
    if images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise ValueError(
            f"images must have shape (B, 3, H, W), or (B, F, 3, H, W) for videos, got {tuple(images.shape)}; "
            "pass channel-first RGB images stacked along a batch axis"
        )
    if images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 in [0, 255], got dtype {images.dtype}; convert first")
    return images


def validate_batch(images: Any, prompts: list[str], metadata: list[dict]) -> np.ndarray:
    """Check one image, one prompt and one metadata dict per row; return the images as numpy."""
    images = as_uint8_images(images)
    batch_size = images.shape[0]
    if len(prompts) != batch_size:
        raise ValueError(f"prompts has {len(prompts)} entries for {batch_size} images; pass one per image")
    if len(metadata) != batch_size:
        raise ValueError(f"metadata has {len(metadata)} entries for {batch_size} images; pass one dict per image")
    if not all(isinstance(meta, dict) for meta in metadata):
        raise ValueError("metadata must be a list of dicts, one per image (use {} for none)")
    return images


class Reward:
    """Base class: validates the batch, calls the subclass, wraps failures into RewardError.

    Subclasses override `score_batch` (one score per row) or, when they produce several named
    scores at once, `score_batch_with_components`.
    """

    name: str = "reward"
    # Whether score_batch takes (B, F, 3, H, W) videos (flowrl.rewards.video); the others score
    # images, and a video given to them is refused with the way to score its frames.
    takes_videos: bool = False
    # Whether a batch costs as much as its rows scored one by one (a Python loop over images, as
    # OCR): AsyncRewardScorer then spreads a burst of rows over its workers instead of handing
    # one worker a single batch (which suits a batched model forward, as CLIP's).
    scores_rows_one_by_one: bool = False
    # Whether the reward scores a prompt's group of images together (flowrl.rewards.groups): the
    # async scorer then hands it whole groups only.
    scores_groups: bool = False
    is_cancelled: bool = False  # set by cancel()

    def cancel(self) -> None:
        """Stop scoring for good (a run that is stopping): a row-wise reward ends the batch it is
        scoring at its next row with a RewardError, so the threads scoring for a stopped run end
        within one row's time, not a batch's (a thread still inside native code, as onnxruntime's
        OCR, when the process exits aborts it)."""
        self.is_cancelled = True

    def __call__(self, images: Any, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        return self.score_with_components(images, prompts, metadata)[0]

    def score_with_components(
        self, images: Any, prompts: list[str], metadata: list[dict]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(total, {component name: scores}); a single reward is its own only component."""
        images = self._checked(validate_batch(images, prompts, metadata))
        try:
            total, components = self.score_batch_with_components(images, list(prompts), list(metadata))
        except RewardError:
            raise
        except Exception as error:  # every failure leaves with the reward's name attached
            raise RewardError(self.name, None, error) from error
        total = np.asarray(total, dtype=np.float64)
        assert total.shape == (images.shape[0],), f"{self.name} returned shape {total.shape}"
        return total, {name: np.asarray(scores, dtype=np.float64) for name, scores in components.items()}

    def _checked(self, images: np.ndarray) -> np.ndarray:
        """`images`, refused when they are videos and this reward scores images."""
        if images.ndim == 5 and not self.takes_videos:
            raise ValueError(
                f"reward {self.name!r} scores images (B, 3, H, W) but was given videos {tuple(images.shape)}; "
                f"score their frames with {{name: per_frame, options: {{reward: {self.name}, aggregate: mean}}}} "
                "(or min, or chosen frames), or use temporal_consistency"
            )
        return images

    def score_batch_with_components(self, images: np.ndarray, prompts: list[str], metadata: list[dict]):
        scores = np.asarray(self.score_batch(images, prompts, metadata), dtype=np.float64)
        return scores, {self.name: scores}

    def score_batch(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        raise NotImplementedError

    def cannot_score(self, metadata: dict) -> str | None:
        """Why a row with this metadata cannot be scored (what it lacks, and the fix), or None.
        Checked on a dataset's rows before any image is made (`check_rows`); the default accepts
        every row."""
        return None

    def score_or_nan(
        self, images: Any, prompts: list[str], metadata: list[dict]
    ) -> tuple[np.ndarray, list[RewardError]]:
        """Scores with failed rows set to NaN, plus the failures (for optional rewards).

        Input validation errors (ValueError from a malformed batch) still raise: they are bugs
        of the caller, not failures of the reward.
        """
        validate_batch(images, prompts, metadata)
        try:
            return self(images, prompts, metadata), []
        except RewardError as error:
            return np.full(len(prompts), np.nan), [error]


class RowwiseReward(Reward):
    """A reward computed one image at a time, so failures name their row."""

    scores_rows_one_by_one = True

    def score_row(self, image_hwc: np.ndarray, prompt: str, metadata: dict) -> float:
        raise NotImplementedError

    def _score_rows(self, images: np.ndarray, prompts, metadata, failures: list | None) -> np.ndarray:
        scores = np.empty(images.shape[0], dtype=np.float64)
        for row, (image, prompt, meta) in enumerate(zip(images, prompts, metadata)):
            if self.is_cancelled:  # a failure even for an optional reward: nobody reads the scores
                raise RewardError(self.name, row, "scoring was cancelled: the run is stopping")
            try:
                scores[row] = float(self.score_row(np.ascontiguousarray(image.transpose(1, 2, 0)), prompt, meta))
            except Exception as error:
                wrapped = RewardError(self.name, row, error)
                wrapped.__cause__ = error
                if failures is None:
                    raise wrapped from error
                failures.append(wrapped)
                scores[row] = np.nan
        return scores

    def score_batch(self, images, prompts, metadata):
        return self._score_rows(images, prompts, metadata, failures=None)

    def score_or_nan(self, images, prompts, metadata):
        images = self._checked(validate_batch(images, prompts, metadata))
        failures: list[RewardError] = []
        return self._score_rows(images, prompts, metadata, failures), failures


def check_rows(reward, rows: list[dict], where: str) -> None:
    """ValueError naming the first of `rows` (dataset rows or their metadata) that `reward` cannot
    score, as `where` row N (e.g. "data.train_path='prompts.txt'"), before anything is generated."""
    cannot_score = getattr(reward, "cannot_score", None)  # a stand-in reward of a test may lack it
    for index, row in enumerate(rows if cannot_score is not None else ()):
        reason = cannot_score(row)
        if reason is not None:
            raise ValueError(f"{where} row {index}: reward {reward.name!r} cannot score it: {reason}")


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

# name -> "module:attribute" (imported lazily) or a callable(**options) -> Reward.
_REGISTRY: dict[str, str | Callable[..., Reward]] = {
    "ocr": "flowrl.rewards.ocr:OcrReward",
    "jpeg_compressibility": "flowrl.rewards.compression:JpegCompressibility",
    "jpeg_incompressibility": "flowrl.rewards.compression:JpegIncompressibility",
    "image_flatness": "flowrl.rewards.image_stats:ImageFlatness",
    "image_contrast": "flowrl.rewards.image_stats:ImageContrast",
    "shapes": "flowrl.rewards.shapes:ShapesReward",
    "shapes_video": "flowrl.rewards.shapes_video:ShapesVideoReward",
    "clip_score": "flowrl.rewards.clip_scores:ClipScoreReward",
    "pickscore": "flowrl.rewards.clip_scores:PickScoreReward",
    "aesthetic": "flowrl.rewards.clip_scores:AestheticReward",
    "hpsv2": "flowrl.rewards.hps:HpsV2Reward",
    "image_reward": "flowrl.rewards.image_reward:ImageRewardReward",
    "hpsv3": "flowrl.rewards.hpsv3:HpsV3Reward",
    "per_frame": "flowrl.rewards.video:PerFrameReward",
    "temporal_consistency": "flowrl.rewards.video:TemporalConsistency",
    "http": "flowrl.rewards.http_client:HttpReward",
    "vlm": "flowrl.rewards.vlm:VlmReward",
    "multi": "flowrl.rewards.multi:MultiReward",
    "route_by_data_source": "flowrl.rewards.multi:DataSourceRouter",
}


def register_reward(name: str, factory: Callable[..., Reward], *, overwrite: bool = False) -> None:
    """Make `factory(**options)` buildable as `name` (for user-defined rewards)."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"reward name {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = factory


def unregister_reward(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def _resolve_factory(name: str) -> Callable[..., Reward]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward name {name!r}; registered rewards: {', '.join(registered_rewards())}")
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module_name, attribute = entry.split(":")
        entry = getattr(importlib.import_module(module_name), attribute)
    return entry


def _check_options(name: str, factory: Callable[..., Reward], options: dict) -> None:
    """Reject option names the factory does not accept, listing the ones it does, and name the
    required ones (no default) that are missing."""
    parameters = inspect.signature(factory).parameters
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p for p, v in parameters.items() if v.default is inspect.Parameter.empty and v.kind not in variadic]
    missing = [p for p in required if p not in options]
    if missing:
        raise ValueError(
            f"reward {name!r} needs the option(s) {', '.join(map(repr, missing))}; give them in its options, e.g. "
            f"reward.options.{missing[0]}=VALUE in a config or --option {missing[0]}=VALUE on the command line"
        )
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [p for p, v in parameters.items() if v.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"reward {name!r} has no option(s) {', '.join(map(repr, unknown))}; "
            f"accepted options: {', '.join(accepted) or '(none)'}"
        )


SPEC_KEYS = ("name", "options")


def build_reward(spec: dict | str) -> Reward:
    """Build a reward from `"name"` or `{"name": ..., "options": {...}}`."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"reward spec must be a name or a dict with 'name' and 'options', got {spec!r}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(
            f"reward spec has unknown key(s) {unknown}; use {{'name': ..., 'options': {{...}}}} "
            "and put per-reward settings under 'options'"
        )
    if "name" not in spec or not isinstance(spec["name"], str):
        raise ValueError(
            f"reward spec {spec!r} needs a string 'name'; registered rewards: {', '.join(registered_rewards())}"
        )
    name, options = spec["name"], dict(spec.get("options") or {})
    factory = _resolve_factory(name)
    _check_options(name, factory, options)
    reward = factory(**options)
    if not isinstance(reward, Reward):
        raise ValueError(f"reward factory for {name!r} returned {type(reward).__name__}, not a Reward")
    return reward

"""OCR reward: how well an image shows its target text, read by rapidocr offline.

Score (issue 5, item 2): both the target (`metadata["ground_truth"]`) and the recognised text
are lowercased with all whitespace removed; d = 0 if the target occurs in the recognised text,
else the Levenshtein distance between them; score = 1 - min(d, len(target)) / len(target).
So 1.0 means the text was read exactly, 0.0 means nothing useful was read.

rapidocr 3.x ships its detection/recognition models inside the wheel, so nothing is downloaded
with the default model choice. onnxruntime is bounded to `num_threads` threads (default 1) so
that OCR does not fight torch or sibling workers for the cores. One rapidocr engine is created
per calling thread: the async scorer calls the reward from several worker threads, and rapidocr
does not promise that one engine may be called from several threads at once.
"""

from __future__ import annotations

import re
import threading

import numpy as np
from rapidfuzz.distance import Levenshtein

from flowrl.rewards.base import RowwiseReward

_WHITESPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Lowercase and drop all whitespace: the comparison form of targets and OCR output."""
    return _WHITESPACE.sub("", text).lower()


def ocr_text_score(recognized: str, target: str) -> float:
    """1 - min(d, len(target)) / len(target) on normalized strings (see module docstring)."""
    target_norm = normalize_text(target)
    if not target_norm:
        raise ValueError(f"ground_truth {target!r} is empty after removing whitespace; give a non-empty target text")
    recognized_norm = normalize_text(recognized)
    if target_norm in recognized_norm:
        distance = 0
    else:
        distance = Levenshtein.distance(recognized_norm, target_norm)
    return 1.0 - min(distance, len(target_norm)) / len(target_norm)


def create_rapidocr_engine(num_threads: int = 1, text_score: float = 0.5):
    """A rapidocr engine with its default in-wheel models and bounded onnxruntime threads."""
    from rapidocr import (
        RapidOCR,  # imported here: 0.5 s, only rewards that read text pay it
    )

    return RapidOCR(
        params={
            "Global.log_level": "critical",
            "Global.text_score": float(text_score),
            "EngineConfig.onnxruntime.intra_op_num_threads": int(num_threads),
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
        }
    )


class OcrReward(RowwiseReward):
    """Rewards images whose recognised text matches `metadata[ground_truth_key]`."""

    name = "ocr"

    def __init__(self, num_threads: int = 1, text_score: float = 0.5, ground_truth_key: str = "ground_truth"):
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"ocr option num_threads={num_threads!r} must be an integer >= 1")
        if not 0.0 <= float(text_score) <= 1.0:
            raise ValueError(f"ocr option text_score={text_score!r} must be in [0, 1] (minimum line confidence)")
        self.num_threads = num_threads
        self.text_score = float(text_score)
        self.ground_truth_key = ground_truth_key
        self._per_thread = threading.local()

    def _engine(self):
        engine = getattr(self._per_thread, "engine", None)
        if engine is None:
            engine = create_rapidocr_engine(self.num_threads, self.text_score)
            self._per_thread.engine = engine
        return engine

    def read_text(self, image_hwc: np.ndarray) -> str:
        """All recognised lines joined with spaces ('' when nothing is found)."""
        # rapidocr treats numpy input as OpenCV BGR; our images are RGB.
        bgr = np.ascontiguousarray(image_hwc[:, :, ::-1])
        result = self._engine()(bgr)
        lines = result.txts or ()
        return " ".join(lines)

    def cannot_score(self, metadata: dict) -> str | None:
        if metadata.get(self.ground_truth_key) is not None:
            return None
        given = sorted(key for key, value in metadata.items() if value is not None)
        return (
            f"metadata has no {self.ground_truth_key!r} (the text the image must show; fields given: {given}); "
            f"give every row a {self.ground_truth_key!r} (a .jsonl written by `flowrl data ocr` has one), "
            "or choose another reward"
        )

    def score_row(self, image_hwc: np.ndarray, prompt: str, metadata: dict) -> float:
        reason = self.cannot_score(metadata)  # never a target of "None"
        if reason is not None:
            raise ValueError(reason)
        return ocr_text_score(self.read_text(image_hwc), str(metadata[self.ground_truth_key]))

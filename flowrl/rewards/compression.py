"""JPEG compressibility rewards (no weights): the size of the image saved as JPEG at quality 95.

`jpeg_compressibility` = -size in kB (smaller files score higher: flat, simple images);
`jpeg_incompressibility` = +size in kB (detail and noise score higher). kB = 1000 bytes, the
scale used by DDPO and Flow-GRPO so that reward magnitudes compare across projects.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from flowrl.rewards.base import RowwiseReward


def jpeg_size_bytes(image_hwc: np.ndarray, quality: int = 95) -> int:
    """Bytes of the RGB image encoded as JPEG at `quality` (PIL's encoder, default settings)."""
    buffer = io.BytesIO()
    Image.fromarray(image_hwc).save(buffer, format="JPEG", quality=quality)
    return buffer.tell()


class JpegCompressibility(RowwiseReward):
    name = "jpeg_compressibility"
    sign = -1.0  # smaller is better

    def __init__(self, quality: int = 95):
        if not isinstance(quality, int) or not 1 <= quality <= 95:
            raise ValueError(f"{self.name} option quality={quality!r} must be an integer in [1, 95] (PIL's JPEG range)")
        self.quality = quality

    def score_row(self, image_hwc: np.ndarray, prompt: str, metadata: dict) -> float:
        return self.sign * jpeg_size_bytes(image_hwc, self.quality) / 1000.0


class JpegIncompressibility(JpegCompressibility):
    name = "jpeg_incompressibility"
    sign = 1.0  # larger is better

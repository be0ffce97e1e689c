"""Synthetic text images: black DejaVu Sans Bold text centred on white, optionally noisy.

Used to check the OCR reward (tests, `benchmarks/ocr_speed.py`) with images whose text is known.
DejaVu Sans Bold ships with Debian's fonts-dejavu-core, which PIL finds by file name.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def render_text_image(
    text: str, size: int = 320, font_px: int = 32, noise_sigma: float = 0.0, seed: int = 0
) -> np.ndarray:
    """(3, size, size) uint8 image of `text`; Gaussian pixel noise of std `noise_sigma` if > 0."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype("DejaVuSans-Bold.ttf", font_px)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    if right - left >= size - 8:
        raise ValueError(f"text={text!r} at font_px={font_px} does not fit in size={size}; use a smaller font_px")
    origin = ((size - (right - left)) // 2 - left, (size - (bottom - top)) // 2 - top)
    draw.text(origin, text, fill="black", font=font)
    pixels = np.asarray(image).astype(np.float64)
    if noise_sigma:
        pixels = pixels + np.random.default_rng(seed).normal(0, noise_sigma, pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8).transpose(2, 0, 1).copy()

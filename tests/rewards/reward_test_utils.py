"""Helpers shared by reward tests (a module with a unique name, importable from test files)."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def render_text_image(
    text: str, size: int = 320, font_px: int = 32, noise_sigma: float = 0.0, seed: int = 0
) -> np.ndarray:
    """(3, size, size) uint8: black DejaVu Sans Bold text centred on white (+ optional noise)."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype("DejaVuSans-Bold.ttf", font_px)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    assert right - left < size - 8, f"text {text!r} does not fit; use a smaller font"
    draw.text(
        ((size - (right - left)) // 2 - left, (size - (bottom - top)) // 2 - top),
        text,
        fill="black",
        font=font,
    )
    pixels = np.asarray(image).astype(np.float64)
    if noise_sigma:
        pixels = pixels + np.random.default_rng(seed).normal(0, noise_sigma, pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8).transpose(2, 0, 1).copy()

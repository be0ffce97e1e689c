"""Helpers the reward tests import by name (a conftest module is not importable by name once
several test folders with a conftest.py share one pytest run)."""

import numpy as np


def blank_images(batch_size: int, size: int = 16) -> np.ndarray:
    """(B, 3, size, size) white uint8 images."""
    return np.full((batch_size, 3, size, size), 255, dtype=np.uint8)

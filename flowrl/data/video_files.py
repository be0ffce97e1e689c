"""Video samples as files: H.264 mp4 through PyAV (its wheel carries FFmpeg), and frame strips.

`encode_mp4(frames, fps)` -> mp4 bytes of (F, 3, H, W) uint8 frames (the rollout server's video
endpoint, validation videos on disk); `frame_strip(frames)` -> (3, H, W') uint8, the frames side
by side (a video in an image grid: tensorboard and the PNG grids). Knows nothing of models.
"""

from __future__ import annotations

import io

import numpy as np

# Most frames a strip shows: longer videos show this many, evenly spaced, first and last included.
MAX_STRIP_FRAMES = 8


def _frames_array(frames) -> np.ndarray:
    array = frames.numpy() if hasattr(frames, "numpy") else np.asarray(frames)
    if array.ndim != 4 or array.shape[1] != 3 or array.dtype != np.uint8:
        raise ValueError(f"frames must be (F, 3, H, W) uint8, got {array.shape} {array.dtype}")
    return array


def encode_mp4(frames, fps: int = 16) -> bytes:
    """(F, 3, H, W) uint8 frames -> H.264 mp4 bytes (yuv420p; odd sides are padded by one pixel,
    as the format needs even sides)."""
    import av

    array = _frames_array(frames).transpose(0, 2, 3, 1)  # (F, H, W, 3)
    height, width = array.shape[1] + array.shape[1] % 2, array.shape[2] + array.shape[2] % 2
    array = np.pad(array, ((0, 0), (0, height - array.shape[1]), (0, width - array.shape[2]), (0, 0)), mode="edge")
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in array:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def decode_mp4(data: bytes) -> np.ndarray:
    """mp4 bytes -> (F, 3, H, W) uint8 frames (for checks and clients)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24").transpose(2, 0, 1) for f in container.decode(video=0)])


def frame_strip(frames, max_frames: int = MAX_STRIP_FRAMES) -> np.ndarray:
    """(F, 3, H, W) uint8 -> (3, H, k W): at most max_frames frames, evenly spaced, side by side."""
    array = _frames_array(frames)
    count = min(len(array), max_frames)
    chosen = np.linspace(0, len(array) - 1, count).round().astype(int)
    return np.concatenate(list(array[chosen]), axis=2)

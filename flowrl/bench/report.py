"""Shared plumbing of the benchmarks: device/dtype choice, the environment record, timing,
memory, JSON that is rewritten after every measurement (a run cut short still leaves its
numbers) and plain-text tables."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from flowrl.run.flops import synchronize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shape_label(settings: dict) -> str:
    """A benchmark header's sample shape: "512px", "240x416", or "240x416, 33 frames"."""
    height, width = settings.get("height", settings.get("size")), settings.get("width", settings.get("size"))
    label = f"{height}px" if height == width else f"{height}x{width}"
    frames = settings.get("num_frames", 1)
    return label if frames == 1 else f"{label}, {frames} frames"


def sample_unit(settings: dict) -> str:
    """What a benchmark's throughput counts: "img", or "videos" when the samples have frames."""
    return "img" if settings.get("num_frames", 1) == 1 else "videos"


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """'auto': cuda + bfloat16 when a GPU is present, else cpu + float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is unknown; use auto or one of {sorted(DTYPES)}")
    return torch.device(device), DTYPES[dtype]


def quiet_libraries() -> None:
    """Silence per-call warnings of diffusers/transformers (they would flood the timed loops)."""
    import logging

    for name in ("diffusers", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    except ImportError:
        pass


def environment(device: torch.device) -> dict:
    import diffusers

    env = {
        "command": " ".join(["flowrl", *sys.argv[1:]]) if sys.argv and "flowrl" in sys.argv[0] else " ".join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "device": str(device),
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            sdpa_flash=torch.backends.cuda.flash_sdp_enabled(),
            sdpa_cudnn=torch.backends.cuda.cudnn_sdp_enabled(),
            sdpa_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
        )
    else:
        env["gpu"] = None
    return env


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def peak_memory(device: torch.device) -> dict:
    """The peaks a loop's report keeps: allocated, and reserved by the caching allocator, which also
    counts the memory CUDA graph pools hold (their replays allocate nothing)."""
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None
    return {"peak_memory_gb": peak_memory_gb(device), "peak_memory_reserved_gb": reserved}


def time_runs(run_once, device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of run_once(), synchronized before and after."""
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        run_once()
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
    return seconds


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class JsonReport:
    """A dict written to `path` (if any) after every update."""

    def __init__(self, path: str | None, data: dict):
        self.path = Path(path) if path else None
        self.data = data
        self.save()

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=2, default=str))


def format_table(headers: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in text]
    return "\n".join(lines)

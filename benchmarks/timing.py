"""Timing shared by the experiments: sustained per-call seconds, and A/B variants timed in
alternation, round after round, so that clock and temperature drift hit each variant alike.

Imported by the scripts next to it (`python benchmarks/<script>.py` puts this folder on the path).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from flowrl.run.flops import synchronize


def sustained_seconds(fn: Callable, device: torch.device, seconds: float) -> dict:
    """Per-call seconds of fn: 2 warm-up calls, then enough calls for about `seconds`, timed as one
    block (the sustained rate: a power-capped card lowers its clocks after a second or two of dense
    work) after a 1-call estimate."""
    for _ in range(2):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    once = max(time.perf_counter() - t0, 1e-6)
    count = max(2, int(seconds / once))
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    synchronize(device)
    return {"seconds": (time.perf_counter() - t0) / count, "calls": count}


def add_arguments(parser: argparse.ArgumentParser, seconds: float) -> None:
    """--rounds, --seconds (per variant per round) and --device."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=seconds, help="timed seconds per variant per round")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def alternate(
    variants: dict[str, Callable], device: torch.device, rounds: int, seconds: float
) -> dict[str, list[float]]:
    """Seconds per call of each variant in each round (each a sustained figure)."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(sustained_seconds(fn, device, seconds)["seconds"])
    return times


def rounds_line(label: str, values: list[float]) -> str:
    """'label  ms ms ms   median ms' for one variant's rounds."""
    return (
        f"{label} "
        + "  ".join(f"{v * 1e3:8.2f}" for v in values)
        + f"   median {statistics.median(values) * 1e3:8.2f} ms"
    )


def kernel_names(fn: Callable) -> list[str]:
    """The CUDA kernels one call of fn launches, in order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

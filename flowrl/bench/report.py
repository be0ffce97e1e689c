"""Shared plumbing of the benchmarks: device/dtype choice, the environment record, timing,
memory, JSON that is rewritten after every measurement (a run cut short still leaves its
numbers), plain-text tables, and a profile summary that says where the GPU time went."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from flowrl.bench.flops import synchronize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


# Kernel-name fragments -> category, checked in order (first match wins).
_KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "sm90_flash")),
    ("convolution", ("conv", "fprop", "dgrad", "wgrad", "implicit_gemm", "winograd")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
    ("compiled (triton)", ("triton",)),
    (
        "norm/elementwise",
        ("norm", "elementwise", "vectorized", "reduce", "softmax", "silu", "gelu", "copy", "cat", "mul", "add"),
    ),
)


def kernel_category(name: str) -> str:
    """The category (_KERNEL_CATEGORIES) of a kernel's or an op's name; "other" if none matches."""
    name = name.lower()
    return next((c for c, keys in _KERNEL_CATEGORIES if any(k in name for k in keys)), "other")


def device_events(events) -> list:
    """The GPU's own work among a profile's key_averages: kernels, memsets and copies. Left out:
    the host's ops (an eager op called on the profiled thread carries its kernels' time as its
    own) and the GPU-side copies of host annotations (`Optimizer.step#AdamW.step` spans the
    optimizer's kernels); either would count those kernels twice (a GPU busy more than 100%)."""
    host = torch.autograd.DeviceType.CPU
    host_names = {e.key for e in events if e.device_type == host}
    return [e for e in events if e.device_type != host and e.key not in host_names]


def busy_within_span(raw_events, gaps: int = 5) -> dict | None:
    """How much of the profiled span the GPU was running anything: the union of the device events'
    intervals (kernels, memsets, copies; as device_events chooses them) over the time from the
    first one's start to the last one's end. Idle gaps inside the span are host waits (a sync, or
    a host slower than the GPU); the `gaps` longest are listed with when they began (ms into the
    span) and the device work on either side. None without device events."""
    host = torch.autograd.DeviceType.CPU
    host_names = {e.name for e in raw_events if e.device_type == host}
    intervals = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in raw_events
        if e.device_type != host and e.name not in host_names and e.time_range.end > e.time_range.start
    )
    if not intervals:
        return None
    span_start, end, last_name = intervals[0]
    busy, start, idle = 0.0, span_start, []
    for a, b, name in intervals[1:]:
        if a > end:
            busy += end - start
            idle.append((a - end, end, last_name, name))
            start = a
        if b >= end:
            end, last_name = b, name
    busy += end - start
    longest = sorted(idle, reverse=True)[:gaps]
    return {
        "span_ms": (end - span_start) / 1000.0,
        "busy_ms": busy / 1000.0,
        "share": busy / max(end - span_start, 1e-9),
        "gaps": len(idle),
        "longest_gaps": [
            {"ms": length / 1000.0, "at_ms": (at - span_start) / 1000.0, "after": after[:80], "before": before[:80]}
            for length, at, after, before in longest
        ],
    }


def profile_summary(fn, device: torch.device, row_limit: int = 15) -> dict:
    """Run fn() under torch.profiler; return device time per kernel category and the top kernels
    (self device time, or self CPU time on a CPU run)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.key_averages()
    on_gpu = device.type == "cuda"

    def self_time(e) -> float:
        if on_gpu:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))
        return float(e.self_cpu_time_total)

    kernels = [
        e
        for e in (device_events(events) if on_gpu else [e for e in events if e.key.startswith("aten::")])
        if self_time(e) > 0
    ]
    total = sum(self_time(e) for e in kernels) or 1.0
    categories: dict[str, float] = {}
    for e in kernels:
        category = kernel_category(e.key)
        categories[category] = categories.get(category, 0.0) + self_time(e)
    top = sorted(kernels, key=self_time, reverse=True)[:row_limit]
    span = busy_within_span(prof.events()) if on_gpu else None
    return {
        **({"busy_within_span": span} if span else {}),
        "clock": "device" if on_gpu else "cpu",
        "total_ms": total / 1000.0,
        "share_by_category": {c: t / total for c, t in sorted(categories.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": e.key[:120], "ms": self_time(e) / 1000.0, "share": self_time(e) / total, "calls": e.count}
            for e in top
        ],
    }


def profile_lines(profile: dict, label: str, top: int = 8, indent: str = "   ") -> list[str]:
    """Plain-text lines of a profile_summary result: the share per kernel category (and, when
    measured, how busy the GPU was), then the top kernels and the longest idle gaps."""
    from flowrl.bench.summary import busy_text, idle_gap_texts

    shares = ", ".join(f"{c} {s:.0%}" for c, s in profile["share_by_category"].items())
    lines = [
        f"{indent}profile of {label} ({profile['clock']} time {profile['total_ms']:.0f} ms"
        f"{busy_text(profile, 'the timed wall time')}): {shares}"
    ]
    for k in profile["top_kernels"][:top]:
        lines.append(f"{indent}  {k['share']:6.1%}  {k['ms']:9.2f} ms  x{k['calls']:<5d} {k['name']}")
    span = profile.get("busy_within_span")
    if span and span.get("longest_gaps"):
        head, gaps = idle_gap_texts(span)
        lines += [f"{indent}  {head}; the longest:"] + [f"{indent}    {gap}" for gap in gaps]
    return lines


def saved_activation_bytes(fn, model: torch.nn.Module) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn() runs, the model's
    parameters (trainable or frozen) left out: saving a parameter costs no memory."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes.values())

"""`flowrl bench train --profile`: one more training step under torch.profiler, phase by phase.

The trainer marks its phases with `torch.profiler.record_function` ranges (PHASE_RANGES). For each
phase the profile reports its wall time and, on a GPU: the share of that time the GPU was running
anything, its idle gaps, the device time per kernel category, and which host ops were running on
the threads that launch the phase's kernels while the GPU was idle. Where a phase is bound by the
host launching work (the GPU waits for it), those ops are the host work a faster phase has to cut;
where the GPU is busy throughout, the kernels are. The idle time is also split by the length of
its gaps: many gaps of microseconds are launch overhead spread over every kernel, a few of tens of
milliseconds are stalls (a wait for the device, a copy to the host, a garbage collection: Python's
collections show as `python gc (generation N)` ops, flowrl.bench.gc_pauses). Gaps of 0.1 ms or
more are also counted per kernel that ended them (with the kernel most often just before them),
and split by when that kernel's launch call (the CUDA runtime or driver call with the kernel's
correlation id) returned: before the gap began (the kernel was queued and the GPU idled anyway:
the wait was on the device's side) or inside it
(the GPU waited for the host to launch it; how much of the gap the launch call itself took says
whether the host was busy elsewhere or blocked inside the driver's call). Each such kernel also
names the host op its launch call ran in, most often (aten::mm for a cuBLAS GEMM and the memsets
cuBLAS issues for it, the attention op for cuDNN's, an inductor kernel's own name for a compiled
one): where a memset ends the gaps, that names the library that asked for it. Host ops nest
(an autograd node holds the ops it calls), so each op's figure is the idle time it was running,
its callees' included. On a CPU run each phase lists its ops by their own (self) CPU time instead.
"""

from __future__ import annotations

import bisect
import re

import torch

from flowrl.bench.gc_pauses import GcPauses
from flowrl.bench.report import kernel_category, synchronize

# phase -> the name of the trainer's record_function range around it (flowrl.trainer.trainer,
# flowrl.trainer.update)
PHASE_RANGES = {
    "rollout": "flowrl/rollout",
    "old_log_prob": "flowrl/old_log_prob",
    "update": "flowrl/update",
}
_RANGE_NAMES = frozenset(PHASE_RANGES.values())
# upper edges (ms) of the idle-gap length classes a phase's idle time is split into; the last is open
GAP_CLASSES_MS = (0.1, 1.0, 10.0, 100.0)
# gaps at least this long (ms) are attributed to the kernel that ends them: the GPU waited for its launch
LONG_GAP_MS = 0.1
# a CUDA runtime or driver API call's name (cudaLaunchKernel, cuLaunchKernelEx), not an op's (aten::cumsum)
_API_CALL = re.compile(r"cu(da)?[A-Z]")


def profile_step(fn, device: torch.device, top: int = 8) -> dict:
    """Run fn() (a training step) under torch.profiler; return {"clock": "device"|"cpu", "phases":
    {phase: phase_summary(...)}} for every phase range fn ran (the last one, if one ran twice)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, experimental_config=_all_threads()) as prof, GcPauses(mark_in_profile=True):
        fn()
        synchronize(device)
    events = prof.events()
    host = torch.autograd.DeviceType.CPU
    ranges = {e.name: e for e in events if e.device_type == host and e.name in _RANGE_NAMES}
    phases = {
        phase: phase_summary(events, ranges[name].time_range.start, ranges[name].time_range.end, on_gpu, top)
        for phase, name in PHASE_RANGES.items()
        if name in ranges
    }
    return {"clock": "device" if on_gpu else "cpu", "phases": phases}


def _all_threads():
    """A profiler config that records the host ops of every thread (the engine's rollout thread
    started before the profiler), where this torch has the option; else None (the calling thread
    and the autograd threads it runs backwards on)."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


def phase_summary(events, start: float, end: float, on_gpu: bool, top: int = 8) -> dict:
    """One phase's figures from a profile's events (torch.autograd.profiler FunctionEvents; times in
    microseconds) within [start, end]: see the module docstring."""
    host = torch.autograd.DeviceType.CPU
    inside = [e for e in events if e.time_range.start < end and e.time_range.end > start]
    host_ops = [e for e in inside if e.device_type == host and e.name not in _RANGE_NAMES]
    out = {"wall_ms": (end - start) / 1000.0}
    if not on_gpu:
        own = {}
        for e in host_ops:
            own[e.name] = own.get(e.name, 0.0) + float(e.self_cpu_time_total)
        out["host_ops_self_ms"] = _top_ms(own, top)
        return out
    host_names = {e.name for e in events if e.device_type == host}
    device_events = [
        e
        for e in inside
        if e.device_type != host and e.name not in host_names and e.time_range.end > e.time_range.start
    ]
    device_work = [(max(e.time_range.start, start), min(e.time_range.end, end), e.name) for e in device_events]
    busy, gaps = busy_and_gaps(device_work, start, end)
    categories: dict[str, float] = {}
    for a, b, name in device_work:
        category = kernel_category(name)
        categories[category] = categories.get(category, 0.0) + (b - a)
    kernel_time = sum(categories.values()) or 1.0
    # The threads that launch this phase's kernels (an op's `kernels` are those it launched; the CUDA
    # runtime's launch calls are host events of their own).
    launchers = {e.thread for e in host_ops if e.kernels or "LaunchKernel" in e.name}
    idle = host_time_in_gaps([e for e in host_ops if e.thread in launchers], gaps)
    idle_total = sum(b - a for a, b in gaps)
    starts = [(a, e.id) for (a, _, _), e in zip(device_work, device_events)]
    out.update(
        gpu_busy=busy / max(end - start, 1e-9),
        idle_ms=idle_total / 1000.0,
        gaps=len(gaps),
        longest_gaps_ms=sorted(((b - a) / 1000.0 for a, b in gaps), reverse=True)[:5],
        idle_by_gap_length=idle_by_gap_length(gaps),
        kernels_after_long_gaps_ms=kernels_after_gaps(
            device_work, gaps, LONG_GAP_MS, top, launched_by=long_gap_launchers(starts, host_ops, gaps, LONG_GAP_MS)
        ),
        long_gaps_by_launch=long_gaps_by_launch(starts, launch_calls(host_ops), gaps, LONG_GAP_MS),
        share_by_category={c: t / kernel_time for c, t in sorted(categories.items(), key=lambda kv: -kv[1])},
        host_ops_in_idle_ms=_top_ms(idle, top),
    )
    return out


def profile_gaps(events, top: int = 8) -> dict | None:
    """How busy the GPU was over a whole profile (a benchmark's profiled calls, from its first
    device event to its last) and its long gaps: {"gpu_busy", "idle_ms", "kernels_after_long_gaps_ms",
    "long_gaps_by_launch"}, as phase_summary reports a phase; None without device events."""
    host = torch.autograd.DeviceType.CPU
    host_events = [e for e in events if e.device_type == host]
    host_names = {e.name for e in host_events}
    device_events = [e for e in events if e.device_type != host and e.name not in host_names]
    if not device_events:
        return None
    work = [(e.time_range.start, e.time_range.end, e.name) for e in device_events]
    start, end = min(a for a, _, _ in work), max(b for _, b, _ in work)
    busy, gaps = busy_and_gaps(work, start, end)
    starts = [(e.time_range.start, e.id) for e in device_events]
    launched_by = long_gap_launchers(starts, host_events, gaps, LONG_GAP_MS)
    return {
        "gpu_busy": busy / max(end - start, 1e-9),
        "idle_ms": sum(b - a for a, b in gaps) / 1000.0,
        "kernels_after_long_gaps_ms": kernels_after_gaps(work, gaps, LONG_GAP_MS, top, launched_by=launched_by),
        "long_gaps_by_launch": long_gaps_by_launch(starts, launch_calls(host_events), gaps, LONG_GAP_MS),
    }


def busy_and_gaps(intervals, start: float, end: float) -> tuple[float, list[tuple[float, float]]]:
    """The time within [start, end] covered by the union of `intervals` ((a, b, ...) tuples), and
    the uncovered stretches as sorted (a, b) gaps (the edges of the window included)."""
    busy, gaps, covered = 0.0, [], start
    for a, b, *_ in sorted(intervals):
        if a > covered:
            gaps.append((covered, a))
        if b > covered:
            busy += b - max(a, covered)
            covered = b
    if end > covered:
        gaps.append((covered, end))
    return busy, gaps


def idle_by_gap_length(gaps: list[tuple[float, float]]) -> list[dict]:
    """The gaps (microseconds) per length class of GAP_CLASSES_MS: [{"up_to_ms" (None: open),
    "gaps", "idle_ms"}], every class listed."""
    classes = [{"up_to_ms": edge, "gaps": 0, "idle_ms": 0.0} for edge in (*GAP_CLASSES_MS, None)]
    for a, b in gaps:
        ms = (b - a) / 1000.0
        entry = classes[bisect.bisect_left(GAP_CLASSES_MS, ms)]
        entry["gaps"] += 1
        entry["idle_ms"] += ms
    return classes


def kernels_after_gaps(
    intervals,
    gaps: list[tuple[float, float]],
    min_ms: float,
    top: int = 8,
    launched_by: dict[float, str] | None = None,
) -> list[dict]:
    """Per name of the kernel (or copy) that ended them, the `gaps` (microseconds) of at least
    `min_ms`: [{"name", "gaps", "ms", "after", "launched_by"}], longest total first; "after" names
    the kernel that most often ran last before those gaps (None where no kernel ran before one),
    "launched_by" the host op that most often launched the kernel ending them (from `launched_by`:
    a device event's start -> that op's name, long_gap_launchers(); None where none is known).
    `intervals` are the (start, end, name) device events the gaps were computed from; a gap ends
    where one of them starts (the window's last gap, which ends at the phase's end, is left out)
    and begins where the last one before it ended."""
    first_at: dict[float, str] = {}
    last_at: dict[float, str] = {}
    for a, b, name in sorted(intervals):
        first_at.setdefault(a, name)
        last_at[b] = name
    counts: dict[str, int] = {}
    totals: dict[str, float] = {}
    before: dict[str, dict[str | None, int]] = {}
    launchers: dict[str, dict[str | None, int]] = {}
    for a, b in gaps:
        name = first_at.get(b)
        if name is None or (b - a) / 1000.0 < min_ms:
            continue
        counts[name] = counts.get(name, 0) + 1
        totals[name] = totals.get(name, 0.0) + (b - a)
        previous, prior = before.setdefault(name, {}), last_at.get(a)
        previous[prior] = previous.get(prior, 0) + 1
        ops, op = launchers.setdefault(name, {}), (launched_by or {}).get(b)
        ops[op] = ops.get(op, 0) + 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [
        {
            "name": name[:120],
            "gaps": counts[name],
            "ms": us / 1000.0,
            "after": _truncated(_most_common(before[name])),
            "launched_by": _truncated(_most_common(launchers[name])),
        }
        for name, us in ranked
    ]


def _truncated(name: str | None) -> str | None:
    return None if name is None else name[:120]


def _most_common(counts: dict[str | None, int]) -> str | None:
    """The most counted name, a known one before None at equal counts."""
    return max(counts.items(), key=lambda kv: (kv[1], kv[0] is not None))[0]


def long_gap_launchers(
    starts: list[tuple[float, int]], host_events, gaps: list[tuple[float, float]], min_ms: float
) -> dict[float, str]:
    """For each device event that ends one of the `gaps` of at least `min_ms`: its start -> the
    innermost host op its launch call ran in (launching_ops). `starts`: (start, correlation id) of
    the device events the gaps were computed from."""
    ends = {b for a, b in gaps if (b - a) / 1000.0 >= min_ms}
    enders = {}
    for a, correlation in sorted(starts):
        if a in ends:
            enders.setdefault(a, correlation)
    ops = launching_ops(host_events, set(enders.values()))
    return {a: ops[correlation] for a, correlation in enders.items() if correlation in ops}


def launching_ops(host_events, correlation_ids: set[int]) -> dict[int, str]:
    """The innermost host op around the launch call of each of `correlation_ids` (launch_calls()),
    on the call's thread: {id: op name}. The trainer's phase ranges do not count, nor an event
    within the call's own time (the driver's "Command Buffer Full" while the call blocks), and a
    call that ran in no op is left out. Ops nest, so scanning back from the last op started before
    the call, the first one that also ends after it is the innermost."""
    calls = [e for e in host_events if e.id in correlation_ids and _API_CALL.match(e.name)]
    threads = {e.thread for e in calls}
    ops_by_thread: dict[int, list] = {}
    for e in host_events:
        if e.thread in threads and not _API_CALL.match(e.name) and e.name not in _RANGE_NAMES:
            ops_by_thread.setdefault(e.thread, []).append(e)
    starts_by_thread = {}
    for thread, ops in ops_by_thread.items():
        ops.sort(key=lambda e: (e.time_range.start, -e.time_range.end))  # an outer op before one it holds
        starts_by_thread[thread] = [e.time_range.start for e in ops]
    out = {}
    for call in calls:
        ops = ops_by_thread.get(call.thread, [])
        i = bisect.bisect_right(starts_by_thread.get(call.thread, []), call.time_range.start) - 1
        while i >= 0 and not _holds(ops[i].time_range, call.time_range):
            i -= 1
        if i >= 0:
            out[call.id] = ops[i].name
    return out


def _holds(outer, inner) -> bool:
    """Whether the time range `outer` holds `inner` and is more than it."""
    return (
        outer.start <= inner.start and outer.end >= inner.end and (outer.start, outer.end) != (inner.start, inner.end)
    )


def launch_calls(host_events) -> dict[int, tuple[float, float]]:
    """The CUDA runtime and driver calls among `host_events` (cudaLaunchKernel, cuLaunchKernelEx,
    cudaMemsetAsync, ...) by correlation id, the id their kernel or copy carries: {id: (start, end)}."""
    return {e.id: (e.time_range.start, e.time_range.end) for e in host_events if _API_CALL.match(e.name)}


def long_gaps_by_launch(
    starts: list[tuple[float, int]],
    calls: dict[int, tuple[float, float]],
    gaps: list[tuple[float, float]],
    min_ms: float,
) -> dict[str, dict]:
    """The `gaps` of at least `min_ms`, split by when the launch call of the kernel that ended each
    one returned (module docstring): {"queued_before_gap", "launched_in_gap", "unmatched": {"gaps",
    "ms"}}, and for "launched_in_gap" also "launch_call_ms", the part of those gaps the launch calls
    themselves took. `starts`: (start, correlation id) of the device events the gaps were computed
    from; `calls`: launch_calls(); a kernel whose call the profile lacks is unmatched."""
    first_id: dict[float, int] = {}
    for a, correlation in sorted(starts):
        first_id.setdefault(a, correlation)
    out = {key: {"gaps": 0, "ms": 0.0} for key in ("queued_before_gap", "launched_in_gap", "unmatched")}
    out["launched_in_gap"]["launch_call_ms"] = 0.0
    for a, b in gaps:
        if b not in first_id or (b - a) / 1000.0 < min_ms:
            continue
        call = calls.get(first_id[b])
        if call is None:
            key = "unmatched"
        elif call[1] <= a:
            key = "queued_before_gap"
        else:
            key = "launched_in_gap"
            out[key]["launch_call_ms"] += max(0.0, min(call[1], b) - max(call[0], a)) / 1000.0
        out[key]["gaps"] += 1
        out[key]["ms"] += (b - a) / 1000.0
    return out


def host_time_in_gaps(host_ops, gaps: list[tuple[float, float]]) -> dict[str, float]:
    """Per host op name, the time its calls overlap the sorted, disjoint `gaps`."""
    starts = [a for a, _ in gaps]
    time: dict[str, float] = {}
    for e in host_ops:
        a, b = e.time_range.start, e.time_range.end
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        overlap = 0.0
        while i < len(gaps) and gaps[i][0] < b:
            overlap += max(0.0, min(b, gaps[i][1]) - max(a, gaps[i][0]))
            i += 1
        if overlap > 0:
            time[e.name] = time.get(e.name, 0.0) + overlap
    return time


def _top_ms(times_us: dict[str, float], top: int) -> list[dict]:
    return [
        {"name": name[:120], "ms": us / 1000.0}
        for name, us in sorted(times_us.items(), key=lambda kv: -kv[1])[:top]
        if us > 0
    ]

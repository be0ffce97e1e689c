"""flowrl.bench.step_profile: a phase's GPU busy share, idle gaps and the host ops that ran in
them, from hand-made profiler events with known times (microseconds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.bench.step_profile import (
    busy_and_gaps,
    host_time_in_gaps,
    idle_by_gap_length,
    kernels_after_gaps,
    launch_calls,
    launching_ops,
    long_gaps_by_launch,
    phase_summary,
    profile_gaps,
)
from flowrl.bench.summary import (
    PROFILER_SLOWDOWN_FLAGGED,
    kernels_after_gaps_text,
    launch_split_text,
    profiled_time_text,
)

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _event(name, start, end, device=CPU, thread=1, launches=False, self_us=0.0, id=0):
    return SimpleNamespace(
        id=id,
        name=name,
        device_type=device,
        thread=thread,
        time_range=SimpleNamespace(start=start, end=end),
        kernels=["k"] if launches else [],
        self_cpu_time_total=self_us,
    )


def test_busy_and_gaps_take_the_union_of_overlapping_intervals():
    busy, gaps = busy_and_gaps([(10, 30, "a"), (20, 40, "b"), (50, 60, "c"), (52, 55, "d")], 0, 100)
    assert busy == 40  # [10, 40] and [50, 60]
    assert gaps == [(0, 10), (40, 50), (60, 100)]
    assert busy_and_gaps([], 0, 5) == (0.0, [(0, 5)])


def test_host_time_in_gaps_counts_each_ops_overlap():
    gaps = [(0, 10), (40, 50), (60, 100)]
    ops = [_event("long", 5, 70), _event("inside", 42, 44), _event("none", 12, 38), _event("long", 95, 120)]
    assert host_time_in_gaps(ops, gaps) == {"long": 5 + 10 + 10 + 5, "inside": 2}


def test_idle_time_is_split_by_gap_length():
    # gaps in microseconds: 50 us and 100 us (up to 0.1 ms), 0.5 ms, 20 ms, 150 ms (the open class)
    gaps = [(0, 50), (100, 200), (300, 800), (1000, 21_000), (30_000, 180_000)]
    classes = idle_by_gap_length(gaps)
    assert [c["up_to_ms"] for c in classes] == [0.1, 1.0, 10.0, 100.0, None]
    assert [c["gaps"] for c in classes] == [2, 1, 0, 1, 1]
    assert [c["idle_ms"] for c in classes] == pytest.approx([0.15, 0.5, 0.0, 20.0, 150.0])


def test_long_gaps_are_counted_per_kernel_that_ended_them():
    work = [
        (0, 100, "gemm"),
        (300, 400, "attention"),
        (450, 500, "gemm"),
        (800, 900, "attention"),
        (2000, 2100, "gemm"),
    ]
    busy, gaps = busy_and_gaps(work, 0, 3000)
    # gaps: 200 us before attention, 50 us before gemm (short), 300 us before attention, 1100 us
    # before gemm, then 900 us to the window's end (no kernel ended it)
    assert kernels_after_gaps(work, gaps, min_ms=0.1) == [
        {"name": "gemm", "gaps": 1, "ms": 1.1, "after": "attention", "launched_by": None},
        {"name": "attention", "gaps": 2, "ms": 0.5, "after": "gemm", "launched_by": None},
    ]
    assert kernels_after_gaps(work, gaps, min_ms=1.0) == [
        {"name": "gemm", "gaps": 1, "ms": 1.1, "after": "attention", "launched_by": None}
    ]


def test_the_kernel_before_a_gap_is_the_one_that_ended_last_before_it():
    # "b" ends last before the first gemm's gap though "a" started first; the first gap opens the
    # window, so no kernel ran before it
    work = [(100, 150, "a"), (120, 200, "b"), (500, 600, "gemm"), (700, 800, "b"), (1200, 1300, "gemm")]
    busy, gaps = busy_and_gaps(work, 0, 1300)
    assert kernels_after_gaps(work, gaps, min_ms=0.05, top=2) == [
        {"name": "gemm", "gaps": 2, "ms": 0.7, "after": "b", "launched_by": None},
        {"name": "a", "gaps": 1, "ms": 0.1, "after": None, "launched_by": None},
    ]


def test_long_gaps_are_split_by_when_their_kernels_launch_call_returned():
    work = [(0, 100, 1), (300, 400, 2), (900, 1000, 3), (2000, 2100, 4), (2150, 2200, 5)]
    busy, gaps = busy_and_gaps([(a, b, "k") for a, b, _ in work], 0, 2200)
    calls = launch_calls(
        [
            _event("cudaLaunchKernel", 20, 30, id=2),  # returned before its gap (100-300) began: queued
            _event("cuLaunchKernelEx", 350, 880, id=3),  # blocked in the call through its gap (400-900)
            _event("aten::cumsum", 0, 2200, id=4),  # an op, not a launch call: kernel 4 is unmatched
            _event("cudaLaunchKernel", 2120, 2130, id=5),  # ends a 50 us gap: too short to count
        ]
    )
    assert set(calls) == {2, 3, 5}
    split = long_gaps_by_launch([(a, correlation) for a, _, correlation in work], calls, gaps, min_ms=0.1)
    assert split["queued_before_gap"] == pytest.approx({"gaps": 1, "ms": 0.2})
    assert split["launched_in_gap"] == pytest.approx({"gaps": 1, "ms": 0.5, "launch_call_ms": 0.48})
    assert split["unmatched"] == pytest.approx({"gaps": 1, "ms": 1.0})
    text = launch_split_text(split)
    assert "returned before the gap began 1 gaps 0.2 ms" in text and "no call found 1 gaps 1.0 ms" in text
    assert "returned inside it 1 gaps 0.5 ms (the calls themselves 0.5 ms of it)" in text
    assert launch_split_text(long_gaps_by_launch([], calls, gaps, min_ms=0.1)) == ""


def test_a_launch_call_is_attributed_to_the_innermost_op_around_it_on_its_thread():
    events = [
        _event("flowrl/update", 0, 1000),  # a phase range is not an op
        _event("CompiledFunctionBackward", 10, 900),
        _event("aten::mm", 20, 60),
        _event("cudaMemsetAsync", 30, 35, id=1),  # cuBLAS's memset, inside aten::mm
        _event("cuLaunchKernel", 70, 75, id=2),  # after aten::mm ended: in the backward node itself
        _event("aten::_cudnn_attention_backward", 100, 300),
        _event("aten::empty", 110, 120),  # a sibling that ended before the call
        _event("cudaMemsetAsync", 150, 155, id=3),
        _event("aten::mm", 150, 400, thread=2),  # the same time on another thread: not its op
        _event("cudaLaunchKernel", 950, 960, id=4),  # in no op but the phase range
        _event("cudaLaunchKernel", 40, 45, id=5),  # not asked for
    ]
    assert launching_ops(events, {1, 2, 3, 4}) == {
        1: "aten::mm",
        2: "CompiledFunctionBackward",
        3: "aten::_cudnn_attention_backward",
    }


def test_the_gaps_a_kernel_ended_name_the_op_that_most_often_launched_it():
    events = [
        _event("flowrl/update", 0, 3000),
        _event("aten::mm", 0, 10),
        _event("cudaMemsetAsync", 2, 4, id=2),
        _event("aten::_cudnn_attention_backward", 20, 30),
        _event("cudaMemsetAsync", 22, 24, id=3),
        _event("aten::mm", 40, 50),
        _event("cudaMemsetAsync", 42, 44, id=4),
        _event("gemm", 50, 200, device=CUDA, id=1),  # after a gap too short to count
        _event("Memset (Device)", 500, 510, device=CUDA, id=2),
        _event("Memset (Device)", 900, 910, device=CUDA, id=3),
        _event("Memset (Device)", 1300, 1310, device=CUDA, id=4),
    ]
    p = phase_summary(events, 0, 1310, on_gpu=True)
    [memsets] = p["kernels_after_long_gaps_ms"]
    assert memsets["name"] == "Memset (Device)" and memsets["gaps"] == 3
    assert memsets["launched_by"] == "aten::mm"  # two of its three gaps
    text = kernels_after_gaps_text(p["kernels_after_long_gaps_ms"])
    assert text.endswith(": Memset (Device) 3 gaps 1.1 ms (after Memset (Device); launched in aten::mm)")


def test_phase_summary_attributes_idle_gpu_time_to_the_launching_threads_ops():
    events = [
        _event("flowrl/update", 0, 1000),
        # the launching thread: a backward node holding a copy, then a launch
        _event("autograd::engine::evaluate_function: Backward", 100, 500, thread=2),
        _event("aten::copy_", 300, 400, thread=2, launches=True),
        _event("cudaLaunchKernel", 480, 490, thread=2, id=7),
        # another thread's op during the idle time is not the cause
        _event("reward scoring", 0, 1000, thread=3),
        _event("sm90_xmma_gemm_bf16", 0, 300, device=CUDA),
        _event("triton_poi_fused_add_0", 500, 1000, device=CUDA, id=7),
        _event("triton_poi_fused_add_0", 2000, 3000, device=CUDA, id=8),  # after the phase
    ]
    p = phase_summary(events, 0, 1000, on_gpu=True)
    assert p["wall_ms"] == pytest.approx(1.0)
    assert p["gpu_busy"] == pytest.approx(0.8) and p["idle_ms"] == pytest.approx(0.2) and p["gaps"] == 1
    assert p["share_by_category"] == pytest.approx({"compiled (triton)": 0.625, "matmul": 0.375})
    assert [c["gaps"] for c in p["idle_by_gap_length"]] == [0, 1, 0, 0, 0]  # one gap of 0.2 ms
    # its kernel's launch call returned 190 us into it, having run for the gap's last 10 us before that
    launched = p["long_gaps_by_launch"]["launched_in_gap"]
    assert launched == pytest.approx({"gaps": 1, "ms": 0.2, "launch_call_ms": 0.01})
    idle = {op["name"]: op["ms"] for op in p["host_ops_in_idle_ms"]}
    assert idle == pytest.approx(
        {"autograd::engine::evaluate_function: Backward": 0.2, "aten::copy_": 0.1, "cudaLaunchKernel": 0.01}
    )


def test_profile_gaps_report_a_whole_profile_from_its_first_kernel_to_its_last():
    events = [
        _event("cudaLaunchKernel", 10, 20, id=1),
        _event("cuLaunchKernelEx", 30, 40, id=2),  # returned before the gap began
        _event("Command Buffer Full", 30, 40),
        _event("gemm_badd", 100, 400, device=CUDA, id=1),
        _event("gemm_lora", 900, 1000, device=CUDA, id=2),
    ]
    r = profile_gaps(events)
    assert r["gpu_busy"] == pytest.approx(400 / 900) and r["idle_ms"] == pytest.approx(0.5)
    assert r["kernels_after_long_gaps_ms"] == [
        {"name": "gemm_lora", "gaps": 1, "ms": 0.5, "after": "gemm_badd", "launched_by": None}
    ]
    assert r["long_gaps_by_launch"]["queued_before_gap"] == pytest.approx({"gaps": 1, "ms": 0.5})
    assert profile_gaps([e for e in events if e.device_type == CPU]) is None


def test_phase_summary_on_the_cpu_lists_ops_by_their_own_time():
    events = [
        _event("flowrl/update", 0, 100),
        _event("aten::mm", 10, 60, self_us=50),
        _event("aten::add", 70, 80, self_us=5),
    ]
    p = phase_summary(events, 0, 100, on_gpu=False)
    assert p == {
        "wall_ms": 0.1,
        "host_ops_self_ms": [{"name": "aten::mm", "ms": 0.05}, {"name": "aten::add", "ms": 0.005}],
    }


def test_a_profiled_phase_is_read_against_its_unprofiled_time():
    """Each profiled phase states its timed steps' median; one the profiler slowed by more than
    PROFILER_SLOWDOWN_FLAGGED says that its gaps overstate the waits on the host."""
    close = profiled_time_text(9450.0, 9.39)
    assert close == " (unprofiled 9390 ms, +0.6%)"
    slowed = profiled_time_text(9390.0 * (1 + PROFILER_SLOWDOWN_FLAGGED) + 10, 9.39)
    assert slowed.startswith(" (unprofiled 9390 ms, +10.1%: ") and "overstate the waits on the host" in slowed
    assert profiled_time_text(9450.0, None) == ""  # a phase the timed steps did not run

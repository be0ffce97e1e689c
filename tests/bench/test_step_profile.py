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
    phase_summary,
)

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _event(name, start, end, device=CPU, thread=1, launches=False, self_us=0.0):
    return SimpleNamespace(
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
        {"name": "gemm", "gaps": 1, "ms": 1.1},
        {"name": "attention", "gaps": 2, "ms": 0.5},
    ]
    assert kernels_after_gaps(work, gaps, min_ms=1.0) == [{"name": "gemm", "gaps": 1, "ms": 1.1}]


def test_phase_summary_attributes_idle_gpu_time_to_the_launching_threads_ops():
    events = [
        _event("flowrl/update", 0, 1000),
        # the launching thread: a backward node holding a copy, then a launch
        _event("autograd::engine::evaluate_function: Backward", 100, 500, thread=2),
        _event("aten::copy_", 300, 400, thread=2, launches=True),
        _event("cudaLaunchKernel", 480, 490, thread=2),
        # another thread's op during the idle time is not the cause
        _event("reward scoring", 0, 1000, thread=3),
        _event("sm90_xmma_gemm_bf16", 0, 300, device=CUDA),
        _event("triton_poi_fused_add_0", 500, 1000, device=CUDA),
        _event("triton_poi_fused_add_0", 2000, 3000, device=CUDA),  # after the phase
    ]
    p = phase_summary(events, 0, 1000, on_gpu=True)
    assert p["wall_ms"] == pytest.approx(1.0)
    assert p["gpu_busy"] == pytest.approx(0.8) and p["idle_ms"] == pytest.approx(0.2) and p["gaps"] == 1
    assert p["share_by_category"] == pytest.approx({"compiled (triton)": 0.625, "matmul": 0.375})
    assert [c["gaps"] for c in p["idle_by_gap_length"]] == [0, 1, 0, 0, 0]  # one gap of 0.2 ms
    idle = {op["name"]: op["ms"] for op in p["host_ops_in_idle_ms"]}
    assert idle == pytest.approx(
        {"autograd::engine::evaluate_function: Backward": 0.2, "aten::copy_": 0.1, "cudaLaunchKernel": 0.01}
    )


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

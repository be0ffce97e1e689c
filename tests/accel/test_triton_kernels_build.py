"""The hand-written Triton kernels build for Hopper (sm_90) without a GPU, with every scalar typing
the kernels meet, and torch's analysis of them finds only their outputs written.

Each guards a failure seen once on a GPU: LLVM joining a product and the add after it into one
FMA across a bf16 rounding point, `eps` typed float64 at inductor's launch so that float64 values
reached a 32-bit bitcast, and `eps` as a Python float constant in torch's kernel analysis, whose
failure makes every argument count as written, so that an output passed twice aliases. Needs Triton (a CUDA build of torch
brings it; CPU installs skip these tests); nothing runs on a device.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from flowrl.accel.qwen_image import modulated_norm, qk_norm_rope  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)

NORM_SIGNATURE = {
    "x": "*bf16",
    "y": "*bf16",
    "gate": "*bf16",
    "shift": "*bf16",
    "scale": "*bf16",
    "x_out": "*bf16",
    "out": "*bf16",
    "batch": "i32",
    "width": "i32",
    "gate_stride": "i32",
    "shift_stride": "i32",
    "scale_stride": "i32",
    "eps": None,
    "RESIDUAL": "constexpr",
    "NORM": "constexpr",
    "BLOCK": "constexpr",
}
QK_SIGNATURE = {
    "txt": "*bf16",
    "img": "*bf16",
    "txt_weight": "*bf16",
    "img_weight": "*bf16",
    "txt_cos": "*fp32",
    "txt_sin": "*fp32",
    "img_cos": "*fp32",
    "img_sin": "*fp32",
    "out": "*bf16",
    "rows_per_token": "i32",
    "txt_tokens": "i32",
    "eps": None,
    "D": "constexpr",
    "ROWS": "constexpr",
}


def _build(kernel, signature: dict, eps_type: str, constexprs: dict):
    signature = {**signature, "eps": eps_type}
    if eps_type == "constexpr":
        constexprs = {**constexprs, "eps": 1e-6}
    return triton.compile(
        triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=HOPPER
    )


@pytest.mark.parametrize("eps_type", ["fp32", "fp64", "constexpr"])
@pytest.mark.parametrize("residual, norm", [(True, True), (True, False), (False, True)])
def test_modulated_norm_kernel_builds_for_hopper(eps_type, residual, norm):
    compiled = _build(
        modulated_norm._modulated_norm_kernel,
        NORM_SIGNATURE,
        eps_type,
        {"RESIDUAL": residual, "NORM": norm, "BLOCK": 4096},
    )
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx
    # The rounding points survive: the gate * y product and the modulation's product are rounded
    # in integer arithmetic, so no FMA joins them to the add that follows (with plain bf16 casts
    # LLVM made x + gate * y one `fma.rn.bf16`, rounded once). Only the variance sum (16 values
    # per thread at 8 warps, float32) may use FMAs.
    fmas = [line.split()[0] for line in ptx.splitlines() if line.strip().startswith("fma.")]
    assert len(fmas) <= (16 if norm else 0) and set(fmas) <= {"fma.rn.f32"}, fmas


@pytest.mark.parametrize("eps_type", ["fp32", "fp64", "constexpr"])
def test_qk_norm_rope_kernel_builds_for_hopper(eps_type):
    compiled = _build(qk_norm_rope._joint_norm_rope_kernel, QK_SIGNATURE, eps_type, {"D": 128, "ROWS": 32})
    assert ".target sm_90" in compiled.asm["ptx"]


class _HopperDriver:
    """Stands in for the CUDA driver where torch's analysis asks for the current target."""

    def get_current_target(self):
        return HOPPER


def test_torch_finds_only_the_outputs_written(monkeypatch):
    """torch's analysis of the kernel (what decides which arguments a compiled graph treats as
    written) succeeds and finds exactly the ops' outputs, with the arguments each op passes."""
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    monkeypatch.setattr(triton.runtime.driver, "_active", _HopperDriver())  # restored after the test
    x = torch.empty(4, 2, 3072, dtype=torch.bfloat16)
    params = torch.empty(2, 18432, dtype=torch.bfloat16)
    shift, scale, gate = params[:, :3072], params[:, 3072:6144], params[:, 6144:9216]
    x_out, out = torch.empty_like(x), torch.empty_like(x)
    sizes = dict(batch=2, width=3072, gate_stride=18432, shift_stride=18432, scale_stride=18432, BLOCK=4096)
    calls = {  # as norm_modulate, gated_residual and gated_residual_norm_modulate launch it
        ("out",): dict(
            x=x, y=x, gate=shift, shift=shift, scale=scale, x_out=x, out=out, eps=1e-6, RESIDUAL=False, NORM=True
        ),
        ("x_out",): dict(
            x=x, y=x, gate=gate, shift=gate, scale=gate, x_out=x_out, out=x, eps=0.0, RESIDUAL=True, NORM=False
        ),
        ("out", "x_out"): dict(
            x=x, y=x, gate=gate, shift=shift, scale=scale, x_out=x_out, out=out, eps=1e-6, RESIDUAL=True, NORM=True
        ),
    }
    for written, kwargs in calls.items():
        accesses = identify_accessed_tensors(modulated_norm._modulated_norm_kernel, {**kwargs, **sizes}, {})
        assert tuple(sorted(dep.name for dep in accesses.read_writes.writes)) == written

"""One hand-written GPU kernel for the adaptive-norm work around Qwen-Image's GEMMs: LayerNorm +
modulation, gate + residual, and both at once.

A sequence-major Qwen-Image block (flowrl.accel.qwen_image.block) runs, per stream:

    x_in  = LN(x) * (1 + scale1) + shift1                  before attention
    x     = x + gate1 * attn_out;  x_in = LN(x) * (1 + scale2) + shift2
    x     = x + gate2 * mlp_out                              the block's output

where shift, scale and gate are per row (B, D) and the rest (L, B, D). Every input and output of
these three steps is a GEMM's input or output (or the block's), so nothing fuses across them,
and inductor's kernels for them stay well short of the time the bytes they move need. This kernel
streams each row of D values once: one program per (token, row) loads it, reduces it in
registers and writes the results. Its rounding is done in integer arithmetic (see
`_round_bf16`), a few integer ops per value in a kernel bound by memory traffic.

The arithmetic rounds where eager PyTorch does in bfloat16 (float32 math, bf16 results):

    t   = bf16(gate * y);  x' = bf16(x + t)                                    gate + residual
    n   = bf16((x' - mean) * rsqrt(var + eps))    mean, var in float32         nn.LayerNorm
    out = bf16(bf16(n * bf16(1 + scale)) + shift)                              modulation

so the gate + residual is bit-for-bit eager's, and the norm differs from eager's (and inductor's)
only in its float32 reduction order. The compiled rollout (no-grad graphs, CUDA) calls it;
training graphs keep the PyTorch expression, which autograd differentiates. Under autocast (a
rollout with the trainer's mixed precision) those are not eager's rounding points: LayerNorm
returns float32 there and the modulated input is rounded once, by the next linear layer; the
block then keeps the PyTorch expression (`block._norm_kernel_applies`). Without Triton (CPU
builds) `available()` is False and callers keep the PyTorch expression.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch expression runs instead
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def applicable(x: torch.Tensor, norm: torch.nn.Module | None = None) -> bool:
    """Whether the kernel computes what the block's expression computes for x (L, B, D): CUDA,
    bfloat16 (the rounding it reproduces), and (when a norm is given) nn.LayerNorm over the last
    dim without affine weights."""
    if not (available() and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 3):
        return False
    return norm is None or (
        type(norm) is torch.nn.LayerNorm
        and not norm.elementwise_affine
        and tuple(norm.normalized_shape) == (x.shape[-1],)
    )


if triton is not None:

    @triton.jit
    def _round_bf16(x):
        # float32 -> the nearest bfloat16 value (ties to even), kept in float32, in integer
        # arithmetic. A plain cast pair does not hold on the GPU: with Triton's FP fusion on (its
        # default), LLVM turns `x + bf16(g * y)` into one `fma.rn.bf16`, so the product is never
        # rounded (gate + residual values off eager's by up to several bf16 steps).
        # Integer ops are opaque to that contraction. Finite inputs only (NaN, Inf not preserved).
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)  # the low 16 bits cleared

    @triton.jit
    def _modulated_norm_kernel(
        x,
        y,
        gate,
        shift,
        scale,
        x_out,
        out,
        batch,
        width,
        gate_stride,
        shift_stride,
        scale_stride,
        eps,
        RESIDUAL: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program r: row r of the (L * B, D) activations; its per-row parameters are row r % B.
        row = tl.program_id(0).to(tl.int64)
        b = row % batch
        cols = tl.arange(0, BLOCK)
        valid = cols < width
        v = tl.load(x + row * width + cols, mask=valid, other=0.0).to(tl.float32)
        if RESIDUAL:
            g = tl.load(gate + b * gate_stride + cols, mask=valid, other=0.0).to(tl.float32)
            t = _round_bf16(g * tl.load(y + row * width + cols, mask=valid, other=0.0).to(tl.float32))
            v = _round_bf16(v + t)
            tl.store(x_out + row * width + cols, v.to(x_out.dtype.element_ty), mask=valid)
        if NORM:
            mean = tl.sum(v, axis=0) / width
            centered = tl.where(valid, v - mean, 0.0)
            # eps arrives as a Python float (torch's analysis of this kernel) or a float64 scalar
            # (inductor's launch): cast the sum, which is a tensor either way, back to float32.
            rstd = tl.math.rsqrt((tl.sum(centered * centered, axis=0) / width + eps).to(tl.float32))
            n = _round_bf16(centered * rstd)
            s = tl.load(scale + b * scale_stride + cols, mask=valid, other=0.0).to(tl.float32)
            m = _round_bf16(n * _round_bf16(1.0 + s))
            h = tl.load(shift + b * shift_stride + cols, mask=valid, other=0.0).to(tl.float32)
            tl.store(out + row * width + cols, _round_bf16(m + h).to(out.dtype.element_ty), mask=valid)

    def _launch(x, y, gate, shift, scale, x_out, out, eps, residual: bool, norm: bool) -> None:
        length, batch, width = x.shape
        block = triton.next_power_of_2(width)
        torch.library.wrap_triton(_modulated_norm_kernel)[(length * batch,)](
            x,
            y,
            gate,
            shift,
            scale,
            x_out,
            out,
            batch,
            width,
            gate.stride(0),
            shift.stride(0),
            scale.stride(0),
            eps,
            RESIDUAL=residual,
            NORM=norm,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )

    @torch.library.triton_op("flowrl::norm_modulate", mutates_args={})
    def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        """LN(x) * (1 + scale) + shift for x (L, B, D) contiguous, shift and scale (B, D)."""
        out = torch.empty_like(x)
        # Unused pointers get inputs, never the output: an output passed twice would alias if
        # torch's mutation analysis of the kernel ever fell back to "every argument is written".
        _launch(x, x, shift, shift, scale, x, out, eps, residual=False, norm=True)
        return out

    @torch.library.triton_op("flowrl::gated_residual", mutates_args={})
    def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x + gate * y for x, y (L, B, D) contiguous, gate (B, D)."""
        x_out = torch.empty_like(x)
        _launch(x, y, gate, gate, gate, x_out, x, 0.0, residual=True, norm=False)
        return x_out

    @torch.library.triton_op("flowrl::gated_residual_norm_modulate", mutates_args={})
    def gated_residual_norm_modulate(
        x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x', LN(x') * (1 + scale) + shift) with x' = x + gate * y."""
        x_out, out = torch.empty_like(x), torch.empty_like(x)
        _launch(x, y, gate, shift, scale, x_out, out, eps, residual=True, norm=True)
        return x_out, out


def _rows_ok(t: torch.Tensor) -> torch.Tensor:
    """(B, D) per-row parameters with unit column stride (a chunk of the modulation output)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def modulated(x: torch.Tensor, norm: torch.nn.LayerNorm, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """norm(x) * (1 + scale) + shift by the kernel; call only where `applicable(x, norm)`."""
    return torch.ops.flowrl.norm_modulate(x.contiguous(), _rows_ok(shift), _rows_ok(scale), float(norm.eps))


def residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate * y by the kernel; call only where `applicable(x)`."""
    return torch.ops.flowrl.gated_residual(x.contiguous(), y.contiguous(), _rows_ok(gate))


def residual_modulated(
    x: torch.Tensor,
    gate: torch.Tensor,
    y: torch.Tensor,
    norm: torch.nn.LayerNorm,
    shift: torch.Tensor,
    scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + gate * y, norm(that) * (1 + scale) + shift) by the kernel; only where `applicable(x, norm)`."""
    return torch.ops.flowrl.gated_residual_norm_modulate(
        x.contiguous(), y.contiguous(), _rows_ok(gate), _rows_ok(shift), _rows_ok(scale), float(norm.eps)
    )

"""One hand-written GPU kernel for the q (or k) of Qwen-Image's joint attention: RMSNorm of every
head, the rotary embedding, and the join of the image and text tokens into one buffer.

The compiled rollout (no-grad graphs) calls it instead of inductor's kernel for the same
expression, because inductor's stays well below the memory bandwidth on this pure streaming work
(read q of both streams, write the joint q), while one program per token and a block of its rows
streams it once. The arithmetic rounds where eager PyTorch does, step for step (diffusers'
RMSNorm, then `block._rotate`):

    r   = rsqrt(mean(x_f32^2) + eps)            per (token, row, head), float32
    y   = bf16(bf16(x_f32 * r) * weight)        RMSNorm: cast to the weight's dtype, then scale
    out = bf16(y * cos + swap_pairs(y) * sin)   rotary embedding in float32

so a compiled rollout with `compile_rounding: eager` stays at the trainer's log-probs (the
reduction order of the mean is the only difference). Training graphs keep inductor's kernel,
which autograd differentiates; this kernel has no backward and is used only without grad.

Layouts: `txt` (T, B, H, D) and `img` (L, B, H, D), contiguous (the q or k projection's output,
split into heads, sequence-major); tables (T, D) and (L, D) float32 as `_real_rope_tables` makes
them; the result is (L + T, B, H, D), image rows first. D must be a power of two (128 in Qwen-Image).
Without Triton (CPU builds) `available()` is False and callers keep the PyTorch expression.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch expression runs instead
    triton = None

ROWS_PER_PROGRAM = 32  # of one token's (row, head) rows of D values, per Triton program


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def applicable(x: torch.Tensor, norm, rope) -> bool:
    """Whether the kernel computes exactly what `norm` + `_rotate` compute for x: CUDA, a half
    dtype shared by x and the norm's weight, diffusers' RMSNorm with a weight and no bias, real
    RoPE tables, and a power-of-two head width."""
    from diffusers.models.normalization import RMSNorm  # its rounding is the one reproduced

    weight = getattr(norm, "weight", None)
    return (
        available()
        and rope is not None
        and x.is_cuda
        and type(norm) is RMSNorm
        and weight is not None
        and getattr(norm, "bias", None) is None
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.shape[-1] & (x.shape[-1] - 1) == 0
    )


if triton is not None:

    @triton.jit
    def _joint_norm_rope_kernel(
        first,
        second,
        first_weight,
        second_weight,
        first_cos,
        first_sin,
        second_cos,
        second_sin,
        out,
        rows_per_token,
        first_tokens,
        eps,
        D: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        # Program (token, j): rows j*ROWS.. of one token's B*H rows, all from one stream, so the
        # weight and the token's table row are loaded once; every load and store is contiguous.
        token = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, D)
        if token < first_tokens:
            src = first + token * rows_per_token * D
            weight, cos, sin = first_weight, first_cos + token * D, first_sin + token * D
        else:
            src = second + (token - first_tokens) * rows_per_token * D
            weight, cos, sin = (
                second_weight,
                second_cos + (token - first_tokens) * D,
                second_sin + (token - first_tokens) * D,
            )
        valid = (rows < rows_per_token)[:, None]
        x = tl.load(src + rows[:, None] * D + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        half = out.dtype.element_ty
        # diffusers' RMSNorm rounding: half(half(x * r) * weight)
        y = (x * r[:, None]).to(half).to(tl.float32) * tl.load(weight + cols).to(tl.float32)[None, :]
        y_re, y_im = tl.split(tl.reshape(y.to(half).to(tl.float32), [ROWS, D // 2, 2]))
        # Expanded tables: cos = (c0, c0, c1, c1, ...), sin = (-s0, s0, -s1, s1, ...).
        c, _ = tl.split(tl.reshape(tl.load(cos + cols), [D // 2, 2]))
        _, s = tl.split(tl.reshape(tl.load(sin + cols), [D // 2, 2]))
        # x * cos + swap_pairs(x) * sin, pair by pair
        out_re = y_re * c[None, :] + y_im * (-s)[None, :]
        out_im = y_im * c[None, :] + y_re * s[None, :]
        rotated = tl.reshape(tl.join(out_re, out_im), [ROWS, D])
        dst = out + token * rows_per_token * D
        tl.store(dst + rows[:, None] * D + cols[None, :], rotated.to(half), mask=valid)

    @torch.library.triton_op("flowrl::joint_norm_rope", mutates_args={})
    def joint_norm_rope(
        first: torch.Tensor,
        second: torch.Tensor,
        first_weight: torch.Tensor,
        second_weight: torch.Tensor,
        first_cos: torch.Tensor,
        first_sin: torch.Tensor,
        second_cos: torch.Tensor,
        second_sin: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """(T + L, B, H, D): RMSNorm + RoPE of `first` (T, B, H, D) and `second` (L, B, H, D), joined
        in that order."""
        first_tokens, batch, heads, dim = first.shape
        out = first.new_empty((first_tokens + second.shape[0], batch, heads, dim))
        rows_per_token = batch * heads
        grid = (out.shape[0], triton.cdiv(rows_per_token, ROWS_PER_PROGRAM))
        torch.library.wrap_triton(_joint_norm_rope_kernel)[grid](
            first,
            second,
            first_weight,
            second_weight,
            first_cos,
            first_sin,
            second_cos,
            second_sin,
            out,
            rows_per_token,
            first_tokens,
            eps,
            D=dim,
            ROWS=ROWS_PER_PROGRAM,
            num_warps=4,
        )
        return out


def joint_rotated(txt: torch.Tensor, img: torch.Tensor, txt_norm, img_norm, rope) -> torch.Tensor:
    """The joint (L + T, B, H, D) buffer of normed, rotated img and txt heads, image rows first (see
    the module docstring); rope = ((img_cos, img_sin), (txt_cos, txt_sin)). Call only where
    `applicable`."""
    (img_cos, img_sin), (txt_cos, txt_sin) = rope
    if txt_norm.eps != img_norm.eps:
        raise ValueError(f"text and image RMSNorm eps differ ({txt_norm.eps} vs {img_norm.eps})")
    return torch.ops.flowrl.joint_norm_rope(
        img.contiguous(),
        txt.contiguous(),
        img_norm.weight,
        txt_norm.weight,
        img_cos,
        img_sin,
        txt_cos,
        txt_sin,
        float(img_norm.eps),
    )

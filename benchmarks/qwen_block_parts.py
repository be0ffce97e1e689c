"""Timings of the non-matmul pieces of a Qwen-Image block, alone, in candidate formulations.

    python benchmarks/qwen_block_parts.py [--rows 16] [--seconds 1.0] [--device cuda]

`benchmarks/floor.py` measures how much of a compiled Qwen-Image forward is spent outside its
matmuls and attention; a profile names the largest pieces: the GELU after the MLP's first GEMM,
and the q/k RMSNorm + rotary-embedding kernel. This script times each
piece on the real shapes (1024 image tokens, 24 heads of 128, MLP 3072 -> 12288), compiled by
inductor as the engine compiles them, next to an alternative:

- MLP up-projection: GEMM + bias, then GELU(tanh) as inductor fuses it (a separate kernel that
  reads and writes the 12288-wide activation), against cuBLASLt's GELU epilogue
  (`torch._addmm_activation`), which applies GELU before the result leaves the GEMM;
- q/k RMSNorm + RoPE: the earlier real-arithmetic rotation (pairs unbound, rotated, stacked)
  against the engine's pair-swap form (x * cos' + swap(x) * sin', tables expanded to the head
  width; `flowrl.accel.qwen_image.block._rotate`);
- the bytes each piece must move, timed as a plain copy: the bandwidth floor.

Prints ms per call, effective GB/s, and the largest difference between the alternatives' outputs.
"""

from __future__ import annotations

import argparse

import torch
from timing import sustained_seconds

from flowrl.accel.qwen_image.block import _rotate


def _rotate_unbind(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation the engine used before the pair-swap form: pairs unbound, rotated, re-stacked
    (cos, sin: (S, D/2) tables)."""
    re, im = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(3).type_as(x)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """diffusers' RMSNorm: float32 statistics, result in the weight's dtype times the weight."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(weight.dtype) * weight


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="batch rows (default 16)")
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens per row (512 px: 1024)")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, head_dim, width, hidden = 24, 128, 3072, 12288
    if device.type == "cpu":  # a smoke run: small widths
        heads, head_dim, width, hidden, args.tokens = 4, 32, 128, 512, 64
    torch.manual_seed(0)
    tokens = args.rows * args.tokens
    bytes_per = torch.finfo(dtype).bits // 8
    results = []

    # --- MLP up-projection + GELU(tanh) ---
    x = torch.randn(tokens, width, device=device, dtype=dtype)
    w1 = torch.randn(hidden, width, device=device, dtype=dtype) / width**0.5
    b1 = torch.randn(hidden, device=device, dtype=dtype) * 0.1
    up_compiled = torch.compile(
        lambda: torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1), approximate="tanh")
    )
    up_linear = torch.compile(lambda: torch.nn.functional.linear(x, w1, b1))
    up_epilogue = lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True)  # noqa: E731
    act = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gelu_only = torch.compile(lambda: torch.nn.functional.gelu(act, approximate="tanh"))
    flops = 2 * tokens * width * hidden
    for name, fn, nbytes in (
        ("mlp-up linear only (reference)", up_linear, None),
        ("mlp-up linear + gelu, inductor", up_compiled, None),
        ("mlp-up cuBLASLt gelu epilogue", up_epilogue, None),
        ("gelu alone (inductor)", gelu_only, 2 * act.numel() * bytes_per),
    ):
        seconds = sustained_seconds(fn, device, args.seconds)["seconds"]
        results.append((name, seconds, nbytes, None if nbytes else flops))
    diff = (up_compiled().float() - up_epilogue().float()).abs().max().item()
    print(f"mlp-up: max |inductor - epilogue| = {diff:.3g}")

    # --- q/k RMSNorm + RoPE on the image tokens ---
    q = torch.randn(args.rows, args.tokens, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn_like(q)
    wq = 1 + 0.1 * torch.randn(head_dim, device=device, dtype=dtype)
    wk = 1 + 0.1 * torch.randn(head_dim, device=device, dtype=dtype)
    angles = torch.rand(args.tokens, head_dim // 2, device=device) * 6.28
    cos, sin = angles.cos(), angles.sin()
    cos2 = cos.repeat_interleave(2, dim=-1)[:, None]  # (S, 1, D) against (B, S, H, D)
    sin2 = torch.stack([-sin, sin], dim=-1).flatten(-2)[:, None]
    current = torch.compile(lambda: (_rotate_unbind(_rms(q, wq), cos, sin), _rotate_unbind(_rms(k, wk), cos, sin)))
    swap = torch.compile(lambda: (_rotate(_rms(q, wq), cos2, sin2), _rotate(_rms(k, wk), cos2, sin2)))  # the engine's
    norm_only = torch.compile(lambda: (_rms(q, wq), _rms(k, wk)))
    copy = lambda: (q.clone(), k.clone())  # noqa: E731
    qk_bytes = 4 * q.numel() * bytes_per  # read q, k; write both
    for name, fn in (
        ("q/k norm + rope, unbind/stack", current),
        ("q/k norm + rope, pair swap", swap),
        ("q/k norm only", norm_only),
        ("q/k copy (bandwidth floor)", copy),
    ):
        results.append((name, sustained_seconds(fn, device, args.seconds)["seconds"], qk_bytes, None))
    a, b = current(), swap()
    print(
        f"rope: max |unbind/stack - pair swap| = {max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b)):.3g}"
    )

    print(
        f"\n{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}, "
        f"{args.rows} rows x {args.tokens} tokens"
    )
    for name, seconds, nbytes, nflops in results:
        extra = f"{nbytes / seconds / 1e9:8.0f} GB/s" if nbytes else f"{nflops / seconds / 1e12:8.1f} TFLOP/s"
        print(f"{name:36s} {seconds * 1e3:8.3f} ms  {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GEMMs of one Qwen-Image block at rollout size, each timed on its own at the sustained clock,
with the variants that could make the slowest one faster.

    python benchmarks/qwen_gemm_shapes.py [--rows 16] [--text-tokens 64] [--seconds 1] [--rounds 3]

A profile of a B=16 block can show the MLP up-projection with the GELU epilogue
(flowrl.accel.fused_mlp) running slower per FLOP than the plain bias GEMMs: a different cuBLASLt
kernel. This script measures, alternating within each group so clock drift hits all alike
(timing.py):
- `mlp-up`: the epilogue GEMM as the op calls it, the same GEMM with the bias only (the epilogue's
  cost), bias GEMM + separate GELU (what the op replaced), and the epilogue GEMM split into 2 or 4
  row chunks written in place (other M, so cuBLASLt's heuristic may pick another kernel);
- `mlp-down`, `qkv`: the other shapes' rates, for reference;
- `modulation`: the per-block modulation GEMM (a (rows, 3072) x (3072, 18432) product that reads
  113 MB of weights per call) against a gather of the same rows from a precomputed table, the
  upper bound of what caching modulation per timestep could save;
- `peak`: the 8192^3 bf16 GEMM the rollout benchmark's MFU divides by.
Prints ms per call per round, the median, TFLOP/s, (on a GPU) the kernels one call launches, and
the largest difference of the row-chunked epilogue GEMMs from the single call (the same values
unless cuBLASLt's other kernel rounds differently).
On a CPU it runs small shapes as a smoke test.
"""

from __future__ import annotations

import argparse
import statistics

import timing
import torch
import torch.nn.functional as F


def _epilogue_chunks(bias, x, weight_t, chunks: int):
    out = x.new_empty((x.shape[0], weight_t.shape[1]))
    for rows_in, rows_out in zip(x.chunk(chunks), out.chunk(chunks)):
        torch.ops.aten._addmm_activation.out(bias, rows_in, weight_t, use_gelu=True, out=rows_out)
    return out


def groups(rows: int, tokens: int, width: int, device, dtype) -> dict[str, tuple[int, dict]]:
    """{group: (flops per call, {variant: fn})}."""
    m, hidden = rows * tokens, 4 * width
    generator = torch.Generator(device).manual_seed(0)

    def randn(*shape, scale=0.02):
        return (torch.randn(*shape, generator=generator, device=device, dtype=torch.float32) * scale).to(dtype)

    x, x_wide = randn(m, width, scale=1.0), randn(m, hidden, scale=1.0)
    w_up, b_up, w_down, b_down = randn(hidden, width), randn(hidden), randn(width, hidden), randn(width)
    w_qkv, b_qkv = randn(width, width), randn(width)
    w_mod, b_mod = randn(3 * 2 * width, width), randn(3 * 2 * width)
    temb, table, index = (
        randn(rows, width, scale=1.0),
        randn(100, 3 * 2 * width),
        torch.arange(rows, device=device) % 100,
    )
    size = 8192 if device.type == "cuda" else 256
    a, b = randn(size, size, scale=1.0), randn(size, size, scale=1.0)
    up_t = w_up.t()
    mlp_up = {
        "gelu epilogue (the op)": lambda: torch._addmm_activation(b_up, x, up_t, use_gelu=True),
        "bias only": lambda: torch.addmm(b_up, x, up_t),
        "bias GEMM + GELU kernel": lambda: F.gelu(torch.addmm(b_up, x, up_t), approximate="tanh"),
        "gelu epilogue, 2 row chunks": lambda: _epilogue_chunks(b_up, x, up_t, 2),
        "gelu epilogue, 4 row chunks": lambda: _epilogue_chunks(b_up, x, up_t, 4),
    }
    return {
        "mlp-up": (2 * m * width * hidden, mlp_up),
        "mlp-down": (2 * m * hidden * width, {"bias": lambda: torch.addmm(b_down, x_wide, w_down.t())}),
        "qkv": (2 * m * width * width, {"bias": lambda: torch.addmm(b_qkv, x, w_qkv.t())}),
        "modulation": (
            2 * rows * width * 6 * width,
            {
                "GEMM (per step)": lambda: torch.addmm(b_mod, F.silu(temb), w_mod.t()),
                "gather from a table": lambda: table.index_select(0, index),
            },
        ),
        "peak": (2 * size**3, {"8192^3": lambda: a @ b}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--size", type=int, default=512)
    timing.add_arguments(parser, seconds=1.0)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    width = 3072 if on_gpu else 64
    tokens = (args.size // 16) ** 2 + args.text_tokens if on_gpu else 40
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(f"Qwen-Image block GEMMs, {args.rows} rows x {tokens} tokens, width {width}, {dtype}, {name}")
    for group, (flops, variants) in groups(args.rows, tokens, width, device, dtype).items():
        times = timing.alternate(variants, device, args.rounds, args.seconds)
        print(f"\n{group}: {flops / 1e9:.1f} GFLOP per call")
        for label, values in times.items():
            median = statistics.median(values)
            print(timing.rounds_line(f"  {label:32s}", values) + f"   {flops / median / 1e12:6.1f} TFLOP/s")
            if on_gpu:
                print("      " + ", ".join(name[:90] for name in timing.kernel_names(variants[label])))
        if group == "mlp-up":
            one_call = variants["gelu epilogue (the op)"]().float()
            for label in ("gelu epilogue, 2 row chunks", "gelu epilogue, 4 row chunks"):
                print(f"  max |{label} - the op| = {(variants[label]().float() - one_call).abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

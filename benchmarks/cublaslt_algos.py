"""Every algorithm cuBLASLt's heuristic offers for each GEMM of a B=16 Qwen-Image block, timed
against the call PyTorch makes for it (which takes the heuristic's first choice).

    python benchmarks/cublaslt_algos.py [--rows 16] [--problems img-mlp-up,...] [--limit 24]
                                         [--seconds 0.25] [--rounds 3]

Problems (the image stream has rows x 1024 tokens, the text stream rows x 64; width 3072):
img-mlp-up (GELU epilogue, as flowrl.accel.fused_mlp), img-mlp-up-bias (the same GEMM with the
bias only), img-mlp-down, img-proj (q, k, v and the output projection), img-proj-accumulate (a
LoRA fold's base GEMM: no bias, beta = 1, flowrl.accel.lora_fold), txt-proj, txt-mlp-up,
txt-mlp-down. For each: ms per call per round (alternating, timing.py), TFLOP/s,
the time relative to PyTorch's call, the algorithm's configuration numbers, the device memsets
a call issues (gemm_memsets.py asks the same of PyTorch's calls), the largest
difference from PyTorch's output, and the kernels of PyTorch's call and of the fastest candidate.
CUDA only.
"""

from __future__ import annotations

import argparse
import statistics

import cublaslt
import timing
import torch

WIDTH = 3072

# name: (stream tokens per row, N, K, epilogue, accumulate)
PROBLEMS = {
    "img-mlp-up": (1024, 4 * WIDTH, WIDTH, "gelu_bias", False),
    "img-mlp-up-bias": (1024, 4 * WIDTH, WIDTH, "bias", False),
    "img-mlp-down": (1024, WIDTH, 4 * WIDTH, "bias", False),
    "img-proj": (1024, WIDTH, WIDTH, "bias", False),
    "img-proj-accumulate": (1024, WIDTH, WIDTH, "none", True),
    "txt-proj": (64, WIDTH, WIDTH, "bias", False),
    "txt-mlp-up": (64, 4 * WIDTH, WIDTH, "gelu_bias", False),
    "txt-mlp-down": (64, WIDTH, 4 * WIDTH, "bias", False),
}


def torch_call(x, weight, bias, out, epilogue: str, accumulate: bool):
    """What PyTorch runs for the problem (F.linear's addmm, the fused MLP's epilogue GEMM, a LoRA
    fold's accumulating GEMM)."""
    if epilogue == "gelu_bias":
        return lambda: torch.ops.aten._addmm_activation.out(bias, x, weight.t(), use_gelu=True, out=out)
    if accumulate:
        return lambda: out.addmm_(x, weight.t())
    return lambda: torch.addmm(bias, x, weight.t(), out=out)


def measure(name: str, rows: int, limit: int, rounds: int, seconds: float, device) -> None:
    tokens, n, k, epilogue, accumulate = PROBLEMS[name]
    m, dtype = rows * tokens, torch.bfloat16
    generator = torch.Generator(device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    x, weight, bias = randn(m, k), randn(n, k, scale=k**-0.5), randn(n, scale=0.1)
    start = randn(m, n)
    out_torch, out_lt = start.clone(), start.clone()
    gemm = cublaslt.Gemm(m, n, k, dtype, epilogue=epilogue, accumulate=accumulate)
    candidates = gemm.candidates(bias if epilogue != "none" else None, limit=limit)
    variants = {"torch": torch_call(x, weight, bias, out_torch, epilogue, accumulate)}
    for index, algo in enumerate(candidates):
        variants[f"lt{index}"] = lambda algo=algo: gemm.run(x, weight, bias, out_lt, algo)
    times = timing.alternate(variants, device, rounds, seconds)

    # Values: one call each from the same start (accumulating problems add to it).
    out_torch.copy_(start)
    variants["torch"]()
    reference = out_torch.float()
    flops = 2 * m * n * k
    base = statistics.median(times["torch"])
    print(
        f"\n{name}: M={m} N={n} K={k} epilogue={epilogue} accumulate={accumulate}, "
        f"{flops / 1e9:.1f} GFLOP, {len(candidates)} candidates"
    )
    ranked = sorted(times, key=lambda label: statistics.median(times[label]))
    for label in ranked:
        median = statistics.median(times[label])
        line = timing.rounds_line(f"  {label:6s}", times[label])
        line += f"  {flops / median / 1e12:6.1f} TFLOP/s  x{median / base:.4f}"
        if label != "torch":
            algo = candidates[int(label[2:])]
            out_lt.copy_(start)
            variants[label]()
            diff = (out_lt.float() - reference).abs().max().item()
            config = " ".join(f"{key}={value}" for key, value in cublaslt.describe(algo.algo).items())
            memsets = sum("Memset" in kernel for kernel in timing.kernel_names(variants[label]))
            line += f"  waves={algo.waves_count:.2f} ws={algo.workspace_size >> 10}K memsets={memsets} |diff|={diff:.3g}  {config}"
        print(line)
    for label in ("torch", ranked[0] if ranked[0] != "torch" else ranked[1]):
        print(f"  kernels of {label}: " + ", ".join(kernel[:100] for kernel in timing.kernel_names(variants[label])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--limit", type=int, default=24, help="heuristic candidates per problem")
    timing.add_arguments(parser, seconds=0.25)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error("--device: cuBLASLt needs a CUDA device")
    print(f"cuBLASLt candidates vs PyTorch's GEMM, {args.rows} rows, {torch.cuda.get_device_name(device)}")
    for name in args.problems.split(","):
        if name not in PROBLEMS:
            parser.error(f"--problems: {name!r} is not one of {', '.join(PROBLEMS)}")
        measure(name, args.rows, args.limit, args.rounds, args.seconds, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The Qwen-Image training block's GEMM shapes alone, under the cuBLAS settings that could change
how a GEMM is run: which ones issue a device memset, and what each costs per call.

    python benchmarks/gemm_memsets.py [--rows 8] [--text-tokens 64] [--seconds 0.3] [--device cuda]

A training call of one block at the recipe's micro-batch (`qwen_train_block.py`) idles before
device memsets issued inside aten::mm / aten::addmm (cuBLAS), with the memset already queued; this
asks which of the block's GEMMs issue them and whether a setting changes that. Each shape below, the image stream's `rows x image_tokens` rows and the
text stream's `rows x text_tokens`, as a forward addmm with bias and as the backward's
input-gradient mm, over the block's projections (width -> width, width -> mlp width, mlp width ->
width), is run back to back under each setting:
- `default`: PyTorch's defaults;
- `fp32-reduction`: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
  (a GEMM that splits its reduction may not sum the parts in bf16, as atomics into a zeroed bf16
  output would);
- `cublaslt`: torch.backends.cuda.preferred_blas_library("cublaslt").
It prints ms per call (sustained, about --seconds each), device memsets per call, the kernels a call
ran, and each setting's largest difference from the default's output. On a CPU (a smoke run) only
`default` runs, and memsets are 0.
"""

from __future__ import annotations

import argparse
import contextlib

import timing
import torch

SETTINGS = ("default", "fp32-reduction", "cublaslt")


@contextlib.contextmanager
def setting(name: str):
    matmul = torch.backends.cuda.matmul
    reduced, library = matmul.allow_bf16_reduced_precision_reduction, torch.backends.cuda.preferred_blas_library()
    try:
        if name == "fp32-reduction":
            matmul.allow_bf16_reduced_precision_reduction = False
        elif name == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = reduced
        torch.backends.cuda.preferred_blas_library(library)


def cases(args, device, dtype):
    """(label, fn) for each stream x projection x op."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    width, mlp = args.width, args.mlp_width
    for stream, tokens in (("image", args.rows * args.image_tokens), ("text", args.rows * args.text_tokens)):
        for k, n in ((width, width), (width, mlp), (mlp, width)):
            x = torch.randn(tokens, k, generator=gen).to(device, dtype)
            weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
            bias = torch.randn(n, generator=gen).to(device, dtype)
            grad_out = torch.randn(tokens, n, generator=gen).to(device, dtype)
            yield f"{stream} {tokens}x{k}->{n} forward addmm", lambda x=x, w=weight, b=bias: torch.addmm(b, x, w.t())
            yield f"{stream} {tokens}x{k}->{n} input-grad mm", lambda g=grad_out, w=weight: torch.mm(g, w)


def memsets_and_kernels(fn, device) -> tuple[int, list[str]]:
    """Device memsets one call of fn issues, and the other kernels it runs (none counted on a CPU)."""
    names = timing.kernel_names(fn) if device.type == "cuda" else []
    return sum("Memset" in name for name in names), sorted({name[:60] for name in names if "Memset" not in name})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="the recipe's micro-batch: 4 samples x 2 CFG rows")
    parser.add_argument("--image-tokens", type=int, default=1024, help="a 512 px image's latent tokens")
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--width", type=int, default=3072, help="Qwen-Image's hidden width")
    parser.add_argument("--mlp-width", type=int, default=12288)
    parser.add_argument("--seconds", type=float, default=0.3, help="timed seconds per shape and setting")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    settings = SETTINGS if device.type == "cuda" else ("default",)  # no cuBLAS on a CPU
    dtype = torch.bfloat16
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}")
    totals = dict.fromkeys(settings, 0.0)
    for label, fn in cases(args, device, dtype):
        reference = None
        for name in settings:
            with setting(name):
                out = fn()
                if reference is None:
                    reference = out.float()
                gap = (out.float() - reference).abs().max().item()
                seconds = timing.sustained_seconds(fn, device, args.seconds)["seconds"]
                memsets, kernels = memsets_and_kernels(fn, device)
            totals[name] += seconds
            print(
                f"{label:40s} {name:15s} {seconds * 1e3:7.3f} ms  memsets {memsets}  "
                f"max |diff| {gap:.3g}  {' + '.join(kernels)}"
            )
    print("sum over the shapes: " + ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in totals.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""SDPA's backends at the recipes' attention shapes: what a forward, and a forward + backward,
costs with each, against the backend SDPA picks on its own.

    python benchmarks/attention_backends.py [--shapes NAME ...] [--seconds 0.5] [--rounds 2]

The whole training step's attention runs well under the matmul rate (docs/performance.md, "Where
the time goes"); this asks whether another of SDPA's fused backends (cuDNN, flash, memory-efficient)
runs the recipes' shapes faster. Each shape is (rows, heads, joint tokens, head width), unmasked
(the benches' prompts all have one length), in the layout its model hands SDPA:
- `qwen-train`: Qwen-Image's update, micro-batch 4 with true CFG (8 rows), 1024 image + 64 text tokens;
- `sd35-train`: SD3.5-medium's update, micro-batch 8 with CFG (16 rows), 1024 image + 205 text tokens
  (CLIP's 77 and the recipe's 128 T5 tokens);
- `sd35-rollout`: SD3.5-medium's rollout, 16 samples with CFG (32 rows), forward only matters;
- `sd35-dual`: the image-only second attention of SD3.5-medium's first 13 blocks, 16 rows.
Per backend it prints ms per call and TFLOP/s (forward 4 B H L^2 D; backward 2.5 times that, as
flash attention's authors count it), timed in alternation round after round, and each backend's
largest difference from the default's output. A backend that refuses the shape is reported as such.
On a CPU (a smoke run) only the math backend and SDPA's default run, on small shapes.
"""

from __future__ import annotations

import argparse
import statistics

import timing
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {
    "qwen-train": (8, 24, 1088, 128),
    "sd35-train": (16, 24, 1229, 64),
    "sd35-rollout": (32, 24, 1229, 64),
    "sd35-dual": (16, 24, 1024, 64),
}
# The layout each model hands SDPA: Qwen-Image's blocks views of sequence-major (L, B, H, Dh)
# buffers, diffusers' SD3 processor views of batch-major (B, L, H, Dh) ones.
SEQUENCE_MAJOR = {"qwen-train"}
CUDA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def _laid_out(name: str, rows: int, heads: int, tokens: int, width: int, gen) -> torch.Tensor:
    """A random (B, H, L, Dh) tensor as a view of the layout `name`'s model uses."""
    if name in SEQUENCE_MAJOR:
        return torch.randn(tokens, rows, heads, width, generator=gen).permute(1, 2, 0, 3)
    return torch.randn(rows, tokens, heads, width, generator=gen).transpose(1, 2)


def _call(q, k, v, backend: str | None, backward: bool, grad_out):
    def run():
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = F.scaled_dot_product_attention(q, k, v)
        if backward:  # the three input gradients, none accumulated into .grad
            torch.autograd.grad(out, (q, k, v), grad_out)
        return out

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    timing.add_arguments(parser, seconds=0.5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    backends = (None, *CUDA_BACKENDS) if on_gpu else (None, "MATH")
    if on_gpu:
        print(
            f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"
        )
    gen = torch.Generator().manual_seed(0)
    for name in args.shapes:
        rows, heads, tokens, width = SHAPES[name] if on_gpu else (2, 2, 64, 16)
        q, k, v, grad_out = (_laid_out(name, rows, heads, tokens, width, gen).to(device, dtype) for _ in range(4))
        forward_flops = 4 * rows * heads * tokens**2 * width
        print(f"\n{name}: {rows} rows x {heads} heads x {tokens} tokens x {width} wide")
        with torch.no_grad():
            reference = F.scaled_dot_product_attention(q, k, v).float()
        variants, differences = {}, {}
        for backend in backends:
            label = backend or "default"
            try:
                with torch.no_grad():
                    out = _call(q, k, v, backend, False, None)()
            except RuntimeError as error:
                print(f"  {label:<20} refuses this shape ({str(error).splitlines()[0][:80]})")
                continue
            differences[label] = (out.float() - reference).abs().max().item()
            variants[f"{label} forward"] = torch.no_grad()(_call(q, k, v, backend, False, None))
            trained = [t.detach().requires_grad_() for t in (q, k, v)]
            variants[f"{label} fwd+bwd"] = _call(*trained, backend, True, grad_out)
        times = timing.alternate(variants, device, args.rounds, args.seconds)
        for label, values in times.items():
            seconds = statistics.median(values)
            flops = forward_flops * (3.5 if label.endswith("fwd+bwd") else 1.0)
            print(f"  {timing.rounds_line(f'{label:<30}', values)}  {flops / seconds / 1e12:6.1f} TFLOP/s")
        print("  largest difference from the default's forward:", {k: f"{v:.1e}" for k, v in differences.items()})


if __name__ == "__main__":
    main()

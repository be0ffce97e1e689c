"""Qwen-Image's joint attention of a batch with padded text, three ways: SDPA with the boolean
text mask (what diffusers runs), one unmasked call per run of rows with equal text lengths
(flowrl.accel.qwen_image.prefix_attention), and SDPA without any mask (the floor: as if no row's
text were padded).

    python benchmarks/qwen_text_mask_attention.py [--seconds 2] [--device cuda]

Shapes (24 heads of 128, 1024 image tokens, 64 text tokens; q, k, v sequence-major as the blocks
pass them, image rows first): the rollout's forward at 64 rows (32 prompt rows, 32 negative-prompt
rows at a quarter of the text), and the trainer's forward + backward at 8 rows (its micro-batch,
half of them negative prompts). Each line prints ms per call, TFLOP/s (4 B H S^2 D FLOPs a
forward, 2.5 x that a backward) and the largest difference from the masked call's output. On a
CPU it runs small shapes as a smoke test.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from timing import sustained_seconds

from flowrl.accel.qwen_image import prefix_attention


def masked(q, k, v, lengths, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def prefix(q, k, v, lengths, mask):
    return prefix_attention.attention(q, k, v, lengths)


def unmasked(q, k, v, lengths, mask):
    return F.scaled_dot_product_attention(q, k, v)


def call(attention, tensors, grad):
    out = attention(*tensors)
    if grad is not None:
        out.backward(grad)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per line")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    heads, dim, image, text = (24, 128, 1024, 64) if on_gpu else (2, 32, 64, 8)
    tokens = image + text
    print(f"{device}, {dtype}, {heads} heads x {dim}, {image} image + {text} text tokens")
    for rows, train in ((64, False), (8, True)):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(tokens, rows, heads, dim, generator=gen).to(device, dtype).permute(1, 2, 0, 3) for _ in range(3)
        )
        for t in (q, k, v):
            t.requires_grad_(train)
        lengths = torch.tensor([image + text] * (rows // 2) + [image + text // 4] * (rows - rows // 2))
        mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(device)[:, None, None, :]
        tensors = (q, k, v, lengths, mask)
        grad = torch.randn(rows, heads, tokens, dim, generator=gen).to(device, dtype) if train else None
        flops = 4 * rows * heads * tokens**2 * dim * (3.5 if train else 1.0)
        with torch.no_grad():
            reference = masked(*tensors)
        for name, attention in (("masked", masked), ("per run", prefix), ("no mask", unmasked)):
            fn = functools.partial(call, attention, tensors, grad)
            with torch.set_grad_enabled(train):
                seconds = sustained_seconds(fn, device, args.seconds)["seconds"]
            with torch.no_grad():
                diff = (attention(*tensors).float() - reference.float()).abs().max().item()
            print(
                f"{rows:3d} rows {'forward + backward' if train else 'forward':18s} {name:8s} {seconds * 1e3:8.3f} ms  "
                f"{flops / seconds / 1e12:6.1f} TFLOP/s  max |out - masked| {diff:.3g}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

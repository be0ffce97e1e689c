"""Qwen-Image VAE decode of one batch of images: the stock causal-3D path against the 2D path.

    python benchmarks/qwen_vae_decode.py [--rows 16] [--size 512] [--seconds 2.0] [--device cuda]

The engine decodes a text-to-image sample as one video frame with no frame cache, so every
3x3x3 causal convolution multiplies two zero frames; `flowrl.models.qwen_vae` computes those
calls as 2D convolutions on the kernel's last time slice, channels-last. This script builds the
published VAE architecture with random weights (bf16 on CUDA, float32 on CPU) and times one
decode of `rows` latents both ways, each sustained. Prints ms per decode, FLOPs counted by
torch's FLOP counter on each path, and the largest pixel difference between the two outputs
(uint8 images, as the engine returns them).
"""

from __future__ import annotations

import argparse

import torch
from timing import sustained_seconds
from torch.utils.flop_counter import FlopCounterMode

from flowrl.models.architectures import QWEN_IMAGE_VAE
from flowrl.models.base import to_uint8
from flowrl.models.qwen_vae import decode_single_frames_in_2d, single_frame_2d
from flowrl.models.random_weights import build_random_module


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--size", type=int, default=512, help="image side in pixels (latent side = size / 8)")
    parser.add_argument("--seconds", type=float, default=2.0, help="sustained timing per path")
    parser.add_argument("--base-dim", type=int, default=QWEN_IMAGE_VAE["base_dim"], help="smaller for a CPU smoke run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from diffusers import AutoencoderKLQwenImage

    vae = build_random_module(
        AutoencoderKLQwenImage, {**QWEN_IMAGE_VAE, "base_dim": args.base_dim}, device, dtype, seed=1
    )
    decode_single_frames_in_2d(vae)
    gen = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(
        (args.rows, QWEN_IMAGE_VAE["z_dim"], 1, args.size // 8, args.size // 8),
        generator=gen,
        device=device,
        dtype=dtype,
    )

    @torch.no_grad()
    def stock():
        return vae.decode(latents, return_dict=False)[0]

    @torch.no_grad()
    def in_2d():
        with single_frame_2d():
            return vae.decode(latents, return_dict=False)[0]

    results = {}
    images = {}
    for name, fn in (("stock-3d", stock), ("2d-channels-last", in_2d)):
        with FlopCounterMode(display=False) as counter:
            images[name] = to_uint8(fn()[:, :, 0])
        timing = sustained_seconds(fn, device, args.seconds)
        flops = counter.get_total_flops()
        results[name] = {
            "ms": timing["seconds"] * 1e3,
            "tflop": flops / 1e12,
            "tflop_per_s": flops / timing["seconds"] / 1e12,
        }
        print(
            f"{name:18s} {results[name]['ms']:9.2f} ms per decode of {args.rows}  "
            f"{results[name]['tflop'] * 1e3:10.3f} GFLOP  {results[name]['tflop_per_s']:7.1f} TFLOP/s",
            flush=True,
        )
    diff = (images["stock-3d"].int() - images["2d-channels-last"].int()).abs().max().item()
    results["max_pixel_difference"] = diff
    results["speedup"] = results["stock-3d"]["ms"] / results["2d-channels-last"]["ms"]
    print(f"2d / stock speed: {results['speedup']:.2f}x; largest pixel difference {diff} (of 255)")
    return results


if __name__ == "__main__":
    main()

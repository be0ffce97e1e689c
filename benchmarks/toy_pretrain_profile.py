"""Profile `flowrl make-toy`'s two training loops (autoencoder, transformer) for a few steps.

    python benchmarks/toy_pretrain_profile.py --size gpu --device cuda [--steps 40]

Runs the make-toy loops of flowrl.models.debug.toy_pretrain unchanged on a small pretraining pool,
times the steady-state step (after warm-up, device synchronised) and prints the torch.profiler
tables (top operators by self CPU and self device time) of a few steps of each loop: where the
step's time goes, to judge whether the GPU size can pretrain in 10 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch


def timed(device, loop, steps: int) -> float:
    """Seconds per step of `loop(steps)`, device synchronised around it."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    loop(steps)
    sync()
    return (time.perf_counter() - start) / steps


def measure(name: str, loop, total_steps: int, args, activities) -> None:
    """Warm `loop` up, time args.steps of it, then print the profiler's tables of 5 more steps."""
    from torch.profiler import profile

    loop(5)
    per_step = timed(args.device, loop, args.steps)
    print(f"{name}: {per_step * 1e3:.1f} ms/step -> {per_step * total_steps:.0f} s for {total_steps} steps")
    with profile(activities=activities) as prof:
        loop(5)
    for key in ("self_cpu_time_total", "self_cuda_time_total")[: len(activities)]:
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows))


def main() -> None:
    from torch.profiler import ProfilerActivity

    from flowrl.models.debug.toy import SIZES
    from flowrl.models.debug.toy_modules import build_pipeline
    from flowrl.models.debug.toy_pretrain import (
        encode_captions,
        encode_pictures,
        render_pool,
        train_autoencoder,
        train_transformer,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="gpu", choices=sorted(SIZES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each loop")
    parser.add_argument("--rows", type=int, default=25, help="operators shown per table")
    args = parser.parse_args()
    size = SIZES[args.size]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    torch.manual_seed(0)
    pipeline = build_pipeline(size)
    generator = torch.Generator().manual_seed(0)
    captions, pictures = render_pool(size, 4096, 0)
    for encoder in (pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3):
        encoder.to(args.device)
    text = encode_captions(pipeline, captions, args.device)

    def autoencoder(steps: int) -> None:
        train_autoencoder(pipeline.vae, pictures, dataclasses.replace(size, vae_steps=steps), 1, generator, args.device)

    measure("autoencoder", autoencoder, size.vae_steps, args, activities)

    latents = encode_pictures(pipeline.vae, pictures, args.device)

    def transformer(steps: int) -> None:
        train_transformer(
            pipeline.transformer,
            latents,
            captions,
            text,
            dataclasses.replace(size, steps=steps),
            generator,
            args.device,
        )

    measure("transformer", transformer, size.steps, args, activities)


if __name__ == "__main__":
    main()

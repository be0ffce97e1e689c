"""Engine throughput vs. serial B=1 sampling with the same adapter, measured in one run.

Usage: python benchmarks/engine_vs_serial.py [--model PATH] [--kind sd3|qwen_image] [-n 16] [--steps 10]

Without --model a tiny random checkpoint of --kind is built in a temporary folder. Prints the
wall time of (a) N samples of one prompt through engine.generate_batched, (b) N concurrent single
requests through the engine, and (c) N serial B=1 denoising loops calling the same adapter and the
same sampler step directly, plus the ratios (c)/(a) and (c)/(b) (> 1 means the engine is faster).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from flowrl import sampler
from flowrl.engine import DiffusionEngine, SamplingParams


def serial_b1(adapter, prompt: str, params: SamplingParams, n: int) -> None:
    """N independent B=1 loops: encode, denoise with sde_step, decode (no engine)."""
    for j in range(n):
        gen = torch.Generator(device=adapter.device).manual_seed(params.seed + j)
        cond = adapter.encode_prompts([prompt])
        sigmas = adapter.sigmas(params.num_inference_steps, params.height, params.width).to(adapter.device)
        x = adapter.initial_noise(params.height, params.width, gen)[None]
        g = torch.tensor([params.guidance_scale], device=adapter.device)
        with torch.no_grad():
            for i in range(params.num_inference_steps):
                v = adapter.velocity(x, sigmas[i : i + 1], cond, [None], g, params.height, params.width)
                a = params.noise_level if i < params.num_inference_steps - 1 else 0.0
                eps = torch.randn(x.shape, generator=gen, device=adapter.device)
                x = sampler.sde_step(
                    x, v, sigmas[i : i + 1], sigmas[i + 1 : i + 2], a, noise=eps, sigma_first_step=sigmas[1:2]
                ).next_latents
            adapter.decode(x, params.height, params.width)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kind", default="sd3", choices=["sd3", "qwen_image"])
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = args.model
    if path is None:
        from flowrl.models.debug.tiny import build_tiny_checkpoint

        path = build_tiny_checkpoint(args.kind, tempfile.mkdtemp(prefix="flowrl-bench-"))
    engine = DiffusionEngine.from_pretrained(path, max_batch_rows=max(32, args.n))
    params = SamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps, seed=0)
    prompt = "a photo of a cat"

    def concurrent():
        futures = [engine.submit(prompt, params.replace(seed=j)) for j in range(args.n)]
        [f.result() for f in futures]

    for fn in (
        lambda: engine.generate_batched(prompt, args.n, params),
        concurrent,
        lambda: serial_b1(engine.adapter, prompt, params, args.n),
    ):
        fn()  # warm-up
    t_batched = timed(lambda: engine.generate_batched(prompt, args.n, params), args.repeats)
    t_concurrent = timed(concurrent, args.repeats)
    t_serial = timed(lambda: serial_b1(engine.adapter, prompt, params, args.n), args.repeats)
    engine.shutdown()
    print(f"machine: {torch.get_num_threads()} torch threads, device {engine.adapter.device}, model {path}")
    print(f"{args.n} samples, {args.steps} steps, {args.size}x{args.size}, median of {args.repeats}")
    print(f"engine generate_batched      {t_batched:8.3f} s  {args.n / t_batched:8.2f} img/s")
    print(f"engine concurrent singles    {t_concurrent:8.3f} s  {args.n / t_concurrent:8.2f} img/s")
    print(f"serial B=1 (same adapter)    {t_serial:8.3f} s  {args.n / t_serial:8.2f} img/s")
    print(f"speed-up batched vs serial   {t_serial / t_batched:8.2f}x")
    print(f"speed-up concurrent vs serial {t_serial / t_concurrent:7.2f}x")


if __name__ == "__main__":
    main()

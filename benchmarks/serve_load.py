"""Load test of `flowrl serve`: many concurrent rollout requests, their latency, the batching achieved.

    python benchmarks/serve_load.py --requests 300                 # its own server on a tiny model (CPU)
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --requests 300 --size 512 --steps 10

Request k is one /v1/rollouts sample of prompt k % --prompts with seed --seed + k, all sent at once
(at most --concurrency open at a time). Every answer is checked: one sample, the prompt and seed
asked for, an image of the asked size, a log-prob per SDE-window step; then no seed may be missing
or come twice. Prints p50/p99 latency, images per second, and the rows per forward the engine
achieved over the run (from GET /v1/stats before and after: concurrent requests must share
forwards); `run_load` returns the same figures as a dict.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import httpx

from flowrl.sampling_params import SamplingParams
from flowrl.server import wire


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _check(outputs, prompt: str, seed: int, params: SamplingParams) -> str | None:
    """Why an answer is invalid, or None."""
    if len(outputs) != 1:
        return f"{len(outputs)} samples instead of 1"
    output = outputs[0]
    if output.prompt != prompt or output.seed != seed:
        return f"got prompt {output.prompt!r} seed {output.seed}, asked {prompt!r} seed {seed}"
    if tuple(output.image.shape) != (3, params.height, params.width):
        return f"image of shape {tuple(output.image.shape)}"
    if output.all_log_probs is None or output.all_log_probs.shape != output.sigmas.shape:
        return "no log-prob per window step"
    return None


async def _send_all(url: str, num_requests: int, concurrency: int, params: SamplingParams, prompts: list[str]):
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0, pool=None)) as client:

        async def one(k: int):
            prompt, seed = prompts[k % len(prompts)], params.seed + k
            start = time.perf_counter()
            try:
                response = await client.post(
                    wire.ROLLOUTS_PATH, json=wire.rollout_request(prompt, 1, params.replace(seed=seed))
                )
                if response.status_code != 200:
                    return k, None, time.perf_counter() - start, f"HTTP {response.status_code}: {response.text[:200]}"
                outputs = wire.decode_outputs(response.content)
            except (httpx.HTTPError, ValueError) as error:
                return k, None, time.perf_counter() - start, f"{type(error).__name__}: {error}"
            return (
                k,
                outputs[0].seed if outputs else None,
                time.perf_counter() - start,
                _check(outputs, prompt, seed, params),
            )

        return await asyncio.gather(*(one(k) for k in range(num_requests)))


def run_load(
    url: str,
    num_requests: int = 300,
    concurrency: int | None = None,
    params: SamplingParams | None = None,
    num_prompts: int = 16,
) -> dict:
    """Send the requests (module docstring); figures and checks as a dict."""
    params = params or SamplingParams(height=64, width=64, num_inference_steps=4, noise_level=0.7, seed=1000)
    if params.seed is None:
        raise ValueError("params.seed must be set: request k uses seed params.seed + k")
    prompts = [f"a photo of object number {i}" for i in range(num_prompts)]
    before = wire.stats_from_json(httpx.get(url + wire.STATS_PATH, timeout=30).json())
    start = time.perf_counter()
    results = asyncio.run(_send_all(url, num_requests, concurrency or num_requests, params, prompts))
    wall = time.perf_counter() - start
    after = wire.stats_from_json(httpx.get(url + wire.STATS_PATH, timeout=30).json())
    errors = [f"request {k}: {problem}" for k, _, _, problem in results if problem]
    seeds = [seed for _, seed, _, problem in results if not problem]
    expected = {params.seed + k for k in range(num_requests)}
    latencies = [seconds for _, _, seconds, problem in results if not problem]
    forwards = after["num_forwards"] - before["num_forwards"]
    rows = after["num_rows"] - before["num_rows"]
    return {
        "num_requests": num_requests,
        "num_ok": len(seeds),
        "errors": errors,
        "missing_seeds": sorted(expected - set(seeds)),
        "duplicate_seeds": sorted(seed for seed in set(seeds) if seeds.count(seed) > 1),
        "p50_latency_s": _percentile(latencies, 0.50) if latencies else float("nan"),
        "p99_latency_s": _percentile(latencies, 0.99) if latencies else float("nan"),
        "mean_latency_s": statistics.fmean(latencies) if latencies else float("nan"),
        "wall_s": wall,
        "images_per_s": len(seeds) / wall,
        "num_forwards": forwards,
        "mean_rows_per_forward": rows / forwards if forwards else 0.0,
    }


def _report(result: dict) -> str:
    lines = [
        f"{result['num_ok']}/{result['num_requests']} answers valid; "
        f"{len(result['missing_seeds'])} missing, {len(result['duplicate_seeds'])} duplicated",
        f"latency p50 {result['p50_latency_s']:.3f}s  p99 {result['p99_latency_s']:.3f}s  "
        f"(mean {result['mean_latency_s']:.3f}s)",
        f"{result['images_per_s']:.1f} img/s over {result['wall_s']:.2f}s; {result['num_forwards']} forwards, "
        f"mean rows per forward {result['mean_rows_per_forward']:.2f}",
    ]
    lines += result["errors"][:5]
    return "\n".join(lines)


def _tiny_server(max_batch_rows: int):
    """A context manager: a server of a tiny random SD3 model on a free loopback port, its URL."""
    import contextlib
    import tempfile

    from flowrl.engine import DiffusionEngine
    from flowrl.models.debug.tiny import build_tiny_checkpoint
    from flowrl.server.http import serve_in_background
    from flowrl.server.rollout_app import create_rollout_app

    @contextlib.contextmanager
    def serve():
        with tempfile.TemporaryDirectory() as folder:
            engine = DiffusionEngine.from_pretrained(
                build_tiny_checkpoint("sd3", folder, seed=0), max_batch_rows=max_batch_rows
            )
            try:
                with serve_in_background(create_rollout_app(engine, "tiny-sd3")) as url:
                    yield url
            finally:
                engine.shutdown()

    return serve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one on a tiny model)")
    parser.add_argument("--requests", type=int, default=300, help="requests to send (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, help="requests open at once (default: all of them)")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts (default: %(default)s)")
    parser.add_argument("--size", type=int, default=64, help="image height and width (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1000, help="seed of request 0 (default: %(default)s)")
    parser.add_argument(
        "--max-batch-rows", type=int, default=32, help="the tiny server's engine (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or (args.concurrency is not None and args.concurrency < 1):
        parser.error("--requests and --concurrency must be >= 1")
    params = SamplingParams(
        height=args.size, width=args.size, num_inference_steps=args.steps, noise_level=0.7, seed=args.seed
    )
    import contextlib

    server = contextlib.nullcontext(args.url) if args.url else _tiny_server(args.max_batch_rows)
    with server as url:
        result = run_load(url, args.requests, args.concurrency, params, args.prompts)
    print(_report(result))
    return 0 if result["num_ok"] == args.requests and not result["duplicate_seeds"] else 1


if __name__ == "__main__":
    sys.exit(main())

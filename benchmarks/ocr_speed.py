"""OCR reward speed: milliseconds per 512x512 image on CPU, read by rapidocr (onnxruntime).

    python benchmarks/ocr_speed.py [--num-images 8] [--repeats 3] [--threads 1] [--workers 1 2]

Renders text images (DejaVu Sans Bold, several sizes, some with noise) and blank images, warms
the engine up once, then times the OcrReward on each image one at a time and prints the mean per
image, plus the accuracy as a sanity check. Then it times a burst, every text image submitted at
once to the trainer's AsyncRewardScorer (as an engine-batched group finishes), for each pool size
in --workers (after one untimed burst that warms its engines up), so the speed-up of more workers is measured in
one run. Last, the same burst sent as one request to a reward server on the loopback
(`flowrl reward-server`'s app) with each count in --workers as its --scoring-threads.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from flowrl.data.render_text import render_text_image
from flowrl.rewards.async_scoring import AsyncRewardScorer
from flowrl.rewards.http_client import HttpReward
from flowrl.rewards.ocr import OcrReward
from flowrl.server.http import serve_in_background
from flowrl.server.reward_app import create_reward_app
from flowrl.server.score_request import ServerLimits

TEXTS = (
    "HELLO WORLD",
    "Open 24 Hours",
    "flow grpo",
    "FRESH BREAD",
    "Golden Harbor",
    "SALE TODAY",
    "quiet forest",
    "ROCKET",
)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def time_per_image_ms(reward: OcrReward, images, targets, repeats: int) -> tuple[float, float]:
    scores, start = [], time.perf_counter()
    for _ in range(repeats):
        for image, target in zip(images, targets):
            scores.append(reward(image[None], [""], [{"ground_truth": target}])[0])
    elapsed = time.perf_counter() - start
    return 1000 * elapsed / (repeats * len(images)), float(np.mean(scores))


def burst_seconds(num_workers: int, threads: int, images, targets, repeats: int) -> float:
    """Mean seconds to score every image submitted at once, through a pool of num_workers."""
    reward = OcrReward(num_threads=threads)
    with AsyncRewardScorer(reward, num_workers=num_workers) as scorer:

        def burst() -> None:
            for row, (image, target) in enumerate(zip(images, targets)):
                scorer.submit(row, image, "", {"ground_truth": target})
            scorer.results()

        burst()  # untimed: builds and warms up the engine of every worker that takes rows
        start = time.perf_counter()
        for _ in range(repeats):
            burst()
        return (time.perf_counter() - start) / repeats


def server_burst_seconds(scoring_threads: int, threads: int, images, targets, repeats: int) -> float:
    """Mean seconds of one request holding every image, to a reward server scoring its rows on
    `scoring_threads` threads (PNG encoding and decoding included)."""
    app = create_reward_app(OcrReward(num_threads=threads), ServerLimits(scoring_threads=scoring_threads))
    batch = np.stack(images)
    metadata = [{"ground_truth": target} for target in targets]
    with serve_in_background(app) as url:
        remote = HttpReward(url, timeout_s=600)
        remote(batch, [""] * len(targets), metadata)  # untimed: warms up every thread's engine
        start = time.perf_counter()
        for _ in range(repeats):
            remote(batch, [""] * len(targets), metadata)
        return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="scoring pool sizes for the burst")
    args = parser.parse_args()

    size = 512
    texts = [TEXTS[i % len(TEXTS)] for i in range(args.num_images)]
    text_images = [render_text_image(text, size, 40 + 8 * (i % 3), 20.0 * (i % 2), i) for i, text in enumerate(texts)]
    blank_images = [np.full((3, size, size), 255, np.uint8)] * min(4, args.num_images)

    start = time.perf_counter()
    reward = OcrReward(num_threads=args.threads)
    reward(text_images[0][None], [""], [{"ground_truth": texts[0]}])  # engine init + warm-up
    init_s = time.perf_counter() - start

    text_ms, mean_score = time_per_image_ms(reward, text_images, texts, args.repeats)
    blank_ms, _ = time_per_image_ms(reward, blank_images, ["x"] * len(blank_images), args.repeats)
    print(f"machine: {cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}")
    print(f"rapidocr init + first image: {init_s:.2f} s; onnxruntime threads: {args.threads}")
    print(
        f"OCR ms per 512x512 image with text: {text_ms:.0f} ms (mean score {mean_score:.3f} over {len(texts)} images)"
    )
    print(f"OCR ms per 512x512 blank image:     {blank_ms:.0f} ms")
    bursts = {
        workers: burst_seconds(workers, args.threads, text_images, texts, args.repeats) for workers in args.workers
    }
    for workers, seconds in bursts.items():
        speedup = bursts[args.workers[0]] / seconds
        print(
            f"burst of {len(texts)} images, {workers} scoring worker(s): {seconds:.2f} s "
            f"({speedup:.2f} x {args.workers[0]} worker(s))"
        )
    served = {
        workers: server_burst_seconds(workers, args.threads, text_images, texts, args.repeats)
        for workers in args.workers
    }
    for workers, seconds in served.items():
        speedup = served[args.workers[0]] / seconds
        print(
            f"the same burst as one request to the reward server, {workers} scoring thread(s): {seconds:.2f} s "
            f"({speedup:.2f} x {args.workers[0]} thread(s))"
        )


if __name__ == "__main__":
    main()

"""`flowrl reward-server`: serve a configured reward over HTTP so it can run on another machine.

    flowrl reward-server --reward ocr --port 8100
    FLOWRL_REWARD_TOKEN=SECRET flowrl reward-server --spec-file recipe.yaml --host 0.0.0.0 --port 8100

Binds 127.0.0.1 unless --host says otherwise; on any other interface, set a token (the
FLOWRL_REWARD_TOKEN environment variable, or --token, which other users of the machine can see in
the process list): without one, anyone who reaches the port can use the server. Prints
`serving reward NAME at URL` once it listens (with --port 0 the URL shows the port picked), then
runs until SIGINT/SIGTERM. Point a trainer at it with the `http` reward: options {url: URL}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from flowrl.cli.reward_score import add_reward_arguments, reward_from_args


def build_parser(parser: argparse.ArgumentParser) -> None:
    from flowrl.rewards.http_client import TOKEN_ENV
    from flowrl.server.score_request import ServerLimits

    defaults = ServerLimits()
    add_reward_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s, loopback only)")
    parser.add_argument(
        "--port", type=int, default=8100, help="port to bind, 1-65535; 0 picks a free one (default: %(default)s)"
    )
    parser.add_argument(
        "--token",
        default=None,
        help=f"require 'Authorization: Bearer TOKEN' on /score (default: ${TOKEN_ENV}, else no token)",
    )
    limits = parser.add_argument_group("resource limits (each request; larger ones get 413)")
    limits.add_argument(
        "--max-body-mb",
        type=float,
        default=defaults.max_body_bytes / 2**20,
        help="request body size in MiB (default: %(default)s)",
    )
    for flag, default, meaning in (
        ("--max-batch-size", defaults.max_batch_size, "images per request"),
        ("--max-image-pixels", defaults.max_image_pixels, "width x height of one image"),
        (
            "--max-request-pixels",
            defaults.max_request_pixels,
            "summed width x height of a request's images (3 bytes each decoded)",
        ),
        (
            "--max-concurrency",
            defaults.max_concurrency,
            "requests decoded and scored at once; raise only for thread-safe rewards with spare cores",
        ),
        ("--max-connections", 16, "requests served at once; past it the server answers 503, which clients retry"),
    ):
        limits.add_argument(flag, type=int, default=default, help=f"{meaning} (default: %(default)s)")
    limits.add_argument(
        "--scoring-threads",
        default="auto",
        help="threads a request's rows are cut over when the reward scores rows one by one (OCR), shared by "
        "the requests scored at once; auto: the cores this process may use, less one (default: %(default)s)",
    )


def _thread_count(text: str) -> int | None:
    """--scoring-threads as a count (auto resolved), or None when it is not one."""
    from flowrl.rewards.async_scoring import scoring_workers

    if text == "auto":
        return scoring_workers("auto")
    return int(text) if text.isdigit() and int(text) >= 1 else None


def _fail(message: str, code: int = 2) -> int:
    print(f"flowrl reward-server: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from PIL import Image

    from flowrl.rewards.http_client import TOKEN_ENV
    from flowrl.server.http import serve_until_signal, warn_if_exposed
    from flowrl.server.reward_app import create_reward_app
    from flowrl.server.score_request import ServerLimits

    if not 0 <= args.port <= 65535:
        return _fail(f"--port {args.port} is not a port; use 1-65535, or 0 to pick a free one")
    if args.max_connections < 1:
        return _fail(f"--max-connections {args.max_connections} must be >= 1")
    if not args.max_body_mb > 0:
        return _fail(f"--max-body-mb {args.max_body_mb} must be > 0")
    scoring_threads = _thread_count(args.scoring_threads)
    if scoring_threads is None:
        return _fail(f"--scoring-threads {args.scoring_threads} is not a thread count; use an integer >= 1 or auto")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    try:
        limits = ServerLimits(
            max_body_bytes=int(args.max_body_mb * 2**20),
            max_batch_size=args.max_batch_size,
            max_image_pixels=args.max_image_pixels,
            max_request_pixels=args.max_request_pixels,
            max_concurrency=args.max_concurrency,
            scoring_threads=scoring_threads,
        )
        reward = reward_from_args(args)
        app = create_reward_app(reward, limits, token=token or None)
    except ValueError as error:
        return _fail(str(error))
    # PIL's own decompression-bomb bound, behind the server's header check of every image.
    Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
    if not token:
        warn_if_exposed(
            "reward-server",
            args.host,
            f"serves without authentication to anyone who reaches the port; set {TOKEN_ENV} (or --token)",
        )
    try:
        serve_until_signal(
            app,
            lambda url: f"serving reward {reward.name} at {url}" + (" (token required)" if token else ""),
            host=args.host,
            port=args.port,
            max_connections=args.max_connections,
            name="flowrl reward-server",
            busy_body=json.dumps(
                {"error": "busy", "detail": f"--max-connections={args.max_connections} requests at once; retry later"}
            ).encode(),
        )
    except RuntimeError as error:
        return _fail(str(error), 1)
    return 0

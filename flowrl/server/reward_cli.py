"""`flowrl reward-server`: serve a configured reward over HTTP so it can run on another machine.

    flowrl reward-server --reward ocr --port 8100
    flowrl reward-server --spec-file recipe.yaml --host 0.0.0.0 --port 8100   # open to the network

Binds 127.0.0.1 unless --host says otherwise. Prints `serving reward NAME at URL` once it
listens (with --port 0 the URL shows the port picked), then runs until SIGINT/SIGTERM.
Point a trainer at it with the `http` reward: options {url: URL}.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from flowrl.rewards.cli import add_reward_arguments, reward_from_args


def build_parser(parser: argparse.ArgumentParser) -> None:
    add_reward_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8100, help="port to bind; 0 picks a free one")
    parser.add_argument("--max-batch-size", type=int, default=256, help="largest accepted request batch")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=1,
        help="batches scored at once (raise only for thread-safe rewards with spare cores)",
    )


def run(args: argparse.Namespace) -> int:
    from flowrl.server.reward_app import create_reward_app, serve_in_background

    try:
        reward = reward_from_args(args)
        app = create_reward_app(reward, max_batch_size=args.max_batch_size, max_concurrency=args.max_concurrency)
    except ValueError as error:
        print(f"flowrl reward-server: error: {error}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: stop.set())
    with serve_in_background(app, host=args.host, port=args.port, log_level="info") as url:
        print(f"serving reward {reward.name} at {url}", flush=True)
        stop.wait()
    return 0

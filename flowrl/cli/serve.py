"""`flowrl serve`: the rollout engine behind HTTP (OpenAI Images API, RL rollouts, weight updates).

    flowrl serve --model ./tiny-sd3 --port 8000
    flowrl serve --run outputs/run --port 8000                       # a run's newest weights and settings
    FLOWRL_ADMIN_TOKEN=SECRET flowrl serve --model /models/sd35m     # weight updates and pause/resume on

The model flags are `flowrl generate`'s (flowrl.eval.inference); the engine settings are the
config's `engine` section. Binds 127.0.0.1 unless --host says otherwise. Prints `serving NAME at
URL` once it listens (with --port 0 the URL shows the port picked), then runs until SIGINT /
SIGTERM: the engine stops first (requests in flight answer 503), then the HTTP server.
docs/serving.md describes the endpoints.
"""

from __future__ import annotations

import argparse
import os
import sys

from flowrl.cli import positive_int

_DEFAULT_PORT = 8000


def build_parser(parser: argparse.ArgumentParser) -> None:
    from flowrl.eval.inference import add_model_arguments
    from flowrl.server.generation_request import ServingLimits
    from flowrl.server.wire import ADMIN_TOKEN_ENV

    add_model_arguments(parser, run_help="a run's output_dir: its newest weights and its saved settings")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s, loopback only)")
    parser.add_argument(
        "--port", type=int, default=_DEFAULT_PORT, help="port, 1-65535; 0 picks a free one (default: %(default)s)"
    )
    parser.add_argument(
        "--served-model-name", help="the model name of the OpenAI API (default: the model folder's name)"
    )
    parser.add_argument(
        "--admin-token",
        help=f"bearer token of the weight-update and pause/resume endpoints (default: ${ADMIN_TOKEN_ENV}; "
        "without one they are off)",
    )
    parser.add_argument(
        "--max-batch-rows", type=positive_int, help="most rows per forward (default: engine.max_batch_rows, 32)"
    )
    defaults = ServingLimits()
    limits = parser.add_argument_group("limits (past them a request gets a 4xx, or 503 when the server is full)")
    limits.add_argument(
        "--max-body-mb", type=float, default=defaults.max_body_bytes / 2**20, help="generation request body, MiB"
    )
    limits.add_argument(
        "--max-samples-per-request",
        type=positive_int,
        default=defaults.max_samples_per_request,
        help="images of one request (n, or prompts x num_outputs_per_prompt)",
    )
    limits.add_argument(
        "--max-queued-samples",
        type=positive_int,
        default=defaults.max_queued_samples,
        help="samples accepted and not finished",
    )
    limits.add_argument(
        "--max-weights-mb", type=float, default=defaults.max_weights_bytes / 2**20, help="weight-update body, MiB"
    )
    limits.add_argument(
        "--max-connections", type=positive_int, default=2048, help="requests served at once (503 past it)"
    )


def _fail(message: str, code: int = 2) -> int:
    print(f"flowrl serve: error: {message}", file=sys.stderr)
    return code


def _limits(args):
    from flowrl.server.generation_request import ServingLimits

    for flag, value in (("--max-body-mb", args.max_body_mb), ("--max-weights-mb", args.max_weights_mb)):
        if not value > 0:
            raise ValueError(f"{flag} {value} must be > 0 (MiB)")
    return ServingLimits(
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_samples_per_request=args.max_samples_per_request,
        max_queued_samples=args.max_queued_samples,
        max_weights_bytes=int(args.max_weights_mb * 2**20),
    )


def _open(args):
    """(engine, model name, defaults) for the flags; ValueError naming the flag at fault."""
    from flowrl.eval.inference import open_engine, resolve_setup, weight_sources
    from flowrl.server.rollout_app import ServedDefaults

    sources = weight_sources(args, every_step=False)
    setup = resolve_setup(args, sources)
    if args.max_batch_rows is not None:
        setup.cfg.engine.max_batch_rows = args.max_batch_rows
    engine, loader = open_engine(setup, sources)
    for source in sources:
        loader.load(source)
    defaults = ServedDefaults(rollouts=setup.cfg.rollout.sampling, images=setup.cfg.rollout.val_sampling)
    return engine, args.served_model_name or setup.model_path.name, defaults


def run(args: argparse.Namespace) -> int:
    from flowrl.server import wire
    from flowrl.server.http import serve_until_signal, warn_if_exposed
    from flowrl.server.rollout_app import create_rollout_app, error_response
    from flowrl.server.wire import ADMIN_TOKEN_ENV

    if not 0 <= args.port <= 65535:
        return _fail(f"--port {args.port} is not a port; use 1-65535, or 0 to pick a free one")
    token = args.admin_token if args.admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV)
    try:
        limits = _limits(args)
        engine, name, defaults = _open(args)
    except ValueError as error:
        return _fail(str(error))
    app = create_rollout_app(engine, name, defaults, limits, admin_token=token or None)
    warn_if_exposed(
        "serve",
        args.host,
        "serves image generation and rollouts without authentication to anyone who reaches the port (the "
        "admin token guards only weight updates and pause/resume); bind 127.0.0.1 behind an authenticating "
        "proxy to expose it",
    )

    def stop() -> None:
        app.state.service.is_stopping = True
        engine.shutdown()  # requests in flight fail (503) before the HTTP server stops

    admin = " (weight updates on)" if token else ""
    busy = (
        f"the server is serving --max-connections={args.max_connections} requests at once; retry later "
        "(Retry-After), or start it with a higher --max-connections"
    )
    try:
        serve_until_signal(
            app,
            lambda url: f"serving {name} at {url}{admin}",
            stop,
            host=args.host,
            port=args.port,
            max_connections=args.max_connections,
            name="flowrl serve",
            graceful_timeout_s=10.0,
            busy_body=error_response(busy, 503).body,
            exempt_paths=(wire.WEIGHTS_PATH, wire.PAUSE_PATH, wire.RESUME_PATH),  # token-guarded admin
        )
    except RuntimeError as error:
        return _fail(str(error), 1)
    finally:
        engine.shutdown()
    return 0

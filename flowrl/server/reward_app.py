"""The reward service: any configured Reward served over HTTP (JSON + base64 PNG, or multipart).

Endpoints:
- GET  /health -> {"status": "ok", "reward": name} (no token needed: it tells only the name)
- POST /score  -> {"reward": name, "scores": [float | null], "components": {name: [...]}}
  The request format is described in flowrl.rewards.http_client (the matching client).

Bad requests get a 4xx with {"error": "bad_request", "detail": ...} naming the field and the
fix; they never reach the reward. A reward failure answers 500 with {"error": "reward_failed",
"reward", "row", "cause"} so the client can re-raise it as a RewardError.

Resource bounds (`ServerLimits`, checked as flowrl.server.score_request describes): the body is
read in chunks and refused with 413 past `max_body_bytes` (the rest is drained unread, so the
client gets the answer); decoding and scoring run in worker threads, at most `max_concurrency`
requests at once, so the event loop only reads bodies and /health answers while a batch is
scored. With `token` set, /score needs `Authorization: Bearer <token>` (401 otherwise), checked
before the body is read.

This package is the only place that imports fastapi/uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from flowrl.rewards.base import Reward, RewardError
from flowrl.rewards.http_client import TOKEN_ENV, scores_to_json
from flowrl.server.score_request import BadRequest, ServerLimits, parse_score_request

# Past this many bytes a refused body is no longer drained: the connection is closed instead.
_DRAIN_LIMIT = 1 << 30


async def _drain(request: Request) -> None:
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > _DRAIN_LIMIT:
            return


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or BadRequest(413) once it passes `limit` bytes (never held whole: the
    rest is drained unread, up to _DRAIN_LIMIT, so the client reads the answer)."""
    declared = request.headers.get("content-length", "")
    parts: list[bytes] | None = None if declared.isdigit() and int(declared) > limit else []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if parts is not None and size > limit:
            parts = None
        if parts is not None:
            parts.append(chunk)
        elif size > _DRAIN_LIMIT:
            break
    if parts is None:
        raise BadRequest(
            f"request body over {limit} bytes (--max-body-mb); send fewer images per request "
            "(the http reward's max_request_bytes option)",
            413,
        )
    return b"".join(parts)


def _authorized(request: Request, token: str) -> bool:
    sent = request.headers.get("authorization", "")
    return hmac.compare_digest(sent.encode("utf-8", "replace"), f"Bearer {token}".encode())


def create_reward_app(reward: Reward, limits: ServerLimits | None = None, token: str | None = None) -> FastAPI:
    """A FastAPI app serving `reward` at /score (see the module docstring)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="flowrl reward service")
    slots = asyncio.Semaphore(limits.max_concurrency)

    def decode_and_score(body: bytes, content_type: str):
        images, prompts, metadata = parse_score_request(body, content_type, limits)
        return reward.score_with_components(images, prompts, metadata)

    @app.get("/health")
    async def health():  # on the event loop: never waits behind scoring threads
        return {"status": "ok", "reward": reward.name}

    @app.post("/score")
    async def score(request: Request):
        try:
            if token and not _authorized(request, token):
                await _drain(request)
                detail = f"missing or wrong bearer token; set the http reward's token option or {TOKEN_ENV}"
                headers = {"WWW-Authenticate": "Bearer"}
                return JSONResponse({"error": "unauthorized", "detail": detail}, status_code=401, headers=headers)
            body = await _read_body(request, limits.max_body_bytes)
            async with slots:
                total, components = await run_in_threadpool(
                    decode_and_score, body, request.headers.get("content-type", "")
                )
        except BadRequest as error:
            return JSONResponse({"error": "bad_request", "detail": str(error)}, status_code=error.status_code)
        except RewardError as error:
            cause = error.cause if isinstance(error.cause, str) else f"{type(error.cause).__name__}: {error.cause}"
            content = {
                "error": "reward_failed",
                "reward": error.reward_name,
                "row": error.row_index,
                "cause": cause,
            }
            return JSONResponse(content, status_code=500)
        return {
            "reward": reward.name,
            "scores": scores_to_json(total),
            "components": {name: scores_to_json(values) for name, values in components.items()},
        }

    return app


@contextlib.contextmanager
def serve_in_background(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    startup_timeout_s: float = 20.0,
    max_connections: int | None = None,
):
    """Run `app` with uvicorn in a daemon thread; yields its base URL; stops it on exit.

    port=0 picks a free port (the URL carries the real one). Binds loopback unless told otherwise.
    max_connections: connections served at once; uvicorn answers 503 (retried by the client) past it.
    """
    import uvicorn

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="off", limit_concurrency=max_connections
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="reward-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"reward server did not start on {host}:{port} (port in use? see the log above)")
        time.sleep(0.01)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)

"""The reward service: any configured Reward served over HTTP (JSON + base64 PNG, or multipart).

Endpoints:
- GET  /health -> {"status": "ok", "reward": name}
- POST /score  -> {"reward": name, "scores": [float | null], "components": {name: [...]}}
  The request format is described in flowrl.rewards.http_client (the matching client).

Bad requests get a 4xx with {"error": "bad_request", "detail": ...} naming the field and the
fix; they never reach the reward. A reward failure answers 500 with {"error": "reward_failed",
"reward", "row", "cause"} so the client can re-raise it as a RewardError. Scoring runs in a
worker thread (not on the event loop); `max_concurrency` bounds how many batches score at once.

This package is the only place that imports fastapi/uvicorn.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import re
import threading
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from flowrl.rewards.base import Reward, RewardError
from flowrl.rewards.http_client import decode_png, scores_to_json


class BadRequest(ValueError):
    """A client error: answered with 400 (or `status_code`) and the message."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


def parse_multipart(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """multipart/form-data body -> [(field name, content bytes)] in order (RFC 7578)."""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not match:
        raise BadRequest("multipart request has no boundary in its Content-Type header")
    delimiter = b"\r\n--" + match.group(1).encode("latin-1")
    parts = (b"\r\n" + body).split(delimiter)
    fields = []
    for part in parts[1:]:
        if part.startswith(b"--"):  # closing delimiter
            return fields
        headers, separator, content = part.partition(b"\r\n\r\n")
        if not separator:
            raise BadRequest("malformed multipart body: a part has no header/content separator")
        name = re.search(rb'name="([^"]*)"', headers)
        if not name:
            raise BadRequest("malformed multipart body: a part has no Content-Disposition name")
        fields.append((name.group(1).decode("utf-8"), content))
    raise BadRequest("malformed multipart body: missing the closing boundary")


def _decode_base64_png(value, index: int) -> np.ndarray:
    if not isinstance(value, str):
        raise BadRequest(f"images[{index}] must be a base64 PNG string, got {type(value).__name__}")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadRequest(f"images[{index}] is not valid base64 ({error}); send base64-encoded PNG bytes") from error
    return decode_png(data, f"images[{index}]")


def parse_score_request(
    body: bytes, content_type: str, max_batch_size: int
) -> tuple[np.ndarray, list[str], list[dict]]:
    """Validate a /score request into (images (B, 3, H, W) uint8, prompts, metadata)."""
    try:
        if content_type.startswith("application/json"):
            try:
                payload = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise BadRequest(f"body is not valid JSON ({error})") from error
            if not isinstance(payload, dict):
                raise BadRequest("JSON body must be an object with images, prompts and metadata")
            raw_images = payload.get("images")
            if not isinstance(raw_images, list) or not raw_images:
                raise BadRequest("field 'images' must be a non-empty list of base64 PNG strings")
            images = [_decode_base64_png(value, index) for index, value in enumerate(raw_images[: max_batch_size + 1])]
        elif content_type.startswith("multipart/form-data"):
            fields = parse_multipart(body, content_type)
            requests = [content for name, content in fields if name == "request"]
            if len(requests) != 1:
                raise BadRequest("multipart request needs exactly one 'request' field with JSON {prompts, metadata}")
            try:
                payload = json.loads(requests[0])
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise BadRequest(f"multipart field 'request' is not valid JSON ({error})") from error
            if not isinstance(payload, dict):
                raise BadRequest("multipart field 'request' must be a JSON object with prompts and metadata")
            files = [content for name, content in fields if name == "images"]
            if not files:
                raise BadRequest("multipart request has no 'images' file parts")
            images = [
                decode_png(content, f"images[{index}]") for index, content in enumerate(files[: max_batch_size + 1])
            ]
        else:
            raise BadRequest(
                f"unsupported Content-Type {content_type!r}; use application/json or multipart/form-data", 415
            )
    except BadRequest:
        raise
    except ValueError as error:  # decode_png names the image and the fix
        raise BadRequest(str(error)) from error
    if len(images) > max_batch_size:
        raise BadRequest(f"at most {max_batch_size} images per request; split the batch", 413)
    batch_size = len(images)
    prompts = payload.get("prompts", [""] * batch_size)
    metadata = payload.get("metadata", [{}] * batch_size)
    if not isinstance(prompts, list) or len(prompts) != batch_size or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(f"field 'prompts' must be a list of {batch_size} strings, one per image")
    if not isinstance(metadata, list) or len(metadata) != batch_size or not all(isinstance(m, dict) for m in metadata):
        raise BadRequest(f"field 'metadata' must be a list of {batch_size} objects, one per image")
    shapes = sorted({image.shape for image in images})
    if len(shapes) != 1:
        raise BadRequest(f"all images of one request must have the same size, got {shapes}; send one request per size")
    return np.stack(images), prompts, metadata


def create_reward_app(reward: Reward, max_batch_size: int = 256, max_concurrency: int = 1) -> FastAPI:
    """A FastAPI app serving `reward` at /score (see the module docstring)."""
    if max_concurrency < 1 or max_batch_size < 1:
        raise ValueError(f"max_concurrency={max_concurrency} and max_batch_size={max_batch_size} must be >= 1")
    app = FastAPI(title="flowrl reward service")
    slots = threading.Semaphore(max_concurrency)

    def score_blocking(images, prompts, metadata):
        with slots:
            return reward.score_with_components(images, prompts, metadata)

    @app.get("/health")
    def health():
        return {"status": "ok", "reward": reward.name}

    @app.post("/score")
    async def score(request: Request):
        body = await request.body()
        try:
            images, prompts, metadata = parse_score_request(
                body, request.headers.get("content-type", ""), max_batch_size
            )
        except BadRequest as error:
            return JSONResponse({"error": "bad_request", "detail": str(error)}, status_code=error.status_code)
        try:
            total, components = await run_in_threadpool(score_blocking, images, prompts, metadata)
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
):
    """Run `app` with uvicorn in a daemon thread; yields its base URL; stops it on exit.

    port=0 picks a free port (the URL carries the real one). Binds loopback unless told otherwise.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off"))
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

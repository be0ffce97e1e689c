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
scored. A reward that scores rows one by one (OCR) has each request's rows cut into contiguous
chunks scored at once on `scoring_threads` threads: a trainer's burst arrives as one request, and
would otherwise be scored on one core. With `token` set, /score needs `Authorization: Bearer
<token>` (401 otherwise), checked before the body is read.

This package is the only place that imports fastapi/uvicorn.
"""

from __future__ import annotations

import asyncio
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from flowrl.rewards.base import Reward, RewardError
from flowrl.rewards.http_client import TOKEN_ENV, scores_to_json
from flowrl.server.http import drain, has_bearer_token, read_body
from flowrl.server.score_request import BadRequest, ServerLimits, parse_score_request

_BODY_FIX = "raise --max-body-mb, or send fewer images per request (the http reward's max_request_bytes option)"


def score_in_chunks(
    reward: Reward, images: np.ndarray, prompts: list, metadata: list, pool: ThreadPoolExecutor, chunks: int
):
    """`reward`'s (total, components) of a batch, scored as `chunks` contiguous chunks at once on
    `pool` and put back in row order. A failure is the first failing chunk's, its row counted in
    the whole batch, so it names the row a serial pass would have stopped at."""
    bounds = np.linspace(0, len(prompts), min(chunks, len(prompts)) + 1).round().astype(int)
    spans = [(int(start), int(end)) for start, end in zip(bounds[:-1], bounds[1:])]
    futures = [
        pool.submit(reward.score_with_components, images[start:end], prompts[start:end], metadata[start:end])
        for start, end in spans
    ]
    results = []
    for (start, _), future in zip(spans, futures):
        try:
            results.append(future.result())
        except RewardError as error:
            raise error.with_row_index(None if error.row_index is None else start + error.row_index) from error
    total = np.concatenate([r[0] for r in results])
    components = {name: np.concatenate([r[1][name] for r in results]) for name in results[0][1]}
    return total, components


def create_reward_app(reward: Reward, limits: ServerLimits | None = None, token: str | None = None) -> FastAPI:
    """A FastAPI app serving `reward` at /score (see the module docstring)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="flowrl reward service")
    slots = asyncio.Semaphore(limits.max_concurrency)
    chunked = reward.scores_rows_one_by_one and limits.scoring_threads > 1
    pool = ThreadPoolExecutor(limits.scoring_threads, thread_name_prefix="flowrl-reward-rows") if chunked else None
    if pool is not None:  # its idle threads end with the app (uvicorn runs it without lifespan events)
        weakref.finalize(app, pool.shutdown, wait=False, cancel_futures=True)

    def decode_and_score(body: bytes, content_type: str):
        images, prompts, metadata = parse_score_request(body, content_type, limits)
        if pool is not None and len(prompts) > 1:
            return score_in_chunks(reward, images, prompts, metadata, pool, limits.scoring_threads)
        return reward.score_with_components(images, prompts, metadata)

    @app.get("/health")
    async def health():  # on the event loop: never waits behind scoring threads
        return {"status": "ok", "reward": reward.name}

    @app.post("/score")
    async def score(request: Request):
        try:
            if token and not has_bearer_token(request, token):
                await drain(request)
                detail = f"missing or wrong bearer token; set the http reward's token option or {TOKEN_ENV}"
                headers = {"WWW-Authenticate": "Bearer"}
                return JSONResponse({"error": "unauthorized", "detail": detail}, status_code=401, headers=headers)
            body = await read_body(request, limits.max_body_bytes, _BODY_FIX)
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

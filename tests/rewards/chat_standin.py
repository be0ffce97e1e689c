"""A stand-in chat-completions server on 127.0.0.1 that judges images by their brightness.

Answers (the image's mean brightness b in [0, 1]): a request with `logprobs` -> first-token top
log-probs with P(yes) = b split over "Yes" and " yes"; two images -> "A" or "B", the brighter
one; else "Score: round(10 b)". Markers in the question script failures: `[429xN]` / `[500xN]`
answer that status N times per question, then normally; `[400]` always 400; `[garbage]` a
wordy answer with no score; `[notjson]` a 200 that is not JSON; `[slow]` waits 3 s.
`delay_s` is waited per image (asynchronously: concurrent requests overlap).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import math
import re
from collections import Counter

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from PIL import Image

from flowrl.server.http import serve_in_background


def brightness(data_url: str) -> float:
    payload = data_url.split("base64,", 1)[1]
    return float(np.asarray(Image.open(io.BytesIO(base64.b64decode(payload)))).mean() / 255.0)


class StandIn:
    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.failures_sent: Counter = Counter()
        self.in_flight = self.max_in_flight = 0
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.complete)

    async def complete(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        parts = body["messages"][0]["content"]
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        images = [brightness(p["image_url"]["url"]) for p in parts if p["type"] == "image_url"]
        for status, count in re.findall(r"\[(429|500)x(\d+)\]", text):
            if self.failures_sent[(text, status)] < int(count):
                self.failures_sent[(text, status)] += 1
                return JSONResponse({"error": {"message": f"scripted {status}"}}, status_code=int(status))
        if "[400]" in text:
            return JSONResponse({"error": {"message": "unknown model"}}, status_code=400)
        if "[notjson]" in text:
            return PlainTextResponse("oops")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s * len(images) + (3.0 if "[slow]" in text else 0.0))
        finally:
            self.in_flight -= 1
        choice = {"index": 0, "finish_reason": "stop", "logprobs": None}
        if body.get("logprobs"):
            p = min(max(images[0], 1e-6), 1 - 1e-6)
            top = [("Yes", math.log(0.7 * p)), (" yes", math.log(0.3 * p)), ("No", math.log(1 - p))]
            top_logprobs = [{"token": t, "logprob": lp, "bytes": None} for t, lp in top[: body["top_logprobs"]]]
            choice["logprobs"] = {"content": [{"token": "Yes", "logprob": top[0][1], "top_logprobs": top_logprobs}]}
            content = "Yes"
        elif len(images) == 2:
            content = "A" if images[0] >= images[1] else "B"
        else:
            content = f"Score: {round(10 * images[0])}"
        if "[garbage]" in text:
            content = "I would rather not say."
        choice["message"] = {"role": "assistant", "content": content}
        return {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [choice]}


@contextlib.contextmanager
def standin_server(delay_s: float = 0.0):
    """(StandIn, base URL ending in /v1) on 127.0.0.1."""
    standin = StandIn(delay_s)
    with serve_in_background(standin.app, host="127.0.0.1", port=0) as url:
        yield standin, url + "/v1"


def gray_images(levels: list[int], size: int = 8) -> np.ndarray:
    return np.stack([np.full((3, size, size), level, dtype=np.uint8) for level in levels])

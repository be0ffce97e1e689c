"""HTTP scorer: a reward computed by a remote reward service (`flowrl reward-server`).

Wire format (JSON only, never pickle). POST `<url>/score` with either
- JSON: {"images": [base64 PNG, ...], "prompts": [...], "metadata": [{...}, ...]}, or
- multipart/form-data: one file part "images" per image (PNG, in row order) and a field
  "request" holding the JSON {"prompts": [...], "metadata": [...]}.
The answer is {"reward": name, "scores": [float | null], "components": {name: [float | null]}};
null marks a row an optional remote component could not score (NaN here).

Transient failures (connection errors, timeouts, HTTP 408/429/5xx) are retried up to
`max_attempts` times with exponential backoff (a 429/503 Retry-After header is honoured, capped
by `max_backoff_s`). Other 4xx answers mean our request is wrong and fail at once. A remote
reward failure (HTTP 500 with error "reward_failed") is re-raised as a RewardError naming the
remote reward and row, without retrying: the same input would fail the same way.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable

import httpx
import numpy as np
from PIL import Image

from flowrl.rewards.base import Reward, RewardError

RETRYABLE_STATUS = frozenset({408, 429})


def encode_png(image_chw: np.ndarray) -> bytes:
    """(3, H, W) uint8 -> PNG bytes (lossless; low compression level because speed matters more)."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image_chw.transpose(1, 2, 0))).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def decode_png(data: bytes, field: str = "image") -> np.ndarray:
    """PNG (or any PIL-readable RGB image) bytes -> (3, H, W) uint8; ValueError naming `field`."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as error:
        raise ValueError(
            f"{field} is not a readable image ({type(error).__name__}: {error}); send RGB PNG bytes"
        ) from error
    if image.mode != "RGB":
        raise ValueError(f"{field} has mode {image.mode!r}; send 8-bit RGB images (convert RGBA/L to RGB first)")
    return np.asarray(image).transpose(2, 0, 1).copy()


def encode_png_base64(image_chw: np.ndarray) -> str:
    return base64.b64encode(encode_png(image_chw)).decode("ascii")


def scores_from_json(values, field: str) -> np.ndarray:
    """A JSON list of numbers or null -> float64 array with NaN for null."""
    if not isinstance(values, list):
        raise ValueError(f"reward service answer field {field!r} is not a list: {values!r}")
    return np.array([np.nan if value is None else float(value) for value in values], dtype=np.float64)


def scores_to_json(scores: np.ndarray) -> list:
    """float array -> JSON list, NaN as null (JSON has no NaN)."""
    return [None if np.isnan(value) else float(value) for value in np.asarray(scores, dtype=np.float64)]


class HttpRewardError(RuntimeError):
    """The reward service could not be reached or kept failing."""

    def __init__(self, url: str, num_attempts: int, last_error: str):
        self.url, self.num_attempts, self.last_error = url, num_attempts, last_error
        plural = "attempt" if num_attempts == 1 else "attempts"
        super().__init__(f"POST {url} failed after {num_attempts} {plural}; last error: {last_error}")


def _retry_after_seconds(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:  # an HTTP date; plain backoff is good enough
        return None


class HttpReward(Reward):
    """Scores by POSTing the batch to `<url>/score` of a reward service."""

    name = "http"

    def __init__(
        self,
        url: str,
        transport: str = "json",
        timeout_s: float = 60.0,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"http option url={url!r} must start with http:// or https://, e.g. http://127.0.0.1:8000")
        if transport not in ("json", "multipart"):
            raise ValueError(f"http option transport={transport!r} must be 'json' or 'multipart'")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"http option max_attempts={max_attempts!r} must be an integer >= 1")
        if timeout_s <= 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(
                f"http options timeout_s={timeout_s}, backoff_s={backoff_s}, max_backoff_s={max_backoff_s} must be positive"
            )
        self.score_url = url.rstrip("/") + "/score"
        self.transport = transport
        self.max_attempts, self.backoff_s, self.max_backoff_s = (
            max_attempts,
            float(backoff_s),
            float(max_backoff_s),
        )
        self.client = client or httpx.Client(timeout=httpx.Timeout(timeout_s))
        self._sleep = sleep

    def _request_kwargs(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> dict:
        if self.transport == "json":
            payload = {
                "images": [encode_png_base64(image) for image in images],
                "prompts": prompts,
                "metadata": metadata,
            }
            return {"json": payload}
        files = [("images", (f"{row}.png", encode_png(image), "image/png")) for row, image in enumerate(images)]
        return {"files": files, "data": {"request": json.dumps({"prompts": prompts, "metadata": metadata})}}

    def _raise_if_remote_reward_failed(self, response: httpx.Response) -> None:
        try:
            body = response.json()
        except ValueError:
            return
        if isinstance(body, dict) and body.get("error") == "reward_failed":
            cause = f"remote reward {body.get('reward')!r} at {self.score_url}: {body.get('cause')}"
            raise RewardError(self.name, body.get("row"), cause)

    def post(self, **request_kwargs) -> dict:
        """POST with bounded retries; returns the decoded JSON answer."""
        last_error = "no attempt made"
        for attempt in range(1, self.max_attempts + 1):
            wait_s = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.client.post(self.score_url, **request_kwargs)
            except httpx.TransportError as error:  # connect/read errors and timeouts
                last_error = f"{type(error).__name__}: {error}"
            else:
                if response.is_success:
                    return response.json()
                last_error = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code >= 500:
                    self._raise_if_remote_reward_failed(response)
                elif response.status_code not in RETRYABLE_STATUS:
                    raise HttpRewardError(
                        self.score_url, attempt, last_error + " (not retried: the request was rejected)"
                    )
                retry_after = _retry_after_seconds(response)
                if retry_after is not None:
                    wait_s = min(self.max_backoff_s, retry_after)
            if attempt < self.max_attempts:
                self._sleep(wait_s)
        raise HttpRewardError(self.score_url, self.max_attempts, last_error)

    def score_batch_with_components(self, images, prompts, metadata):
        answer = self.post(**self._request_kwargs(images, prompts, metadata))
        scores = scores_from_json(answer.get("scores"), "scores")
        if scores.shape != (len(prompts),):
            raise ValueError(
                f"reward service at {self.score_url} returned {scores.shape[0]} scores for {len(prompts)} images"
            )
        components = {
            name: scores_from_json(values, f"components.{name}")
            for name, values in (answer.get("components") or {}).items()
        }
        return scores, components or {self.name: scores}

    def close(self) -> None:
        self.client.close()

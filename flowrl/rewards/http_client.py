"""HTTP scorer: a reward computed by a remote reward service (`flowrl reward-server`).

Wire format (JSON only, never pickle). POST `<url>/score` with either
- JSON: {"images": [base64 PNG, ...], "prompts": [...], "metadata": [{...}, ...]}, or
- multipart/form-data: one file part "images" per image (PNG, in row order) and a field
  "request" holding the JSON {"prompts": [...], "metadata": [...]}.
The answer is {"reward": name, "scores": [float | null], "components": {name: [float | null]}};
null marks a row an optional remote component could not score (NaN here).

A batch is sent as several requests when it is larger than `max_request_images` images or
`max_request_bytes` encoded bytes (the server refuses bodies and batches past its limits with
413). `token` (or the FLOWRL_REWARD_TOKEN environment variable) is sent as
`Authorization: Bearer <token>` for a server started with one. With `scores_groups` (a remote
group-wise reward, as `vlm` in pairwise mode) the trainer hands this reward whole groups and
requests are cut only between groups (flowrl.rewards.groups), unless one group alone passes the
limits.

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
import os
import time
from collections.abc import Callable

import httpx
import numpy as np
from PIL import Image

from flowrl.rewards.base import Reward, RewardError
from flowrl.rewards.groups import group_key

RETRYABLE_STATUS = frozenset({408, 429})
TOKEN_ENV = "FLOWRL_REWARD_TOKEN"  # the bearer token, read by the server and the client


def encode_png(image_chw: np.ndarray) -> bytes:
    """(3, H, W) uint8 -> PNG bytes (lossless; low compression level because speed matters more)."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image_chw.transpose(1, 2, 0))).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


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
        token: str | None = None,
        max_request_images: int = 32,
        max_request_bytes: int = 32 * 2**20,
        scores_groups: bool = False,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.scores_groups = bool(scores_groups)
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
        for name, value in (("max_request_images", max_request_images), ("max_request_bytes", max_request_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"http option {name}={value!r} must be an integer >= 1")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        if token is not None and not isinstance(token, str):
            raise ValueError(f"http option token must be a string (or set {TOKEN_ENV})")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.max_request_images, self.max_request_bytes = max_request_images, max_request_bytes
        self.score_url = url.rstrip("/") + "/score"
        self.transport = transport
        self.max_attempts, self.backoff_s, self.max_backoff_s = (
            max_attempts,
            float(backoff_s),
            float(max_backoff_s),
        )
        self.client = client or httpx.Client(timeout=httpx.Timeout(timeout_s))
        self._sleep = sleep

    def _encode(self, image: np.ndarray):
        return encode_png(image) if self.transport == "multipart" else encode_png_base64(image)

    def _request_kwargs(self, encoded: list, prompts: list[str], metadata: list[dict]) -> dict:
        if self.transport == "json":
            return {"json": {"images": encoded, "prompts": prompts, "metadata": metadata}}
        files = [("images", (f"{row}.png", data, "image/png")) for row, data in enumerate(encoded)]
        return {"files": files, "data": {"request": json.dumps({"prompts": prompts, "metadata": metadata})}}

    def _request_slices(self, encoded: list, groups: list[str] | None = None) -> list[slice]:
        """Consecutive row ranges within max_request_images and max_request_bytes (one image at
        least); with `groups` (each row's group), cut before the group that would pass them."""
        slices, start, size = [], 0, 0
        group_start = 0  # the first row of the current row's group
        for row, data in enumerate(encoded):
            if groups is not None and row > 0 and groups[row] != groups[row - 1]:
                group_start = row
            if row > start and (row - start >= self.max_request_images or size + len(data) > self.max_request_bytes):
                cut = group_start if groups is not None and group_start > start else row
                slices.append(slice(start, cut))
                start, size = cut, sum(len(item) for item in encoded[cut:row])
            size += len(data)
        return [*slices, slice(start, len(encoded))]

    def _raise_if_remote_reward_failed(self, response: httpx.Response, first_row: int) -> None:
        try:
            body = response.json()
        except ValueError:
            return
        if isinstance(body, dict) and body.get("error") == "reward_failed":
            cause = f"remote reward {body.get('reward')!r} at {self.score_url}: {body.get('cause')}"
            row = body.get("row")
            raise RewardError(self.name, first_row + row if isinstance(row, int) else row, cause)

    def post(self, first_row: int = 0, **request_kwargs) -> dict:
        """POST with bounded retries; returns the decoded JSON answer (first_row: the batch row of
        the request's first image, for a remote failure's row)."""
        last_error = "no attempt made"
        for attempt in range(1, self.max_attempts + 1):
            wait_s = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.client.post(self.score_url, headers=self.headers, **request_kwargs)
            except httpx.TransportError as error:  # connect/read errors and timeouts
                last_error = f"{type(error).__name__}: {error}"
            else:
                if response.is_success:
                    return response.json()
                last_error = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code >= 500:
                    self._raise_if_remote_reward_failed(response, first_row)
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
        encoded = [self._encode(image) for image in images]
        scores, components = [], {}
        groups = [group_key(p, m) for p, m in zip(prompts, metadata)] if self.scores_groups else None
        for rows in self._request_slices(encoded, groups):
            answer = self.post(rows.start, **self._request_kwargs(encoded[rows], prompts[rows], metadata[rows]))
            part = scores_from_json(answer.get("scores"), "scores")
            count = rows.stop - rows.start
            if part.shape != (count,):
                raise ValueError(
                    f"reward service at {self.score_url} returned {part.shape[0]} scores for {count} images"
                )
            scores.append(part)
            for name, values in (answer.get("components") or {}).items():
                components.setdefault(name, []).append(scores_from_json(values, f"components.{name}"))
        total = np.concatenate(scores)
        joined = {name: np.concatenate(parts) for name, parts in components.items() if len(parts) == len(scores)}
        return total, joined or {self.name: total}

    def close(self) -> None:
        self.client.close()

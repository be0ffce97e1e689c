"""A client of OpenAI-compatible chat-completions endpoints (vLLM, SGLang, hosted APIs) for judges.

`user_message(text, images)` builds one user turn in the content-parts format the official
OpenAI Python client sends: a text part, then one `image_url` part per image holding a base64
PNG data URL. `ChatClient.complete(body)` POSTs `<url>/chat/completions` and returns the first
choice, retrying transient failures with exponential backoff:

- unreachable (connection refused, DNS) and timed out: retried;
- HTTP 429 (rate limited) and 5xx: retried, a Retry-After header honoured (capped by `max_backoff_s`);
- any other 4xx: not retried (the request itself is wrong: a model name, an option the server lacks);
- an answer that is not chat-completions JSON: not retried.

Each failure is a `JudgeError` whose `kind` names it (unreachable, timed_out, rate_limited, server_error,
http_status, unparsable). The API key is read from the environment variable whose *name* is
given; it is sent as `Authorization: Bearer <key>` and never appears in an error or a log.

This module knows the protocol only; what is asked and how an answer becomes a score is
flowrl.rewards.vlm's business.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import httpx
import numpy as np

from flowrl.rewards.http_client import _retry_after_seconds, encode_png_base64

RETRYABLE_KINDS = ("unreachable", "timed_out", "rate_limited", "server_error")


class JudgeError(RuntimeError):
    """A chat-completions request failed: `kind` is one of unreachable, timed_out,
    rate_limited, server_error, http_status, unparsable; `num_attempts` how often it was sent."""

    def __init__(self, kind: str, detail: str, num_attempts: int = 1):
        self.kind, self.detail, self.num_attempts = kind, detail, num_attempts
        plural = "attempt" if num_attempts == 1 else "attempts"
        super().__init__(f"judge {kind.replace('_', ' ')} after {num_attempts} {plural}: {detail}")


def image_data_url(image_chw: np.ndarray) -> str:
    """(3, H, W) uint8 -> a `data:image/png;base64,...` URL."""
    return "data:image/png;base64," + encode_png_base64(image_chw)


def user_message(text: str, images: list[np.ndarray]) -> dict:
    """One user turn: the question, then the images (content parts, as the OpenAI client sends them)."""
    parts: list[dict] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images]
    return {"role": "user", "content": parts}


def read_api_key(env_name: str | None) -> str | None:
    """The key in environment variable `env_name` (None: no key). A named but unset variable is an
    error naming the variable, never a value."""
    if env_name is None:
        return None
    if not isinstance(env_name, str) or not env_name:
        raise ValueError(f"vlm option api_key_env={env_name!r} must be the NAME of an environment variable")
    key = os.environ.get(env_name)
    if not key:
        raise ValueError(
            f"vlm option api_key_env={env_name!r}: the environment variable {env_name} is not set or empty; "
            f"export it (export {env_name}=...) or drop api_key_env for a server without a key"
        )
    return key


class ChatClient:
    """POSTs chat-completions requests with bounded retries (module docstring). Thread-safe."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_connections: int = 16,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self._api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers, limits=limits)
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, max_backoff_s
        self._sleep = sleep

    def _redact(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    def _send_once(self, body: dict) -> tuple[dict | None, str, str, float | None]:
        """(first choice, "", "", None), or (None, failure kind, detail, Retry-After seconds or None)."""
        where = f"POST {self.endpoint}"
        try:
            response = self.client.post(self.endpoint, json=body)
        except httpx.TimeoutException as error:
            return None, "timed_out", f"{where}: {type(error).__name__}", None
        except httpx.TransportError as error:
            return None, "unreachable", f"{where}: {type(error).__name__}: {error}", None
        text = self._redact(response.text[:300])
        if response.status_code == 429 or response.status_code >= 500:
            kind = "rate_limited" if response.status_code == 429 else "server_error"
            return None, kind, f"{where}: HTTP {response.status_code}: {text}", _retry_after_seconds(response)
        if not response.is_success:
            fix = "not retried: the server rejected the request; check the model name and options"
            return None, "http_status", f"{where}: HTTP {response.status_code}: {text} ({fix})", None
        try:
            return response.json()["choices"][0], "", "", None
        except (ValueError, KeyError, IndexError, TypeError):
            return None, "unparsable", f"{where}: not a chat-completions answer: {text!r}", None

    def complete(self, body: dict) -> dict:
        """The first choice of the answer to `body` (a chat-completions request), or JudgeError."""
        for attempt in range(1, self.max_attempts + 1):
            choice, kind, detail, retry_after = self._send_once(body)
            if choice is not None:
                return choice
            if kind not in RETRYABLE_KINDS or attempt == self.max_attempts:
                raise JudgeError(kind, detail, attempt)
            wait_s = self.backoff_s * 2 ** (attempt - 1) if retry_after is None else retry_after
            self._sleep(min(self.max_backoff_s, wait_s))
        raise AssertionError("not reached: the last attempt returns or raises")

    def close(self) -> None:
        self.client.close()

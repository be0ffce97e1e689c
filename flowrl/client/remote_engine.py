"""RemoteEngine: the rollout engine's API over HTTP, for a `flowrl serve` server.

`RemoteEngine(url)` has the methods of `flowrl.engine.DiffusionEngine` that callers use:
`generate`, `generate_batched`, their async twins, `submit` / `submit_many` / `submit_batched`
(returning `concurrent.futures.Future`s, as the agent loop and the balancer use them) and
`stats()`, so `AgentLoop` drives local engines and remote servers alike. The outputs are the
server's `DiffusionOutput`s, decoded from the wire format of `flowrl.server.wire` (a JSON request,
answered with one safetensors file; never pickle): the same tensors the server's engine produced.

Each request is one HTTP call on a background event loop (one thread per client, an
`httpx.AsyncClient` with pooled connections), so hundreds of requests can be in flight at once and
the server batches them into shared forwards. Connection failures and 502/503/504 answers are
retried `max_attempts` times with exponential backoff, then raise `ServerUnavailableError`
naming the server (a balancer then re-sends the request to another replica); a 4xx raises
`RemoteRequestError` (a ValueError) with the server's message, at once: the server's engine
refuses what the in-process engine refuses, with the same message. The checks that need no model
are the engine's own (`flowrl.engine.api`, `SamplingParams.validate`), made before anything is
sent. A request that takes longer than `timeout_s` counts as the server being unavailable.
Cancelling every future of a request (or the coroutine of an async call) closes its connection,
which cancels it on the server. As with the engine's `shutdown()`, `close()` fails the requests in
flight with `EngineClosedError` and refuses new ones with it.

Weight updates (`push_weights`, `load_weights`, `weights_info`) need the server's admin token:
`admin_token`, or the FLOWRL_ADMIN_TOKEN environment variable.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future

import httpx

from flowrl.client.errors import RemoteEngineError, RemoteRequestError, ServerUnavailableError
from flowrl.engine.api import (
    EngineAPI,
    EngineClosedError,
    check_num_outputs_per_prompt,
    check_prompts,
    request_params,
    settle,
)
from flowrl.sampling_params import SamplingParams
from flowrl.server import wire

ADMIN_TOKEN_ENV = wire.ADMIN_TOKEN_ENV
RETRYABLE_STATUS = frozenset({502, 503, 504})
# Counters of engine.stats() that stats() reports since the last reset_stats().
_COUNTERS = ("num_forwards", "num_rows", "num_samples_finished", "num_samples_failed", "busy_seconds")
_RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)


class RemoteEngine(EngineAPI):
    """A `flowrl serve` server behind the engine's API (see the module docstring)."""

    # A call is one HTTP request: its samples come back together, in one response, and the server
    # takes at most --max-samples-per-request of them.
    is_in_process = False

    def __init__(
        self,
        url: str,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_attempts: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 256,
        admin_token: str | None = None,
    ):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url={url!r} must start with http:// or https://, e.g. http://127.0.0.1:8000")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts!r} must be an integer >= 1")
        if not (timeout_s > 0 and connect_timeout_s > 0 and backoff_s >= 0):
            raise ValueError(
                f"timeout_s={timeout_s}, connect_timeout_s={connect_timeout_s} must be > 0 and "
                f"backoff_s={backoff_s} >= 0"
            )
        self.url = url.rstrip("/")
        self.max_attempts, self.backoff_s = max_attempts, float(backoff_s)
        self.admin_token = admin_token if admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV)
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=None)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"flowrl-client-{self.url}", daemon=True)
        self._thread.start()
        self._stats_base: dict | None = None
        self._is_closed = False
        self._lock = threading.Lock()

    # --- the engine's API (generate, generate_batched, async twins, submit: flowrl.engine.api) ---
    def submit_many(
        self, prompts: list[str], sampling_params: SamplingParams | None = None, num_outputs_per_prompt: int = 1
    ) -> list[Future]:
        """N samples per prompt, prompt i's sample j with seed + i * N + j (the engine's rule), in one
        request."""
        check_prompts(prompts)
        check_num_outputs_per_prompt(num_outputs_per_prompt)
        num_samples = len(prompts) * num_outputs_per_prompt
        for prompt in prompts:
            params = request_params(prompt, sampling_params).validate(num_samples=num_samples)
        return self._submit(wire.rollout_request(prompts, num_outputs_per_prompt, params), num_samples)

    def submit_batched(
        self, prompt: str, num_outputs_per_prompt: int, sampling_params: SamplingParams | None = None
    ) -> list[Future]:
        """Send one rollout request for N samples of `prompt`; one future per sample."""
        check_num_outputs_per_prompt(num_outputs_per_prompt)
        params = request_params(prompt, sampling_params).validate(num_samples=num_outputs_per_prompt)
        return self._submit(wire.rollout_request(prompt, num_outputs_per_prompt, params), num_outputs_per_prompt)

    def _submit(self, body: dict, num_samples: int) -> list[Future]:
        with self._lock:  # close() cannot slip in between: every request it sees is cancelled
            self._refuse_if_closed()
            request = asyncio.run_coroutine_threadsafe(self._rollout(body), self._loop)
        futures = [Future() for _ in range(num_samples)]
        _fan_out(self.url, request, futures, self._closed_error)
        return futures

    def _refuse_if_closed(self) -> None:
        if self._is_closed:
            raise EngineClosedError(f"RemoteEngine({self.url}) is closed; create a new RemoteEngine to generate again")

    def _closed_error(self) -> EngineClosedError | None:
        """What a request cut off by close() fails with (None while the client is open: a cancel)."""
        if not self._is_closed:
            return None
        return EngineClosedError(f"RemoteEngine({self.url}).close() was called while this request was in flight")

    def stats(self) -> dict:
        """The server engine's batching counters since the last `reset_stats()` (the engine's keys:
        num_forwards, num_rows, rows_per_forward_hist, num_samples_finished, mean_rows_per_forward,
        images_per_second, policy_version, ...)."""
        return _stats_since(self._stats_now(), self._stats_base)

    def reset_stats(self) -> None:
        self._stats_base = self._stats_now()

    def _stats_now(self) -> dict:
        return wire.stats_from_json(self._call(self._get_json(wire.STATS_PATH)))

    def health(self) -> dict:
        """The server's /health answer (status, model, policy_version, samples_in_flight, ...)."""
        return self._call(self._get_json(wire.HEALTH_PATH))

    @property
    def policy_version(self) -> int:
        return int(self.health()["policy_version"])

    # --- weights (admin) ---------------------------------------------------------------------------
    def load_weights(self, body: bytes, version: int, kind: str) -> dict:
        """Upload weights (`wire.encode_weights`' bytes; `kind` "lora" or "full") as policy
        `version`. The server verifies them (checksum, names, shapes, dtypes), lets the samples in
        flight finish, and answers once they are live (policy_version, weights_sha256, ...)."""
        return self._call(self._load_weights(body, version, kind))

    def push_weights(self, upload, version: int) -> None:
        """Upload a flowrl.client.weights.WeightsUpload as policy `version` and check that the server
        then serves that version with the upload's checksum (a RuntimeError naming both if not)."""
        self.load_weights(upload.body, version, upload.kind)  # answers once the weights are live
        info = self.weights_info()
        live = (int(info["policy_version"]), info["weights_sha256"])
        if live != (version, upload.sha256):
            raise RuntimeError(
                f"rollout server {self.url} serves version {live[0]} with weights_sha256 {live[1]}; "
                f"the trainer sent version {version} with {upload.sha256}"
            )

    def weights_info(self) -> dict:
        """The live weights as the server reports them: policy_version, kind, weights_sha256."""
        return self._call(self._get_json(wire.WEIGHTS_PATH, admin=True))

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Fail the requests in flight with EngineClosedError (their connections close, which cancels
        them on the server), close the connections and stop the client's thread; new requests are
        refused with EngineClosedError. Calling it again does nothing."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    shutdown = close  # the engine's name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"RemoteEngine({self.url!r})"

    # --- on the client's event loop ------------------------------------------------------------------
    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        return self._client

    async def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One call with bounded retries; ServerUnavailableError / RemoteRequestError / RemoteEngineError."""
        what, last_error = f"{method} {path}", ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                response = await self._http().request(method, self.url + path, **kwargs)
            except httpx.TimeoutException as exc:
                if not isinstance(exc, httpx.ConnectTimeout):  # slow, not unreachable: do not pile on
                    raise ServerUnavailableError(self.url, what, attempt, f"no answer in time: {exc!r}") from exc
                last_error = repr(exc)
            except _RETRYABLE_ERRORS as exc:
                last_error = repr(exc)
            else:
                if response.status_code < 400:
                    return response
                message = _error_message(response)
                if response.status_code in RETRYABLE_STATUS:
                    last_error = f"HTTP {response.status_code}: {message}"
                elif response.status_code < 500:
                    raise RemoteRequestError(self.url, response.status_code, message)
                else:
                    raise RemoteEngineError(self.url, f"{what} failed: HTTP {response.status_code}: {message}")
            if attempt < self.max_attempts:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise ServerUnavailableError(self.url, what, self.max_attempts, last_error)

    async def _rollout(self, body: dict) -> list:
        response = await self._send("POST", wire.ROLLOUTS_PATH, json=body)
        try:
            return wire.decode_outputs(response.content)
        except (ValueError, KeyError) as exc:
            raise RemoteEngineError(self.url, f"its rollout answer could not be decoded: {exc}") from exc

    async def _get_json(self, path: str, admin: bool = False) -> dict:
        headers = self._admin_headers() if admin else None
        return (await self._send("GET", path, headers=headers)).json()

    def _admin_headers(self) -> dict:
        if not self.admin_token:
            raise ValueError(
                f"weight updates on {self.url} need the server's admin token; pass admin_token= or set {ADMIN_TOKEN_ENV}"
            )
        return {"Authorization": f"Bearer {self.admin_token}"}

    async def _load_weights(self, body: bytes, version: int, kind: str) -> dict:
        headers = {**self._admin_headers(), "Content-Type": wire.WEIGHTS_MEDIA_TYPE}
        query = {"kind": kind, "version": version, "sha256": wire.file_sha256(body)}
        return (await self._send("POST", wire.WEIGHTS_PATH, params=query, content=body, headers=headers)).json()

    def _call(self, coroutine):
        """Run `coroutine` on the client's loop and wait for it (from any thread but that loop's)."""
        if self._is_closed:
            coroutine.close()
            self._refuse_if_closed()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


def _stats_since(current: dict, base: dict | None) -> dict:
    """The engine's counters since `base` (a /v1/stats answer), with the rates recomputed."""
    stats = dict(current)
    if base is not None:
        for name in _COUNTERS:
            stats[name] = current.get(name, 0) - base.get(name, 0)
        hist, base_hist = current.get("rows_per_forward_hist", {}), base.get("rows_per_forward_hist", {})
        stats["rows_per_forward_hist"] = {
            k: v - base_hist.get(k, 0) for k, v in hist.items() if v != base_hist.get(k, 0)
        }
    stats["mean_rows_per_forward"] = stats["num_rows"] / stats["num_forwards"] if stats["num_forwards"] else 0.0
    busy = stats.get("busy_seconds", 0.0)
    stats["images_per_second"] = stats["num_samples_finished"] / busy if busy > 0 else 0.0
    return stats


def _fan_out(url: str, request: Future, futures: list[Future], closed_error) -> None:
    """Resolve one future per sample from the request's future; cancelling every sample's future
    cancels the request. A request cancelled by the client's close() fails with `closed_error()`."""

    def resolved(done: Future) -> None:
        error = None
        if done.cancelled():
            error = closed_error()
            if error is None:
                for f in futures:
                    f.cancel()
                return
        else:
            error = done.exception()
        outputs = None if error is not None else done.result()
        if error is None and len(outputs) != len(futures):
            error = RemoteEngineError(url, f"answered {len(outputs)} samples for {len(futures)} requested")
        for j, f in enumerate(futures):
            settle(f, None if error is not None else outputs[j], error)

    def sample_cancelled(_: Future) -> None:
        if all(f.cancelled() for f in futures):
            request.cancel()

    request.add_done_callback(resolved)
    for f in futures:
        f.add_done_callback(sample_cancelled)


def _error_message(response: httpx.Response) -> str:
    """The server's error text: its JSON "detail"/"error"/"message", else the body's start."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict) and "message" in error:  # OpenAI's error shape
            return str(error["message"])
        return str(error)[:500]
    return str(body)[:500]

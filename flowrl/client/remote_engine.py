"""RemoteEngine: the rollout engine's API over HTTP, for a `flowrl serve` server.

`RemoteEngine(url)` has the methods of `flowrl.engine.DiffusionEngine` that callers use:
`generate`, `generate_batched`, their async twins, `submit` / `submit_many` / `submit_batched`
(returning `concurrent.futures.Future`s, as the agent loop and the balancer use them) and
`stats()`, so `AgentLoop` drives local engines and remote servers alike. The outputs are the
server's `DiffusionOutput`s, decoded from the wire format of `flowrl.server.wire` (JSON plus
safetensors / PNG payloads, never pickle): the same tensors the server's engine produced.

Each request is one HTTP call on a background event loop (one thread per client, an
`httpx.AsyncClient` with pooled connections), so hundreds of requests can be in flight at once and
the server batches them into shared forwards. Connection failures and 502/503/504 answers are
retried `max_attempts` times with exponential backoff, then raise `ServerUnavailableError`
naming the server (a balancer then re-sends the request to another replica); a 4xx raises
`RemoteRequestError` (a ValueError) with the server's message, at once. A request that takes longer
than `timeout_s` counts as the server being unavailable. Cancelling every future of a request (or
the coroutine of an async call) closes its connection, which cancels it on the server.

Weight updates (`load_weights`, `wait_for_version`) need the server's admin token: `admin_token`,
or the FLOWRL_ADMIN_TOKEN environment variable.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future

import httpx

from flowrl.client import wire_io
from flowrl.client.errors import RemoteEngineError, RemoteRequestError, ServerUnavailableError
from flowrl.sampling_params import SamplingParams

ADMIN_TOKEN_ENV = "FLOWRL_ADMIN_TOKEN"
RETRYABLE_STATUS = frozenset({502, 503, 504})
_RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)


class RemoteEngine:
    """A `flowrl serve` server behind the engine's API (see the module docstring)."""

    supports_batched_generation = True

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

    # --- the engine's API ----------------------------------------------------------------------------
    def generate(self, prompt: str | list[str], sampling_params: SamplingParams | None = None):
        """One sample for a prompt, or one per prompt for a list (sample i uses seed + i)."""
        if isinstance(prompt, list):
            return _wait(self.submit_many(prompt, sampling_params))
        return _wait([self.submit(prompt, sampling_params)])[0]

    def generate_batched(self, prompt: str, num_outputs_per_prompt: int, sampling_params: SamplingParams | None = None):
        """N samples of one prompt (sample j uses seed + j), from one request."""
        return _wait(self.submit_batched(prompt, num_outputs_per_prompt, sampling_params))

    async def generate_async(self, prompt: str, sampling_params: SamplingParams | None = None):
        return (await self.generate_batched_async(prompt, 1, sampling_params))[0]

    async def generate_batched_async(
        self, prompt: str, num_outputs_per_prompt: int, sampling_params: SamplingParams | None = None
    ):
        futures = self.submit_batched(prompt, num_outputs_per_prompt, sampling_params)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def submit(self, prompt: str, sampling_params: SamplingParams | None = None) -> Future:
        return self.submit_batched(prompt, 1, sampling_params)[0]

    def submit_many(self, prompts: list[str], sampling_params: SamplingParams | None = None) -> list[Future]:
        """One sample per prompt, sample i with seed + i (the engine's rule), one request each."""
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings")
        params = _checked(prompts[0], 1, sampling_params)
        if params.seed is None:
            return [f for p in prompts for f in self.submit_batched(p, 1, params)]
        return [
            f for i, p in enumerate(prompts) for f in self.submit_batched(p, 1, params.replace(seed=params.seed + i))
        ]

    def submit_batched(
        self, prompt: str, num_outputs_per_prompt: int, sampling_params: SamplingParams | None = None
    ) -> list[Future]:
        """Send one rollout request for N samples of `prompt`; one future per sample."""
        params = _checked(prompt, num_outputs_per_prompt, sampling_params)
        if self._is_closed:
            raise RuntimeError(f"RemoteEngine({self.url}) is closed; create a new one")
        body = wire_io.rollout_request(prompt, num_outputs_per_prompt, params)
        request = asyncio.run_coroutine_threadsafe(self._rollout(body), self._loop)
        futures = [Future() for _ in range(num_outputs_per_prompt)]
        _fan_out(self.url, request, futures)
        return futures

    def stats(self) -> dict:
        """The server engine's batching counters since the last `reset_stats()` (the engine's keys:
        num_forwards, num_rows, num_samples_finished, mean_rows_per_forward, images_per_second,
        policy_version, ...)."""
        current = self._call(self._get_json("/v1/stats", "GET /v1/stats"))
        return wire_io.stats_since(current, self._stats_base)

    def reset_stats(self) -> None:
        self._stats_base = self._call(self._get_json("/v1/stats", "GET /v1/stats"))

    def health(self) -> dict:
        """The server's /health answer (status, model, policy version)."""
        return self._call(self._get_json("/health", "GET /health"))

    # --- weights (admin) ---------------------------------------------------------------------------
    def load_weights(self, payload: bytes, version: int, checksum: str, kind: str) -> dict:
        """Upload weights (a safetensors file's bytes, `kind` "lora" or "full") as policy `version`;
        the server verifies them against `checksum` before they go live. Returns its answer."""
        return self._call(self._load_weights(payload, version, checksum, kind))

    def weights_info(self) -> dict:
        """The live weights: {"policy_version", "checksum", ...} as the server reports them."""
        return self._call(self._get_json(wire_io.WEIGHTS_PATH, f"GET {wire_io.WEIGHTS_PATH}", admin=True))

    def wait_for_version(self, version: int, timeout_s: float = 300.0, poll_s: float = 0.05) -> dict:
        """Block until the server serves policy `version` (or raise ServerUnavailableError)."""
        return self._call(self._wait_for_version(version, timeout_s, poll_s))

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connections and stop the client's thread (requests in flight fail)."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(timeout=10)
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
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        return self._client

    async def _send(self, method: str, path: str, what: str, **kwargs) -> httpx.Response:
        """One call with bounded retries; ServerUnavailableError / RemoteRequestError / RemoteEngineError."""
        last_error = ""
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
        response = await self._send("POST", wire_io.ROLLOUTS_PATH, f"POST {wire_io.ROLLOUTS_PATH}", json=body)
        try:
            return wire_io.decode_rollout_response(response)
        except (ValueError, KeyError) as exc:
            raise RemoteEngineError(self.url, f"its rollout answer could not be decoded: {exc}") from exc

    async def _get_json(self, path: str, what: str, admin: bool = False) -> dict:
        headers = self._admin_headers() if admin else None
        return (await self._send("GET", path, what, headers=headers)).json()

    def _admin_headers(self) -> dict:
        if not self.admin_token:
            raise ValueError(
                f"weight updates on {self.url} need the server's admin token; pass admin_token= or set {ADMIN_TOKEN_ENV}"
            )
        return {"Authorization": f"Bearer {self.admin_token}"}

    async def _load_weights(self, payload: bytes, version: int, checksum: str, kind: str) -> dict:
        request = wire_io.weights_request(payload, version, checksum, kind)
        response = await self._send(
            "POST",
            wire_io.LOAD_WEIGHTS_PATH,
            f"POST {wire_io.LOAD_WEIGHTS_PATH}",
            headers=self._admin_headers(),
            **request,
        )
        return response.json()

    async def _wait_for_version(self, version: int, timeout_s: float, poll_s: float) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            info = await self._get_json(wire_io.WEIGHTS_PATH, f"GET {wire_io.WEIGHTS_PATH}", admin=True)
            if int(info["policy_version"]) == version:
                return info
            if loop.time() > deadline:
                raise ServerUnavailableError(
                    self.url, f"waiting for policy version {version}", 1, f"still serving {info['policy_version']}"
                )
            await asyncio.sleep(poll_s)

    def _call(self, coroutine):
        """Run `coroutine` on the client's loop and wait for it (from any thread but that loop's)."""
        if self._is_closed:
            coroutine.close()
            raise RuntimeError(f"RemoteEngine({self.url}) is closed; create a new one")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


def _checked(prompt, num_outputs_per_prompt, sampling_params: SamplingParams | None) -> SamplingParams:
    """The checks the engine makes in the caller that need no model (the server makes the rest)."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt={prompt!r} must be a string")
    if (
        isinstance(num_outputs_per_prompt, bool)
        or not isinstance(num_outputs_per_prompt, int)
        or num_outputs_per_prompt < 1
    ):
        raise ValueError(
            f"num_outputs_per_prompt={num_outputs_per_prompt!r} must be an integer >= 1 "
            "(the number of samples to generate for this prompt)"
        )
    params = sampling_params if sampling_params is not None else SamplingParams()
    return params.validate()


def _fan_out(url: str, request: Future, futures: list[Future]) -> None:
    """Resolve one future per sample from the request's future; cancelling every sample's future
    cancels the request."""

    def resolved(done: Future) -> None:
        if done.cancelled():
            for f in futures:
                f.cancel()
            return
        error = done.exception()
        outputs = None if error is not None else done.result()
        if error is None and len(outputs) != len(futures):
            error = RemoteEngineError(url, f"answered {len(outputs)} samples for {len(futures)} requested")
        for j, f in enumerate(futures):
            if f.done():
                continue
            if error is not None:
                f.set_exception(error)
            else:
                f.set_result(outputs[j])

    def sample_cancelled(_: Future) -> None:
        if all(f.cancelled() for f in futures):
            request.cancel()

    request.add_done_callback(resolved)
    for f in futures:
        f.add_done_callback(sample_cancelled)


def _wait(futures: list[Future]) -> list:
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


def _error_message(response: httpx.Response) -> str:
    """The server's error text: its JSON "detail"/"error"/"message", else the body's start."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if key in body:
                value = body[key]
                return value if isinstance(value, str) else str(value)
    return str(body)[:500]

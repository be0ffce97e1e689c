"""The rollout service of `flowrl serve`: one DiffusionEngine behind HTTP (docs/serving.md).

Endpoints (paths in flowrl.server.wire): POST /v1/images/generations (the OpenAI Images API),
POST /v1/rollouts (every sample's DiffusionOutput, wire format), GET /v1/models, GET /health,
GET /v1/stats (engine.stats()), GET /metrics (Prometheus), and, with an admin token,
GET|POST /v1/weights and POST /v1/admin/pause|resume.

A generation request goes: parse (flowrl.server.generation_request: shape and HTTP limits) ->
admission (flowrl.server.admission: capacity, pause, weight swaps) -> engine.submit_batched (one
prompt) or engine.submit_many (several, queued together) (SamplingParams.validate: the engine's
ValueError becomes a 400 naming the field) -> await
the futures -> encode in a worker thread. If the client disconnects first, the request's futures
are cancelled, so its samples leave the engine at the next step. Errors use OpenAI's shape
{"error": {"message", "type", "param", "code"}}; a refused request changes nothing.

The engine runs in this process; the app holds no model code beyond calling the engine and
flowrl.server.weights.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from flowrl.engine.api import EngineClosedError
from flowrl.engine.output import DiffusionOutput
from flowrl.sampling_params import SamplingParams
from flowrl.server import wire
from flowrl.server.admission import Admission
from flowrl.server.generation_request import (
    GenerationRequest,
    ServingLimits,
    field_of,
    parse_images_request,
    parse_rollouts_request,
    parse_videos_request,
)
from flowrl.server.http import drain, has_bearer_token, read_body
from flowrl.server.metrics import CLIENT_CLOSED, RequestMetrics, ServerMetrics
from flowrl.server.score_request import BadRequest
from flowrl.server.weights import apply_update, live_weights, parse_update_query, prepare_update

_ENDPOINTS = {
    wire.HEALTH_PATH,
    wire.METRICS_PATH,
    wire.STATS_PATH,
    wire.MODELS_PATH,
    wire.IMAGES_PATH,
    wire.ROLLOUTS_PATH,
    wire.WEIGHTS_PATH,
    wire.PAUSE_PATH,
    wire.RESUME_PATH,
}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class GenerationFailed(Exception):
    """The engine failed a request's samples (500), or no longer serves (503)."""

    def __init__(self, message: str, status_code: int = 500):
        super().__init__(message)
        self.status_code = status_code


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work):
    """Run the coroutine `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its samples are cancelled before we answer
    if task.cancelled():
        raise ClientGone()
    return task.result()


@dataclass
class ServedDefaults:
    """Settings a request leaves out: `rollouts` for /v1/rollouts, `images` for the Images API."""

    rollouts: SamplingParams
    images: SamplingParams


class RolloutService:
    """The state behind the endpoints: engine, admission, metrics, admin token."""

    def __init__(self, engine, model_name: str, defaults: ServedDefaults, limits: ServingLimits, admin_token):
        self.engine, self.model_name, self.defaults, self.limits = engine, model_name, defaults, limits
        self.admin_token = admin_token
        self.admission = Admission(limits.max_queued_samples)
        self.metrics = ServerMetrics(engine, self.admission, _ENDPOINTS)
        self.created = int(time.time())
        self.is_stopping = False  # set by the CLI on shutdown: engine failures then answer 503
        self._update_lock = asyncio.Lock()

    # --- generation ----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> list[DiffusionOutput]:
        """All samples of the request (seeds as GenerationRequest says); BadRequest or GenerationFailed."""
        n, params = request.num_outputs_per_prompt, request.params
        if params.seed is None and len(request.prompts) > 1:  # one base seed, so the seeds are consecutive
            params = params.replace(seed=secrets.randbits(62))
        async with self.admission.admit(request.num_samples):
            futures = []
            try:
                if len(request.prompts) > 1:  # queued at once: the engine groups them the same way every time
                    futures = self._submit(self.engine.submit_many, request.prompts, params, n)
                else:
                    futures = self._submit(self.engine.submit_batched, request.prompts[0], n, params)
                return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
            except BaseException as error:
                for future in futures:
                    future.cancel()
                if isinstance(error, (BadRequest, GenerationFailed, asyncio.CancelledError)):
                    raise
                if self.is_stopping:
                    raise GenerationFailed(f"the server is shutting down ({error})", 503) from None
                if isinstance(error, EngineClosedError):  # its thread died: a replica down, not a bad request
                    raise GenerationFailed(f"the engine is not serving: {error}", 503) from None
                raise GenerationFailed(f"generation failed: {type(error).__name__}: {error}") from None

    @staticmethod
    def _submit(submit, *args) -> list:
        """`submit(*args)` of the engine: its refusals as BadRequest, a closed engine as GenerationFailed."""
        try:
            return submit(*args)
        except ValueError as error:  # SamplingParams.validate and the engine's own request checks
            raise BadRequest(str(error), param=field_of(error)) from None
        except EngineClosedError as error:  # the engine no longer serves (shut down, or its thread died)
            raise GenerationFailed(f"the engine is not serving: {error}", 503) from None

    # --- admin -----------------------------------------------------------------------------------
    async def check_admin(self, request: Request) -> None:
        """BadRequest(403) without an admin token configured, (401) for a wrong or missing one."""
        if not self.admin_token:
            raise BadRequest(
                f"weight updates and admission control are off: start the server with --admin-token or "
                f"{wire.ADMIN_TOKEN_ENV} to turn them on",
                403,
            )
        if not has_bearer_token(request, self.admin_token):
            raise BadRequest(
                f"missing or wrong admin token: send 'Authorization: Bearer TOKEN' with the server's "
                f"--admin-token ({wire.ADMIN_TOKEN_ENV})",
                401,
            )

    async def update_weights(self, request: Request) -> dict:
        """POST /v1/weights: check everything, then swap with no sample in flight (module docstring)."""
        kind, version, sha256 = parse_update_query(request.query_params)
        fix = "raise --max-weights-mb, or push a LoRA instead of full weights"
        body = await read_body(request, self.limits.max_weights_bytes, fix)
        transformer, compiled = self.engine.adapter.transformer, bool(self.engine.compiled_modules)
        async with self._update_lock:
            component = self.engine.adapter.trained_component
            update = await run_in_threadpool(
                prepare_update, body, kind, version, sha256, transformer, compiled, component
            )
            del body
            start = time.perf_counter()
            async with self.admission.exclusive():
                # Samples cancelled by their clients may still be leaving the engine: wait for them too.
                await run_in_threadpool(self.engine.wait_until_idle)
                await run_in_threadpool(apply_update, update, transformer)
                self.engine.set_policy_version(version)
            paused_s = time.perf_counter() - start
        return {**await self.weights_info(), "sha256": sha256, "seconds_paused": paused_s}

    async def weights_info(self) -> dict:
        kind, live = live_weights(self.engine.adapter.transformer)
        checksum = await run_in_threadpool(wire.weights_sha256, live)
        return {
            "policy_version": self.engine.policy_version,
            "kind": kind,
            "weights_sha256": checksum,
            "num_tensors": len(live),
        }

    def admission_info(self) -> dict:
        return {"paused": self.admission.is_paused, "samples_in_flight": self.admission.num_in_flight}


def _png_base64(output: DiffusionOutput) -> str:
    """The sample as a PNG; a video as its frame strip (POST /v1/videos/generations gives mp4)."""
    from flowrl.data.video_files import frame_strip
    from flowrl.rewards.http_client import encode_png_base64

    image = output.image.numpy()
    return encode_png_base64(frame_strip(image) if image.ndim == 4 else image)


def _mp4_base64(output: DiffusionOutput, fps: int) -> str:
    from flowrl.data.video_files import encode_mp4

    frames = output.image if output.image.dim() == 4 else output.image[None]
    return base64.b64encode(encode_mp4(frames, fps)).decode("ascii")


def create_rollout_app(
    engine,
    model_name: str,
    defaults: ServedDefaults | None = None,
    limits: ServingLimits | None = None,
    admin_token: str | None = None,
) -> FastAPI:
    """A FastAPI app serving `engine` (module docstring); its RolloutService is `app.state.service`."""
    defaults = defaults or ServedDefaults(SamplingParams(), SamplingParams(noise_level=0.0, logprobs=False))
    service = RolloutService(engine, model_name, defaults, limits or ServingLimits(), admin_token)
    app = FastAPI(title="flowrl rollout service")
    app.state.service = service
    app.add_middleware(RequestMetrics, metrics=service.metrics)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return error_response(str(error), error.status_code, error.param)

    @app.exception_handler(GenerationFailed)
    async def generation_failed(request: Request, error: GenerationFailed):
        return error_response(str(error), error.status_code)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # unknown paths and methods
        return error_response(str(error.detail), error.status_code)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone):
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; recorded in the metrics

    async def generation_body(request: Request) -> bytes:
        fix = "raise --max-body-mb, or send fewer prompts per request"
        return await read_body(request, service.limits.max_body_bytes, fix)

    @app.get(wire.HEALTH_PATH)
    async def health():
        return {
            "status": "paused" if service.admission.is_paused else "ok",
            "model": model_name,
            "policy_version": engine.policy_version,
            "samples_in_flight": service.admission.num_in_flight,
            "max_batch_rows": engine.max_batch_rows,
            "size_multiple": engine.adapter.size_multiple,
        }

    @app.get(wire.MODELS_PATH)
    async def models():
        entry = {"id": model_name, "object": "model", "created": service.created, "owned_by": "flowrl"}
        return {"object": "list", "data": [entry]}

    @app.get(wire.STATS_PATH)
    async def stats():
        return engine.stats()

    @app.get(wire.METRICS_PATH)
    async def metrics():
        content, media_type = service.metrics.render()
        return Response(content, media_type=media_type)

    @app.post(wire.IMAGES_PATH)
    async def images(request: Request):
        parsed = parse_images_request(await generation_body(request), defaults.images, service.limits, model_name)

        async def work():
            outputs = await service.generate(parsed)
            return await run_in_threadpool(lambda: [{"b64_json": _png_base64(o)} for o in outputs])

        data = await _unless_disconnected(request, work())
        size = f"{parsed.params.width}x{parsed.params.height}"
        return {"created": int(time.time()), "data": data, "output_format": "png", "size": size}

    @app.post(wire.VIDEOS_PATH)
    async def videos(request: Request):
        parsed, fps = parse_videos_request(await generation_body(request), defaults.images, service.limits, model_name)

        async def work():
            outputs = await service.generate(parsed)
            return await run_in_threadpool(lambda: [{"b64_json": _mp4_base64(o, fps)} for o in outputs])

        data = await _unless_disconnected(request, work())
        size = f"{parsed.params.width}x{parsed.params.height}"
        frames = parsed.params.num_frames
        return {"created": int(time.time()), "data": data, "output_format": "mp4", "size": size, "num_frames": frames}

    @app.post(wire.ROLLOUTS_PATH)
    async def rollouts(request: Request):
        parsed = parse_rollouts_request(await generation_body(request), defaults.rollouts, service.limits)

        async def work():
            outputs = await service.generate(parsed)
            return await run_in_threadpool(wire.encode_outputs, outputs)

        body = await _unless_disconnected(request, work())
        return Response(body, media_type=wire.ROLLOUTS_MEDIA_TYPE)

    @app.get(wire.WEIGHTS_PATH)
    async def weights(request: Request):
        await service.check_admin(request)
        return await service.weights_info()

    @app.post(wire.WEIGHTS_PATH)
    async def push_weights(request: Request):
        try:
            await service.check_admin(request)
            return await service.update_weights(request)
        except BadRequest:
            await drain(request)  # a client still sending its body reads the answer instead of a broken pipe
            raise

    @app.post(wire.PAUSE_PATH)
    async def pause(request: Request):
        await service.check_admin(request)
        service.admission.pause()
        return service.admission_info()

    @app.post(wire.RESUME_PATH)
    async def resume(request: Request):
        await service.check_admin(request)
        service.admission.resume()
        return service.admission_info()

    return app

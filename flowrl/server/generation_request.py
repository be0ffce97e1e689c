"""Parsing the generation requests of `flowrl serve` (the OpenAI Images API and /v1/rollouts).

`parse_rollouts_request` and `parse_images_request` turn a JSON body into a `GenerationRequest`
(prompts, samples per prompt, SamplingParams), or raise BadRequest naming the field. They check
only the request's shape and the HTTP-level limits (`ServingLimits`: body size, samples per
request); every sampling setting's own rules are `SamplingParams.validate`'s, which the engine
runs when the request is submitted. Nothing is silently ignored: an unknown field is a 400.

It knows the JSON shapes (and flowrl.server.wire's SamplingParams form), nothing about engines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from flowrl.sampling_params import SamplingParams
from flowrl.server import wire
from flowrl.server.score_request import BadRequest, load_json


@dataclass(frozen=True)
class ServingLimits:
    """HTTP-level bounds of `flowrl serve` (each violation is a 4xx naming the flag).

    max_body_bytes: largest body of a generation request. max_samples_per_request: most images of
    one request (`n`, or prompts x num_outputs_per_prompt). max_queued_samples: most samples
    accepted and not finished (past it: 503). max_weights_bytes: largest weight-update body.
    """

    max_body_bytes: int = 4 * 2**20
    max_samples_per_request: int = 256
    max_queued_samples: int = 8192
    max_weights_bytes: int = 16 * 2**30

    def __post_init__(self):
        for name in ("max_body_bytes", "max_samples_per_request", "max_queued_samples", "max_weights_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServingLimits.{name}={value!r} must be an integer >= 1")


@dataclass
class GenerationRequest:
    """`num_outputs_per_prompt` samples of each prompt; prompt i, sample j gets seed
    `params.seed + i * num_outputs_per_prompt + j` (docs/serving.md)."""

    prompts: list[str]
    num_outputs_per_prompt: int
    params: SamplingParams

    @property
    def num_samples(self) -> int:
        return len(self.prompts) * self.num_outputs_per_prompt


def _object(body: bytes, fields: str) -> dict:
    payload = load_json(body, "the request body", fields)
    if not isinstance(payload, dict):
        raise BadRequest(f"the request body must be a JSON object ({fields}), got {type(payload).__name__}")
    return payload


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value, field: str, limits: ServingLimits, per: int = 1) -> int:
    """A positive sample count whose total (times `per`) is within max_samples_per_request."""
    if not _is_int(value) or value < 1:
        raise BadRequest(f"{field}={value!r} must be an integer >= 1", param=field)
    limit = limits.max_samples_per_request
    if value * per > limit:
        total = f"{per} prompts x {field}={value} = {value * per} images" if per > 1 else f"{field}={value}"
        raise BadRequest(
            f"{total} is over this server's limit of {limit} images per request (--max-samples-per-request); "
            "split the request",
            413,
            param=field,
        )
    return value


def _check_unknown(payload: dict, known: set[str], what: str) -> None:
    unknown = sorted(set(payload) - known)
    if unknown:
        raise BadRequest(
            f"{what} field {unknown[0]!r} is not supported by flowrl serve; remove it (supported: {sorted(known)})",
            param=unknown[0],
        )


_ROLLOUT_FIELDS = {"prompt", "num_outputs_per_prompt", "sampling_params"}


def parse_rollouts_request(body: bytes, defaults: SamplingParams, limits: ServingLimits) -> GenerationRequest:
    """POST /v1/rollouts: {"prompt": str | [str], "num_outputs_per_prompt": int, "sampling_params": {...}};
    fields missing from sampling_params come from `defaults`."""
    payload = _object(body, "prompt, num_outputs_per_prompt, sampling_params")
    _check_unknown(payload, _ROLLOUT_FIELDS, "rollouts request")
    prompt = payload.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(f"prompt={_short(prompt)} must be a string or a non-empty list of strings", param="prompt")
    n = payload.get("num_outputs_per_prompt", 1)
    n = _count(n, "num_outputs_per_prompt", limits, per=len(prompts))
    try:
        params = wire.params_from_json(payload.get("sampling_params", {}), base=defaults)
    except ValueError as error:
        raise BadRequest(str(error), param="sampling_params") from None
    return GenerationRequest(prompts, n, params)


# The OpenAI Images API fields this server takes, and its documented extensions.
_OPENAI_FIELDS = {"model", "prompt", "n", "size", "response_format", "output_format", "user"}
IMAGES_EXTENSIONS = ("seed", "num_inference_steps", "guidance_scale", "negative_prompt")
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")


def parse_images_request(
    body: bytes, defaults: SamplingParams, limits: ServingLimits, model_name: str
) -> GenerationRequest:
    """POST /v1/images/generations as OpenAI's clients send it (docs/serving.md); JSON null means
    the field's default, as OpenAI reads it."""
    payload = _object(body, "prompt, n, size, ...")
    _check_unknown(payload, _OPENAI_FIELDS | set(IMAGES_EXTENSIONS), "images request")
    payload = {key: value for key, value in payload.items() if value is not None}
    model = payload.get("model", model_name)
    if model != model_name:
        raise BadRequest(
            f"model={_short(model)} is not served here; this server serves {model_name!r} (GET /v1/models)",
            404,
            param="model",
        )
    prompt = payload.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest(f"prompt={_short(prompt)} must be a non-empty string", param="prompt")
    n = _count(payload.get("n", 1), "n", limits)
    if payload.get("response_format", "b64_json") != "b64_json":
        raise BadRequest(
            f"response_format={_short(payload['response_format'])} is not supported; use 'b64_json' "
            "(the server keeps no files to link to)",
            param="response_format",
        )
    if payload.get("output_format", "png") != "png":
        raise BadRequest(
            f"output_format={_short(payload['output_format'])} is not supported; use 'png'", param="output_format"
        )
    if not isinstance(payload.get("user", ""), str):
        raise BadRequest(f"user={_short(payload['user'])} must be a string", param="user")
    changes = {name: payload[name] for name in IMAGES_EXTENSIONS if name in payload}
    size = payload.get("size", "auto")
    if size != "auto":
        match = _SIZE.fullmatch(size) if isinstance(size, str) else None
        if match is None:
            raise BadRequest(f"size={_short(size)} must be 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto'", param="size")
        changes["width"], changes["height"] = int(match.group(1)), int(match.group(2))
    return GenerationRequest([prompt], n, defaults.replace(**changes, logprobs=False))


VIDEOS_EXTENSIONS = ("num_frames", "fps")


def parse_videos_request(
    body: bytes, defaults: SamplingParams, limits: ServingLimits, model_name: str
) -> tuple[GenerationRequest, int]:
    """POST /v1/videos/generations: an images request (its fields and rules) plus num_frames and
    fps, answered with mp4 (output_format 'mp4'). Returns the request and the frame rate."""
    payload = _object(body, "prompt, n, size, num_frames, ...")
    if payload.get("output_format", "mp4") not in ("mp4", None):
        raise BadRequest(
            f"output_format={_short(payload['output_format'])} is not supported; use 'mp4'", param="output_format"
        )
    fps = payload.get("fps") if payload.get("fps") is not None else 16
    if isinstance(fps, bool) or not isinstance(fps, int) or not 1 <= fps <= 120:
        raise BadRequest(f"fps={_short(fps)} must be an integer in [1, 120]", param="fps")
    num_frames = payload.get("num_frames")
    rest = {k: v for k, v in payload.items() if k not in (*VIDEOS_EXTENSIONS, "output_format")}
    request = parse_images_request(json.dumps(rest).encode(), defaults, limits, model_name)
    if num_frames is not None:
        request.params = request.params.replace(num_frames=num_frames)
    return request, fps


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


def field_of(error: ValueError) -> str | None:
    """The SamplingParams field an engine validation error names (the error's `param`)."""
    match = _FIELD_IN_MESSAGE.search(str(error))
    return match.group(1) if match else None

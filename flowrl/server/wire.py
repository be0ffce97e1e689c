"""The rollout server's wire format, shared by the server (flowrl.server.rollout_app) and its clients
(flowrl.client). Never pickle: requests are JSON, outputs and weights are safetensors files.

Requests (JSON):
- `params_to_json(params)` / `params_from_json(obj)`: SamplingParams as a JSON object of its
  fields by name, pairs (`sde_window`, `sde_window_range`) as 2-lists. Unknown fields raise
  ValueError naming them; values are not checked here: `SamplingParams.validate`, which the engine
  runs before anything is queued, is the one home of every rule.
- `rollout_request(prompt, num_outputs_per_prompt, params)`: the body of POST /v1/rollouts.

Outputs (`ROLLOUTS_MEDIA_TYPE`): `encode_outputs(outputs) -> bytes` / `decode_outputs(body)`.
The body is one safetensors file:
- tensors named "t0", "t1", ...; a tensor several samples share (the prompt embeddings of the
  samples of one prompt) is stored once;
- `__metadata__["flowrl.format"] = "rollouts/1"` and `__metadata__["flowrl.outputs"]`: a JSON
  list, one object per sample with every DiffusionOutput field: a tensor field holds the name of
  its tensor (or null), the others their JSON value (`transition_spec` an object, `sde_window` a
  2-list). Decoding gives DiffusionOutputs equal to the server's, bit for bit.

Weights (`WEIGHTS_MEDIA_TYPE`): `encode_weights(state, lora=None) -> bytes`: a safetensors file of
transformer parameter name -> tensor, names as `transformer.named_parameters()` gives them (a LoRA:
`....lora_A.default.weight`, what flowrl.models.lora.trainable_state_dict returns; full weights:
every parameter), with `__metadata__["flowrl.lora"]` = the LoRA settings as JSON ({rank, alpha,
target_modules, dropout}) for a LoRA, and `__metadata__["flowrl.component"]` = the checkpoint's
module they belong to (`transformer`; `transformer_2` for Wan2.2-A14B's low expert: a server
refuses weights of another module than the one it trains-in, absent meaning `transformer`).
`file_sha256(body)` is the checksum sent along (what `sha256sum FILE` prints);
`weights_sha256(state)` a checksum of the tensors themselves (names, dtypes, shapes, bytes),
which the server reports for its live weights.

Stats: `stats_from_json(obj)` gives back engine.stats() from its JSON (integer histogram keys).

It knows the DiffusionOutput and SamplingParams contracts, nothing about HTTP or engines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence

import torch

from flowrl.engine.output import DiffusionOutput, TransitionSpec
from flowrl.sampling_params import SamplingParams

ROLLOUTS_MEDIA_TYPE = "application/vnd.flowrl.rollouts+safetensors"
WEIGHTS_MEDIA_TYPE = "application/vnd.flowrl.weights+safetensors"
ROLLOUTS_FORMAT = "rollouts/1"
ADMIN_TOKEN_ENV = "FLOWRL_ADMIN_TOKEN"  # the admin bearer token, read by `flowrl serve` and clients

# Endpoints of `flowrl serve` (docs/serving.md describes each).
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
STATS_PATH = "/v1/stats"
MODELS_PATH = "/v1/models"
IMAGES_PATH = "/v1/images/generations"
VIDEOS_PATH = "/v1/videos/generations"
ROLLOUTS_PATH = "/v1/rollouts"
WEIGHTS_PATH = "/v1/weights"
PAUSE_PATH = "/v1/admin/pause"
RESUME_PATH = "/v1/admin/resume"

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_PAIR_FIELDS = ("sde_window", "sde_window_range")
_OUTPUT_FIELDS = [f.name for f in dataclasses.fields(DiffusionOutput)]
_TENSOR_FIELDS = {f.name for f in dataclasses.fields(DiffusionOutput) if "Tensor" in str(f.type)}


# --- requests --------------------------------------------------------------------------------------


def params_to_json(params: SamplingParams) -> dict:
    return {
        name: list(value) if isinstance(value, tuple) else value for name, value in dataclasses.asdict(params).items()
    }


def params_from_json(obj, where: str = "sampling_params", base: SamplingParams | None = None) -> SamplingParams:
    """`base` (default SamplingParams()) with the fields `obj` names; ValueError for anything but a
    JSON object of known field names."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be a JSON object of SamplingParams fields, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _PARAM_FIELDS)
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}; known fields: {sorted(_PARAM_FIELDS)}")
    changes = {name: tuple(v) if name in _PAIR_FIELDS and isinstance(v, list) else v for name, v in obj.items()}
    return (base or SamplingParams()).replace(**changes)


def rollout_request(prompt: str | Sequence[str], num_outputs_per_prompt: int, params: SamplingParams) -> dict:
    """The JSON body of POST /v1/rollouts: prompt i, sample j gets seed `params.seed + i * n + j`."""
    return {
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "num_outputs_per_prompt": num_outputs_per_prompt,
        "sampling_params": params_to_json(params),
    }


# --- outputs ---------------------------------------------------------------------------------------


def _header(body: bytes, what: str) -> dict:
    """The JSON header of a safetensors file (8 bytes little-endian length, then the JSON)."""
    if len(body) < 8:
        raise ValueError(f"{what} is not a safetensors file ({len(body)} bytes)")
    size = int.from_bytes(body[:8], "little")
    if size > len(body) - 8:
        raise ValueError(f"{what} is not a safetensors file (its header length {size} passes the end)")
    try:
        header = json.loads(body[8 : 8 + size])
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{what} is not a safetensors file (header: {error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{what} is not a safetensors file (its header is not a JSON object)")
    return header


def read_metadata(body: bytes, what: str = "the body") -> dict[str, str]:
    """`__metadata__` of a safetensors file held in memory."""
    metadata = _header(body, what).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{what}: safetensors __metadata__ is not a JSON object")
    return metadata


def load_tensors(body: bytes, what: str = "the body") -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    _header(body, what)
    try:
        return load(body)
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{what} is not a readable safetensors file ({type(error).__name__}: {error})") from None


def _json_value(name: str, value):
    if name == "transition_spec":
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def encode_outputs(outputs: Sequence[DiffusionOutput]) -> bytes:
    """DiffusionOutputs -> one safetensors file (module docstring)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    names: dict[tuple, str] = {}  # (data_ptr, shape, stride, dtype) -> tensor name: each tensor once
    pointers: set[int] = set()
    samples = []
    for output in outputs:
        sample = {}
        for name in _OUTPUT_FIELDS:
            value = getattr(output, name)
            if not isinstance(value, torch.Tensor):
                sample[name] = _json_value(name, value)
                continue
            key = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype, value.device)
            if key not in names:
                tensor = value.detach().to("cpu").contiguous()
                if tensor.data_ptr() in pointers:  # another view of a stored tensor: safetensors stores each once
                    tensor = tensor.clone()
                pointers.add(tensor.data_ptr())
                names[key] = f"t{len(tensors)}"
                tensors[names[key]] = tensor
            sample[name] = names[key]
        samples.append(sample)
    metadata = {"flowrl.format": ROLLOUTS_FORMAT, "flowrl.outputs": json.dumps(samples)}
    return save(tensors, metadata=metadata)


def decode_outputs(body: bytes) -> list[DiffusionOutput]:
    """The DiffusionOutputs of a body written by `encode_outputs`; ValueError for anything else."""
    what = "the rollouts body"
    metadata = read_metadata(body, what)
    if metadata.get("flowrl.format") != ROLLOUTS_FORMAT:
        raise ValueError(
            f"{what} has flowrl.format={metadata.get('flowrl.format')!r}, not {ROLLOUTS_FORMAT!r}: "
            "client and server are different flowrl versions"
        )
    tensors = load_tensors(body, what)
    outputs = []
    for index, sample in enumerate(json.loads(metadata["flowrl.outputs"])):
        missing = [name for name in _OUTPUT_FIELDS if name not in sample]
        if missing:
            raise ValueError(f"{what}: sample {index} lacks fields {missing}: client and server differ in version")
        fields = {}
        for name in _OUTPUT_FIELDS:
            value = sample[name]
            if name in _TENSOR_FIELDS and value is not None:
                value = tensors[value]
            elif name == "transition_spec":
                value = TransitionSpec(**value)
            elif name == "sde_window":
                value = tuple(value)
            fields[name] = value
        outputs.append(DiffusionOutput(**fields))
    return outputs


# --- weights ---------------------------------------------------------------------------------------

# The module a weights body belongs to when its metadata names none: the checkpoint's one transformer.
WEIGHTS_COMPONENT = "transformer"


def encode_weights(
    state: Mapping[str, torch.Tensor], lora: Mapping | None = None, component: str = WEIGHTS_COMPONENT
) -> bytes:
    """A weight update's body (module docstring); `lora` = {rank, alpha, target_modules, dropout};
    `component`: the checkpoint's module the weights belong to."""
    from safetensors.torch import save

    metadata = {"flowrl.component": component}
    if lora is not None:
        metadata["flowrl.lora"] = json.dumps(dict(lora))
    return save({name: t.detach().to("cpu").contiguous() for name, t in state.items()}, metadata=metadata)


def file_sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors in name order: for each, its name, dtype and shape (as
    "name\\0dtype\\0d0,d1,...\\0") then its bytes in C order; independent of the file layout."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        digest.update(f"{name}\0{dtype}\0{','.join(map(str, tensor.shape))}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --- stats -----------------------------------------------------------------------------------------


def stats_from_json(obj: dict) -> dict:
    """engine.stats() from its JSON form (JSON object keys are strings; the histogram's are ints)."""
    stats = dict(obj)
    if isinstance(stats.get("rows_per_forward_hist"), dict):
        stats["rows_per_forward_hist"] = {int(k): v for k, v in stats["rows_per_forward_hist"].items()}
    return stats

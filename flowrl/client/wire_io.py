"""The client's side of the rollout server's wire format (provisional, until flowrl.server.wire lands).

POST /v1/rollouts {"prompts": [...], "num_outputs_per_prompt": N, "sampling_params": {...}} is
answered with {"outputs": [per-sample metadata], "tensors": base64 safetensors} whose tensor keys
are "<sample index>.<DiffusionOutput field>" (absent: None). Never pickle.
"""

from __future__ import annotations

import base64
import dataclasses

import httpx
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from flowrl.engine.output import DiffusionOutput, TransitionSpec
from flowrl.sampling_params import SamplingParams

ROLLOUTS_PATH = "/v1/rollouts"
WEIGHTS_PATH = "/v1/weights"
LOAD_WEIGHTS_PATH = "/v1/weights"
TENSOR_FIELDS = tuple(f.name for f in dataclasses.fields(DiffusionOutput) if f.type.startswith("torch.Tensor"))
_COUNTERS = ("num_forwards", "num_rows", "num_samples_finished", "num_samples_failed", "busy_seconds")


def rollout_request(prompt: str, num_outputs_per_prompt: int, params: SamplingParams) -> dict:
    return {
        "prompts": [prompt],
        "num_outputs_per_prompt": num_outputs_per_prompt,
        "sampling_params": dataclasses.asdict(params),
    }


def encode_outputs(outputs: list[DiffusionOutput]) -> dict:
    tensors, metadata = {}, []
    for i, out in enumerate(outputs):
        for name in TENSOR_FIELDS:
            value = getattr(out, name)
            if value is not None:
                tensors[f"{i}.{name}"] = value.detach().cpu().contiguous()
        metadata.append(
            {
                "prompt": out.prompt,
                "seed": out.seed,
                "policy_version": out.policy_version,
                "sde_window": list(out.sde_window),
                "transition_spec": dataclasses.asdict(out.transition_spec),
                "timings": out.timings,
            }
        )
    return {"outputs": metadata, "tensors": base64.b64encode(save_safetensors(tensors)).decode("ascii")}


def decode_outputs(body: dict) -> list[DiffusionOutput]:
    tensors = load_safetensors(base64.b64decode(body["tensors"]))
    outputs = []
    for i, meta in enumerate(body["outputs"]):
        fields = {name: tensors.get(f"{i}.{name}") for name in TENSOR_FIELDS}
        outputs.append(
            DiffusionOutput(
                prompt=meta["prompt"],
                seed=int(meta["seed"]),
                policy_version=int(meta["policy_version"]),
                sde_window=tuple(meta["sde_window"]),
                transition_spec=TransitionSpec(**meta["transition_spec"]),
                timings=dict(meta["timings"]),
                **fields,
            )
        )
    return outputs


def decode_rollout_response(response: httpx.Response) -> list[DiffusionOutput]:
    return decode_outputs(response.json())


def weights_request(payload: bytes, version: int, checksum: str, kind: str) -> dict:
    return {"content": payload, "params": {"version": version, "checksum": checksum, "kind": kind}}


def stats_since(current: dict, base: dict | None) -> dict:
    stats = dict(current)
    if base is not None:
        for name in _COUNTERS:
            stats[name] = current.get(name, 0) - base.get(name, 0)
    stats["mean_rows_per_forward"] = stats["num_rows"] / stats["num_forwards"] if stats["num_forwards"] else 0.0
    busy = stats.get("busy_seconds", 0.0)
    stats["images_per_second"] = stats["num_samples_finished"] / busy if busy > 0 else 0.0
    return stats


def checksum_of(tensors: dict[str, torch.Tensor]) -> str:
    import hashlib

    return hashlib.sha256(save_safetensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()})).hexdigest()

"""flowrl.server.wire: SamplingParams and DiffusionOutputs survive the wire bit for bit (every
field, None fields, shared tensors, any dtype); anything else is refused with a clear error;
the weights checksum depends on the tensors only."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flowrl.engine.output import DiffusionOutput, TransitionSpec
from flowrl.sampling_params import SamplingParams
from flowrl.server import wire


def _output(seed: int, embeds: torch.Tensor, cfg: bool, dtype=torch.float32) -> DiffusionOutput:
    generator = torch.Generator().manual_seed(seed)
    window = 2
    params = SamplingParams(height=32, width=16, num_inference_steps=4, guidance_scale=3.0 if cfg else 1.0)
    return DiffusionOutput(
        prompt=f"prompt {seed}",
        image=torch.randint(0, 256, (3, 32, 16), dtype=torch.uint8, generator=generator),
        all_latents=torch.randn(window + 1, 4, 4, 2, generator=generator),
        all_log_probs=torch.randn(window, generator=generator) if seed % 2 else None,
        sigmas=torch.tensor([1.0, 0.7]),
        next_sigmas=torch.tensor([0.7, 0.4]),
        prompt_embeds=embeds.to(dtype),
        prompt_embeds_mask=torch.ones(embeds.shape[0], dtype=torch.bool),
        pooled_prompt_embeds=None,
        negative_prompt_embeds=embeds[:, ::2].to(dtype) if cfg else None,  # a strided view
        negative_prompt_embeds_mask=torch.zeros(embeds.shape[0], dtype=torch.bool) if cfg else None,
        negative_pooled_prompt_embeds=None,
        seed=seed,
        policy_version=seed // 2,
        sde_window=(1, 3),
        transition_spec=TransitionSpec.of(params),
        timings={"queued_s": 0.5, "denoise_s": 1.25},
    )


def _assert_same(a: DiffusionOutput, b: DiffusionOutput) -> None:
    for field in dataclasses.fields(DiffusionOutput):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), field.name
        else:
            assert x == y and type(x) is type(y), field.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_round_trip_bit_for_bit(dtype):
    shared = torch.randn(7, 6)
    outputs = [_output(seed, shared, cfg=seed < 2, dtype=dtype) for seed in range(4)]
    outputs[1] = dataclasses.replace(outputs[1], prompt_embeds=outputs[0].prompt_embeds)  # one tensor, two samples
    body = wire.encode_outputs(outputs)
    decoded = wire.decode_outputs(body)
    assert len(decoded) == len(outputs)
    for a, b in zip(outputs, decoded):
        _assert_same(a, b)
    names = json.loads(wire.read_metadata(body)["flowrl.outputs"])
    assert names[0]["prompt_embeds"] == names[1]["prompt_embeds"]  # stored once


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"", "not a safetensors file"),
        (b"\xff" * 16, "not a safetensors file"),
        (wire.encode_weights({"x": torch.zeros(2)}), "flowrl.format=None"),
    ],
)
def test_decode_refuses_other_bodies(body, fragment):
    with pytest.raises(ValueError, match=fragment):
        wire.decode_outputs(body)


def test_sampling_params_round_trip_and_unknown_fields():
    params = SamplingParams(
        height=48, sde_window=(1, 3), sde_window_size=None, seed=2**62, negative_prompt="blurry", sde_type="cps"
    )
    as_json = json.loads(json.dumps(wire.params_to_json(params)))
    assert wire.params_from_json(as_json) == params
    base = SamplingParams(height=64, width=64)
    assert wire.params_from_json({"seed": 3}, base=base) == base.replace(seed=3)
    with pytest.raises(ValueError, match=r"unknown fields \['steps'\]"):
        wire.params_from_json({"steps": 3})
    with pytest.raises(ValueError, match="must be a JSON object"):
        wire.params_from_json([1, 2])
    request = wire.rollout_request(("a", "b"), 3, params)
    assert request["prompt"] == ["a", "b"] and request["num_outputs_per_prompt"] == 3
    assert wire.params_from_json(request["sampling_params"]) == params


def test_weights_checksum_covers_names_dtypes_shapes_and_bytes():
    state = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(3, dtype=torch.bfloat16)}
    checksum = wire.weights_sha256(state)
    # Independent of order and memory layout.
    assert wire.weights_sha256({"a": state["a"], "b": state["b"].t().contiguous().t()}) == checksum
    assert wire.weights_sha256(wire.load_tensors(wire.encode_weights(state))) == checksum
    changed = [
        {**state, "b": state["b"].clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(0.5))},
        {**state, "b": state["b"].reshape(3, 2)},
        {**state, "a": state["a"].float()},
        {"c": state["b"], "a": state["a"]},
    ]
    assert all(wire.weights_sha256(other) != checksum for other in changed)


def test_stats_from_json_restores_integer_histogram_keys():
    stats = {"num_forwards": 3, "rows_per_forward_hist": {1: 2, 32: 1}}
    assert wire.stats_from_json(json.loads(json.dumps(stats))) == stats

"""The SD3 adapter hands the transformer what StableDiffusion3Pipeline hands it: the timestep
sigma * 1000 in float32, also in a bf16 model (the sinusoidal embedding runs in float32 and casts
after it); and the text length is settable (model.max_sequence_length)."""

import pytest
import torch

from flowrl.models.sd3 import SD3Adapter


def _record_transformer_inputs(transformer) -> list[dict]:
    calls = []
    transformer.register_forward_pre_hook(lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


def test_timestep_is_the_pipelines_own_in_a_bf16_model(tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_path), dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    calls = _record_transformer_inputs(pipe.transformer)
    steps = 3
    pipe(prompt="a red apple", height=64, width=64, num_inference_steps=steps, guidance_scale=1.0, output_type="latent")
    pipeline_timesteps = [c["timestep"] for c in calls]
    assert len(pipeline_timesteps) == steps and pipeline_timesteps[0].dtype == torch.float32
    adapter = SD3Adapter(pipe, "cpu", torch.bfloat16)
    calls.clear()
    encoding = adapter.encode_prompts(["a red apple"])
    latents = adapter.initial_noise(64, 64, torch.Generator().manual_seed(0))[None]
    with torch.no_grad():
        for sigma in adapter.sigmas(steps, 64, 64)[:-1]:
            adapter.velocity(latents, sigma.reshape(1), encoding, [None], torch.ones(1), 64, 64)
    for ours, theirs in zip([c["timestep"] for c in calls], pipeline_timesteps):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    # What rounding to bf16 first would have changed (the premise: not a no-op on this schedule).
    assert any(not torch.equal(t.to(torch.bfloat16).float(), t) for t in pipeline_timesteps)


def test_text_length_is_settable_and_checked(tiny_sd3_path):
    adapter = SD3Adapter.from_pretrained(tiny_sd3_path, max_sequence_length=16)
    assert adapter.encode_prompts(["a red apple"])[0].embeds.shape[0] == 77 + 16
    with pytest.raises(ValueError, match=r"max_sequence_length=600 .*\[1, 512\]"):
        SD3Adapter.from_pretrained(tiny_sd3_path, max_sequence_length=600)

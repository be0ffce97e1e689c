"""Bad input: a ValueError that names the field, raised before any work is queued, and the engine
keeps serving afterwards."""

from __future__ import annotations

import pytest

from flowrl.engine import SamplingParams


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda e, p: e.generate_batched("a cat", 0, p), "num_outputs_per_prompt"),
        (lambda e, p: e.generate_batched("a cat", -3, p), "num_outputs_per_prompt"),
        (lambda e, p: e.generate("a cat", p.replace(height=60)), "height"),
        (lambda e, p: e.generate("a cat", p.replace(width=72)), "width"),
        (lambda e, p: e.generate("a cat", p.replace(num_inference_steps=0)), "num_inference_steps"),
        (lambda e, p: e.generate("a cat", p.replace(sde_type="ddim")), "sde_type"),
        (lambda e, p: e.generate([], p), "prompts"),
        (lambda e, p: e.generate(None, p), "prompt"),
        (lambda e, p: e.generate("a cat", p.replace(sde_window=(3, 9))), "sde_window"),
        (lambda e, p: e.generate("a cat", p.replace(noise_level=0.0)), "logprobs"),
        (lambda e, p: e.generate("a cat", p.replace(noise_level=-1.0)), "noise_level"),
        (lambda e, p: e.generate("a cat", p.replace(sde_window_size=9)), "sde_window_size"),
        (lambda e, p: e.generate("a cat", p.replace(guidance_scale=float("nan"))), "guidance_scale"),
        (lambda e, p: e.generate("a cat", p.replace(guidance_scale=float("inf"))), "guidance_scale"),
        (lambda e, p: e.generate("a cat", p.replace(noise_level=float("inf"))), "noise_level"),
        (lambda e, p: e.generate("a cat", p.replace(seed=1.5)), "seed"),
        (lambda e, p: e.generate("a cat", p.replace(seed="7")), "seed"),
        (lambda e, p: e.generate("a cat", p.replace(seed=-1)), "seed"),
        (lambda e, p: e.generate("a cat", p.replace(seed=2**63)), "seed"),
        (lambda e, p: e.generate_batched("a cat", 3, p.replace(seed=2**63 - 2)), "seed"),
        (
            lambda e, p: e.generate("a cat", p.replace(negative_prompt=["blurry"], guidance_scale=3.0)),
            "negative_prompt",
        ),
        (lambda e, p: e.generate("a cat", p.replace(height=100000, width=100000)), "height"),
        (lambda e, p: e.generate("a cat", p.replace(num_inference_steps=10**9)), "num_inference_steps"),
        # The tiny SD3's position grid (pos_embed_max_size=32 patches) takes at most 512 pixels a side.
        (lambda e, p: e.generate("a cat", p.replace(height=1024, width=1024)), "height=1024 is above 512"),
        (lambda e, p: e.generate("a cat", p.replace(sde_window="01")), "sde_window"),
        (lambda e, p: e.generate("a cat", "64x64"), "sampling_params"),
        (lambda e, p: e.generate(["a cat", 3], p), "prompt=3"),
    ],
)
def test_bad_input_names_the_field_and_engine_keeps_serving(sd3_engine, params, call, field):
    before = sd3_engine.stats()["num_forwards"]
    with pytest.raises(ValueError, match=field):
        call(sd3_engine, params)
    assert sd3_engine.stats()["num_forwards"] == before  # nothing was queued
    assert sd3_engine.generate("a cat", params).image.shape == (3, 64, 64)


def test_n_below_one_raises_before_the_engine_is_touched(sd3_engine, params):
    submitted = []
    original = sd3_engine._enqueue
    sd3_engine._enqueue = lambda samples: submitted.append(samples)
    try:
        with pytest.raises(ValueError, match="num_outputs_per_prompt"):
            sd3_engine.generate_batched("a cat", 0, params)
    finally:
        del sd3_engine._enqueue
    assert submitted == [] and sd3_engine._enqueue == original


def test_error_message_suggests_a_fix():
    with pytest.raises(ValueError, match=r"height=100 is not a multiple of 16.*96 or 112"):
        SamplingParams(height=100).validate(16)


def test_a_failing_step_fails_only_its_samples(tiny_sd3_path, params):
    from flowrl.engine import DiffusionEngine

    engine = DiffusionEngine.from_pretrained(tiny_sd3_path)
    try:

        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        engine.adapter.velocity = broken
        with pytest.raises(RuntimeError, match="boom"):
            engine.generate("a cat", params)
        del engine.adapter.velocity
        assert engine.generate("a cat", params).image.shape == (3, 64, 64)
        assert engine.stats()["num_samples_failed"] == 1
    finally:
        engine.shutdown()


def test_a_decode_failure_fails_only_the_samples_being_decoded(tiny_sd3_path, params):
    from flowrl.engine import DiffusionEngine

    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, decode_chunk_size=2)
    decode, calls = engine.adapter.decode, []

    def first_decode_fails(latents, *args):
        calls.append(latents.shape[0])
        if len(calls) == 1:
            raise RuntimeError("decode boom")
        return decode(latents, *args)

    engine.adapter.decode = first_decode_fails
    try:
        # Four samples finish together (two chunks of two); two more of the same size still denoise.
        finishing = engine.submit_batched("a cat", 4, params)
        denoising = engine.submit_batched("a cat", 2, params.replace(num_inference_steps=12, seed=30))
        outcomes = [f.exception(timeout=60) for f in finishing]
        assert [type(e) for e in outcomes] == [RuntimeError, RuntimeError, type(None), type(None)]
        assert all(f.result(timeout=60).image.shape == (3, 64, 64) for f in denoising)
        assert calls[:2] == [2, 2]
        assert engine.wait_until_idle(30)
        stats = engine.stats()
        assert stats["num_samples_failed"] == 2 and stats["num_samples_finished"] == 4
        assert engine.generate("a cat", params).image.shape == (3, 64, 64)
    finally:
        engine.shutdown()


def test_model_size_limit_comes_from_the_transformer(sd3_engine, qwen_engine, params):
    from flowrl.sampling_params import MAX_IMAGE_SIDE

    config = sd3_engine.adapter.transformer.config
    assert sd3_engine.adapter.max_image_side == config.pos_embed_max_size * config.patch_size * 8 == 512
    assert sd3_engine.generate("a cat", params.replace(height=512, num_inference_steps=2)).image.shape == (3, 512, 64)
    assert qwen_engine.adapter.max_image_side >= MAX_IMAGE_SIDE  # its RoPE table reaches further


def test_degenerate_schedule_is_a_clear_error_before_queueing(qwen_engine, params):
    # Qwen-Image's shift_terminal stretch divides by zero for a 1-step schedule (diffusers gives NaN).
    before = qwen_engine.stats()["num_forwards"]
    with pytest.raises(ValueError, match="num_inference_steps=1"):
        qwen_engine.generate("a cat", params.replace(num_inference_steps=1, logprobs=False))
    assert qwen_engine.stats()["num_forwards"] == before
    assert qwen_engine.generate("a cat", params).image.shape == (3, 64, 64)


def test_unsupported_mixed_precision_dtype_is_refused(sd3_engine):
    import torch

    with pytest.raises(ValueError, match="mixed precision dtype=torch.float64"):
        sd3_engine.set_mixed_precision(torch.float64)
    assert sd3_engine.executor.autocast_dtype is None

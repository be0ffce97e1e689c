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

"""The adapters reproduce their diffusers pipelines: with noise_level 0 the engine's ODE sampling
equals the pipeline's own Euler sampling from the same seed (latents and images), with and without
CFG, and the schedules are the pipelines' schedules."""

from __future__ import annotations

import pytest
import torch

from flowrl.engine import DiffusionEngine, SamplingParams
from flowrl.models.registry import read_model_family


def _pipeline(path):
    from diffusers import QwenImagePipeline, StableDiffusion3Pipeline

    cls = StableDiffusion3Pipeline if read_model_family(path) == "sd3" else QwenImagePipeline
    pipe = cls.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("family", ["sd3", "qwen_image"])
@pytest.mark.parametrize("cfg", [False, True])
def test_ode_engine_matches_the_diffusers_pipeline(family, cfg, tiny_sd3_path, tiny_qwen_path):
    path = tiny_sd3_path if family == "sd3" else tiny_qwen_path
    pipe = _pipeline(path)
    engine = DiffusionEngine.from_pretrained(path)
    prompt, negative, scale, steps = "a photo of a cat", "blurry", 4.0, 5
    params = SamplingParams(
        height=64,
        width=64,
        num_inference_steps=steps,
        noise_level=0.0,
        logprobs=False,
        sde_window=(0, steps - 1),  # keep the trajectory (an ODE request without one keeps the final latent)
        seed=3,
        guidance_scale=scale if cfg else 1.0,
        negative_prompt=negative if cfg else None,
    )
    try:
        ours = engine.generate(prompt, params)
        kwargs = dict(
            prompt=prompt, height=64, width=64, num_inference_steps=steps, generator=torch.Generator().manual_seed(3)
        )
        if family == "sd3":
            kwargs.update(guidance_scale=scale if cfg else 1.0, negative_prompt=negative if cfg else None)
        else:
            kwargs.update(true_cfg_scale=scale if cfg else 1.0, negative_prompt=negative if cfg else None)
        trajectory = []

        def record(pipeline, step, timestep, tensors):
            trajectory.append(tensors["latents"][0].clone())
            return tensors

        image = pipe(**kwargs, output_type="pt", callback_on_step_end=record).images
    finally:
        engine.shutdown()
    # all_latents holds the window's latents: the start noise, then the latent after each of the
    # first T - 1 steps (the last step is always ODE and is not stored); the image is the final one.
    assert ours.all_latents.shape[0] == steps
    torch.testing.assert_close(ours.all_latents[1:], torch.stack(trajectory[: steps - 1]).float(), atol=1e-5, rtol=1e-5)
    reference = (image[0] * 255).round().to(torch.uint8)
    assert (ours.image.int() - reference.int()).abs().max() <= 1


def test_sd3_schedule_is_the_shifted_one(sd3_adapter):
    shift = sd3_adapter.scheduler.config.shift  # 3.0 in the tiny checkpoint, as in SD3

    def shifted(t):
        return shift * t / (1 + (shift - 1) * t)

    # diffusers spaces the unshifted values between 1 and shifted(1/1000), then shifts them.
    base = torch.linspace(1.0, shifted(1 / 1000), 4, dtype=torch.float64)
    expected = torch.cat([shifted(base), torch.zeros(1, dtype=torch.float64)]).float()
    torch.testing.assert_close(sd3_adapter.sigmas(4, 64, 64), expected, atol=1e-6, rtol=0)


def test_qwen_schedule_depends_on_resolution(qwen_adapter):
    small, large = qwen_adapter.sigmas(10, 64, 64), qwen_adapter.sigmas(10, 256, 256)
    assert small[0] == large[0] == 1.0 and small[-1] == large[-1] == 0.0
    assert (large[1:-2] > small[1:-2]).all()  # more image tokens -> larger shift
    # ... and both end at the checkpoint's shift_terminal before the final 0.
    terminal = qwen_adapter.scheduler.config.shift_terminal
    assert abs(float(small[-2]) - terminal) < 1e-6 and abs(float(large[-2]) - terminal) < 1e-6


def test_qwen_pack_unpack_round_trip(qwen_adapter):
    x = torch.randn(2, 16, 8, 12)
    tokens = qwen_adapter.pack(x, 8, 12)
    assert tokens.shape == (2, 24, 64)
    torch.testing.assert_close(qwen_adapter.unpack(tokens, 8, 12), x, atol=0, rtol=0)


@pytest.fixture(scope="module")
def sd3_adapter(tiny_sd3_path):
    from flowrl.models import load_adapter

    return load_adapter(tiny_sd3_path)


@pytest.fixture(scope="module")
def qwen_adapter(tiny_qwen_path):
    from flowrl.models import load_adapter

    return load_adapter(tiny_qwen_path)


def test_unknown_folder_is_a_clear_error(tmp_path):
    from flowrl.models import load_adapter

    with pytest.raises(ValueError, match="model_index.json"):
        load_adapter(tmp_path)


def test_registry_and_config_name_the_same_families():
    """flowrl.models.registry is the one list of families; the config's `model.family` accepts
    each of its names (and "auto"), and each adapter class carries its registry name."""
    from flowrl.config.sections import ModelConfig
    from flowrl.models.registry import FAMILIES

    for family, adapter_class in FAMILIES.values():
        assert adapter_class.family == family
        ModelConfig(family=family).validate()
    ModelConfig(family="auto").validate()
    with pytest.raises(ValueError, match="model.family"):
        ModelConfig(family="sdxl").validate()


def test_true_cfg_scale_on_a_classifier_free_guidance_family_is_refused(tiny_sd3_path, tmp_path):
    """SD3's guidance_scale is CFG already: true_cfg_scale != 1 is an error naming the field and the
    fix, from the engine and, before any model loads, from the trainer's checks."""
    from flowrl.run.checks import check_before_loading
    from flowrl.run.config import load_train_config

    engine = DiffusionEngine.from_pretrained(tiny_sd3_path)
    try:
        params = SamplingParams(height=64, width=64, num_inference_steps=2, true_cfg_scale=4.0)
        assert engine.adapter.rows_per_sample(params) == 1 and engine.adapter.guidance_kind == "cfg"
        with pytest.raises(ValueError, match=r"SamplingParams.true_cfg_scale=4.0 .* set guidance_scale=4.0"):
            engine.generate("a cat", params)
        assert engine.adapter.rows_per_sample(params.replace(true_cfg_scale=1.0, guidance_scale=4.0)) == 2
    finally:
        engine.shutdown()
    cfg = load_train_config(
        None, [f"model.path={tiny_sd3_path}", f"trainer.output_dir={tmp_path}", "rollout.val_sampling.true_cfg_scale=2"]
    )
    with pytest.raises(ValueError, match=r"rollout.val_sampling.true_cfg_scale=2.0 applies to guidance-distilled"):
        check_before_loading(cfg)

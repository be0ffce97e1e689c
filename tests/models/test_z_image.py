"""Z-Image on its tiny checkpoint: `make-tiny` builds a folder ZImagePipeline loads, whose chat
template lays prompts out as Qwen3's does; the engine's ODE sampling is the pipeline's, step by step
(with and without guidance, with the pipeline's CFG normalization and truncation), its schedules are
the pipeline's, a batched sample equals its solo run, the trainer re-scores rollouts to float32
rounding, and a 3-step LoRA run exports weights that the pipeline loads."""

from __future__ import annotations

import pytest
import torch

from flowrl.engine import DiffusionEngine, SamplingParams
from flowrl.run.checkpoint import latest_checkpoint
from flowrl.run.config import load_train_config

PROMPT, NEGATIVE = "a photo of a cat", "blurry"
# sde_window keeps the trajectory (an ODE request without one keeps the final latent alone).
ODE = SamplingParams(
    height=64, width=64, num_inference_steps=5, noise_level=0.0, logprobs=False, sde_window=(0, 4), seed=3
)


@pytest.fixture(scope="module")
def pipe(tiny_z_image_path):
    from diffusers import ZImagePipeline

    pipeline = ZImagePipeline.from_pretrained(str(tiny_z_image_path))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def engine(tiny_z_image_path):
    engine = DiffusionEngine.from_pretrained(tiny_z_image_path, max_batch_rows=16)
    yield engine
    engine.shutdown()


def test_make_tiny_builds_a_folder_the_pipeline_loads(tmp_path, capsys):
    from diffusers import ZImagePipeline

    from flowrl.cli import main

    assert main(["make-tiny", "--kind", "z_image", str(tmp_path / "z")]) == 0
    assert "text_encoder" in capsys.readouterr().out
    pipeline = ZImagePipeline.from_pretrained(str(tmp_path / "z"))
    assert len(pipeline.tokenizer) > 100  # not a silently empty tokenizer
    image = pipeline("a red sign", height=64, width=64, num_inference_steps=2, output_type="pt").images
    assert image.shape == (1, 3, 64, 64) and bool(torch.isfinite(image).all())


def test_chat_template_gives_one_token_per_marker_role_and_newline(pipe):
    tokenizer = pipe.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a red sign"}], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert text == "<|im_start|>user\na red sign<|im_end|>\n<|im_start|>assistant\n"
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids)
    prompt = ["a", "Ġred", "Ġsign"]
    assert tokens == ["<|im_start|>", "user", "Ċ", *prompt, "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    unthinking = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert unthinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # What the pipeline encodes: every token of the templated prompt, padding dropped.
    (embeds,), _ = pipe.encode_prompt("a red sign", do_classifier_free_guidance=False)
    assert embeds.shape == (len(tokens), pipe.text_encoder.config.hidden_size)


def _pipeline_latents(pipe, params: SamplingParams, **options) -> torch.Tensor:
    """The pipeline's latent after each step, from the same seed; flowrl's guidance weight w is
    the pipeline's guidance_scale + 1 (flowrl.models.z_image)."""
    trajectory = []

    def record(pipeline, step, timestep, tensors):
        trajectory.append(tensors["latents"][0].clone())
        return tensors

    final = pipe(
        prompt=PROMPT,
        negative_prompt=params.negative_prompt,
        guidance_scale=max(params.guidance_scale - 1.0, 0.0),
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        generator=torch.Generator().manual_seed(params.seed),
        output_type="latent",
        callback_on_step_end=record,
        **options,
    ).images
    assert torch.equal(final[0], trajectory[-1])
    return torch.stack(trajectory)


def _engine_latents(engine, params: SamplingParams) -> torch.Tensor:
    """The engine's latent after each step: the stored window (every step but the last) and the
    latent it decodes."""
    decoded = []
    inner = engine.adapter.decode
    engine.adapter.decode = lambda latents, h, w: decoded.append(latents.clone()) or inner(latents, h, w)
    try:
        out = engine.generate(PROMPT, params)
    finally:
        del engine.adapter.decode  # back to the class method
    return torch.cat([out.all_latents[1:], decoded[0]])


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_engine_matches_the_pipeline_step_by_step(engine, pipe, guidance):
    params = ODE.replace(guidance_scale=guidance, negative_prompt=NEGATIVE if guidance > 1 else None)
    ours, reference = _engine_latents(engine, params), _pipeline_latents(pipe, params)
    assert ours.shape == reference.shape == (5, *engine.adapter.latent_shape(64, 64))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_guidance_is_classifier_free_guidance_rows_from_the_adapter(engine):
    """Z-Image's guidance_scale is CFG (the adapter's rule decides rows per sample); true_cfg_scale,
    for guidance-distilled models only, is refused naming the fix."""
    adapter = engine.adapter
    assert adapter.guidance_kind == "cfg"
    assert [adapter.rows_per_sample(ODE.replace(guidance_scale=g)) for g in (1.0, 4.0)] == [1, 2]
    with pytest.raises(ValueError, match=r"SamplingParams.true_cfg_scale=2.0 .* set guidance_scale=2.0"):
        engine.generate(PROMPT, ODE.replace(true_cfg_scale=2.0))


def test_cfg_normalization_and_truncation_are_the_pipelines(tiny_z_image_path, pipe):
    # Truncation 0.15 drops guidance where 1 - sigma > 0.15: the last two of the five steps
    # (sigmas 1, 0.96, 0.9, 0.8, 0.6 under the tiny checkpoint's shift of 6).
    options = dict(cfg_normalization=1.0, cfg_truncation=0.15)
    params = ODE.replace(guidance_scale=4.0, negative_prompt=NEGATIVE)
    engine = DiffusionEngine.from_pretrained(tiny_z_image_path, **options)
    rows = []  # frames per transformer forward
    engine.adapter.transformer.register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
    try:
        ours = _engine_latents(engine, params)
    finally:
        engine.shutdown()
    torch.testing.assert_close(ours, _pipeline_latents(pipe, params, **options), atol=1e-5, rtol=1e-5)
    assert rows == [2, 2, 2, 1, 1]  # truncated steps run the cond row alone, as the pipeline does
    for option in options:  # each option changes the result, so the comparison above covers both
        alone = _pipeline_latents(pipe, params, **{option: options[option]})
        assert (alone[-1] - _pipeline_latents(pipe, params)[-1]).abs().max() > 1e-3, option


def test_bad_cfg_options_name_the_option(tiny_z_image_path):
    from flowrl.models import load_adapter

    with pytest.raises(ValueError, match=r"cfg_normalization=-1\.0 must be >= 0"):
        load_adapter(tiny_z_image_path, cfg_normalization=-1.0)


@pytest.mark.parametrize("dynamic", [False, True])
def test_schedule_is_the_pipelines(engine, pipe, dynamic):
    from diffusers import FlowMatchEulerDiscreteScheduler

    adapter = engine.adapter
    saved = adapter.scheduler, pipe.scheduler, dict(adapter._sigma_cache)
    if dynamic:  # a resolution-dependent config: mu from the image token count
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
        adapter.scheduler = pipe.scheduler = scheduler
        adapter._sigma_cache.clear()
    try:
        for steps, size in ((5, 64), (10, 128), (28, 64)):
            pipe(
                prompt="a", guidance_scale=0.0, height=size, width=size, num_inference_steps=steps, output_type="latent"
            )
            assert torch.equal(adapter.sigmas(steps, size, size), pipe.scheduler.sigmas), (steps, size)
        if dynamic:
            assert not torch.equal(adapter.sigmas(10, 64, 64), adapter.sigmas(10, 128, 128))
    finally:
        adapter.scheduler, pipe.scheduler = saved[0], saved[1]
        adapter._sigma_cache.clear()
        adapter._sigma_cache.update(saved[2])


def test_batched_and_mixed_length_samples_equal_their_solo_runs(engine):
    params = SamplingParams(
        height=64, width=64, num_inference_steps=4, noise_level=0.8, seed=5, guidance_scale=3.0, negative_prompt="dark"
    )
    batched = engine.generate_batched(PROMPT, 3, params)
    # Captions of different lengths in one forward: the transformer pads and masks them itself.
    prompts = ["a dog", "a red poster with the word hello written on it in big yellow letters", "open"]
    mixed = [f.result() for f in engine.submit_many(prompts, params.replace(seed=9))]
    solo = [engine.generate(PROMPT, params.replace(seed=5 + j)) for j in range(3)]
    solo += [engine.generate(p, params.replace(seed=9 + j)) for j, p in enumerate(prompts)]
    for out, alone in zip(batched + mixed, solo):
        torch.testing.assert_close(out.all_latents, alone.all_latents, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.all_log_probs, alone.all_log_probs, atol=1e-5, rtol=0)
    assert len({out.prompt_embeds.shape[0] for out in mixed}) == 3


def _train_config(path, tmp_path, *overrides):
    return load_train_config(
        None,
        [
            f"model.path={path}",
            f"trainer.output_dir={tmp_path}",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "trainer.val_every=0",
            "rollout.n=3",
            "trainer.prompts_per_step=2",
            "trainer.lora.enabled=true",
            "trainer.lora.rank=4",
            "rollout.sampling.negative_prompt=blurry",
            *overrides,
        ],
    )


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_rollout_log_probs_match_the_trainer_to_float32_rounding(build_trainer, tiny_z_image_path, tmp_path, guidance):
    from flowrl.engine.output import TransitionSpec
    from flowrl.rollout.batch import RolloutBatch

    cfg = _train_config(
        tiny_z_image_path,
        tmp_path,
        "trainer.save_every=0",
        "trainer.micro_batch_size=4",
        "algorithm.old_log_prob=recompute",
        f"rollout.sampling.guidance_scale={guidance}",
    )
    trainer = build_trainer(cfg)
    rows = trainer.prompts.next_rows()
    for i, row in enumerate(rows):
        row["uid"] = f"u{i}"
    out = trainer.agent_loop.generate_sequences(RolloutBatch.from_rows(rows).repeat(cfg.rollout.n))
    tensors = {k: v for k, v in out.batch.items() if k != "images"}
    assert ("negative_prompt_embeds" in tensors) == (guidance > 1)
    specs = TransitionSpec.from_columns(out.non_tensor_batch)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    metrics = trainer.algorithm.updater.prepare_and_update(tensors, specs, advantages, torch.ones(6), step=1)
    assert metrics["actor/logprob_gap_max"] < 1e-6
    assert metrics["actor/grad_norm"] > 0.0


def test_three_lora_steps_export_weights_the_pipeline_loads(build_trainer, tiny_z_image_path, tmp_path, pipe):
    from diffusers import ZImagePipeline

    cfg = _train_config(
        tiny_z_image_path,
        tmp_path,
        "trainer.total_steps=3",
        "trainer.save_every=3",
        "trainer.lr=0.05",
        "trainer.lora.alpha=16",
        "rollout.sampling.guidance_scale=3.0",
    )
    trainer = build_trainer(cfg)
    assert trainer.fit()["steps"] == 3
    lora_dir = latest_checkpoint(cfg.trainer.output_dir) / "lora"

    def sample(pipeline):
        return pipeline(
            prompt="a red apple",
            height=64,
            width=64,
            num_inference_steps=3,
            guidance_scale=0.0,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    fresh = ZImagePipeline.from_pretrained(str(tiny_z_image_path))
    fresh.set_progress_bar_config(disable=True)
    base = sample(fresh)
    fresh.load_lora_weights(str(lora_dir))
    with_lora = sample(fresh)
    assert (with_lora - base).abs().max() > 1e-4
    torch.testing.assert_close(with_lora, sample(trainer.adapter.pipeline), rtol=1e-4, atol=1e-5)

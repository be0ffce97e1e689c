"""FLUX.1 [dev] on the tiny checkpoint: the engine's ODE sampling is FluxPipeline's, step by step,
with the distilled guidance embedding and with true CFG; its step is the pipeline scheduler's
step and its schedule the pipeline's resolution-dependent one; a guidance-distilled sample takes
one row; batch invariance; the rollout-vs-trainer log-prob gap; a 3-step LoRA run whose export
FluxPipeline loads."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl import sampler
from flowrl.engine import DiffusionEngine, SamplingParams

PROMPT = "a photo of a cat"
ATOL = 1e-5


@pytest.fixture(scope="module")
def flux_engine(tiny_flux_path):
    engine = DiffusionEngine.from_pretrained(tiny_flux_path, max_batch_rows=32)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def flux_pipeline(tiny_flux_path):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(tiny_flux_path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ode(guidance_scale=3.5, true_cfg_scale=1.0, steps=5):
    return SamplingParams(
        height=64,
        width=64,
        num_inference_steps=steps,
        noise_level=0.0,
        logprobs=False,
        sde_window=(0, steps - 1),  # keep the trajectory (an ODE request without one keeps the final latent)
        seed=3,
        guidance_scale=guidance_scale,
        true_cfg_scale=true_cfg_scale,
        negative_prompt="blurry" if true_cfg_scale > 1 else None,
    )


@pytest.mark.parametrize("guidance_scale, true_cfg_scale", [(3.5, 1.0), (1.0, 1.0), (3.5, 3.0)])
def test_ode_engine_matches_the_pipeline_step_by_step(flux_engine, flux_pipeline, guidance_scale, true_cfg_scale):
    params = _ode(guidance_scale, true_cfg_scale)
    ours = flux_engine.generate(PROMPT, params)
    steps, trajectory = params.num_inference_steps, []

    def record(pipeline, step, timestep, tensors):
        trajectory.append(tensors["latents"][0].clone())
        return tensors

    kwargs = dict(
        prompt=PROMPT,
        negative_prompt=params.negative_prompt,
        height=64,
        width=64,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        true_cfg_scale=true_cfg_scale,
        latents=ours.all_latents[:1],  # the same initial latents
    )
    final = flux_pipeline(**kwargs, output_type="latent", callback_on_step_end=record).images
    image = flux_pipeline(**kwargs, output_type="pt").images
    # all_latents: the start, then the latent after each of the first T - 1 steps (the window).
    assert ours.all_latents.shape[0] == steps and len(trajectory) == steps
    torch.testing.assert_close(ours.all_latents[1:], torch.stack(trajectory[:-1]), atol=ATOL, rtol=ATOL)
    # The last step and the decode (scaling and shift factors): the pipeline's final latent,
    # decoded by the adapter, and the pipeline's own image are ours.
    adapter = flux_engine.adapter
    assert (adapter.decode(final, 64, 64)[0].int() - ours.image.int()).abs().max() <= 1
    assert ((image[0] * 255).round().to(torch.uint8).int() - ours.image.int()).abs().max() <= 1


def test_seeded_noise_is_the_pipelines(flux_engine, flux_pipeline):
    adapter = flux_engine.adapter
    ours = adapter.initial_noise(64, 64, torch.Generator().manual_seed(7))
    theirs, image_ids = flux_pipeline.prepare_latents(
        1, adapter.latent_channels, 64, 64, torch.float32, "cpu", torch.Generator().manual_seed(7)
    )
    assert torch.equal(ours, theirs[0])
    assert torch.equal(adapter.position_ids(64, 64, 512)[1], image_ids)


def test_guidance_embedding_and_true_cfg_change_the_result(flux_engine):
    runs = {
        (g, t): flux_engine.generate(PROMPT, _ode(g, t, steps=3)).all_latents[-1]
        for g, t in [(1.0, 1.0), (3.5, 1.0), (3.5, 3.0)]
    }
    assert (runs[1.0, 1.0] - runs[3.5, 1.0]).abs().max() > 1e-3  # the embedding is fed
    assert (runs[3.5, 1.0] - runs[3.5, 3.0]).abs().max() > 1e-3  # the uncond rows are used


@pytest.mark.parametrize("size", [64, 256, 1024])
def test_schedule_is_the_pipelines_resolution_dependent_shift(flux_engine, size):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    adapter, steps = flux_engine.adapter, 6
    scheduler = copy.deepcopy(adapter.scheduler)
    config = scheduler.config
    image_seq_len = (size // 16) ** 2
    mu = calculate_shift(
        image_seq_len, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift
    )
    retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    torch.testing.assert_close(adapter.sigmas(steps, size, size), scheduler.sigmas, atol=0, rtol=0)
    if size > 64:  # more image tokens -> a larger shift (every inner sigma higher)
        assert (adapter.sigmas(steps, size, size)[1:-1] > adapter.sigmas(steps, 64, 64)[1:-1]).all()


def test_the_pipelines_scheduler_step_is_flowrls_ode_step(flux_engine):
    """FlowMatchEulerDiscreteScheduler.step (what FluxPipeline steps with) on the tiny model's own
    velocities equals sampler.ode_step and the SDE step at noise level 0, bit for bit."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    adapter, steps = flux_engine.adapter, 4
    scheduler = copy.deepcopy(adapter.scheduler)
    config = scheduler.config
    seq_len = adapter.latent_shape(64, 64)[0]
    mu = calculate_shift(
        seq_len, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift
    )
    timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    scheduler.set_begin_index(0)
    sigmas = adapter.sigmas(steps, 64, 64)
    x = adapter.initial_noise(64, 64, torch.Generator().manual_seed(0))[None]
    cond = adapter.encode_prompts([PROMPT])
    for i, t in enumerate(timesteps):
        sigma, sigma_next = sigmas[i : i + 1], sigmas[i + 1 : i + 2]
        with torch.no_grad():
            v = adapter.velocity(x, sigma, cond, [None], torch.ones(1), 64, 64, embedded_guidance=torch.full((1,), 3.5))
        theirs = scheduler.step(v, t, x, return_dict=False)[0]
        ode = sampler.ode_step(x, v, sigma, sigma_next)
        sde = sampler.sde_step(x, v, sigma, sigma_next, 0.0, noise=torch.randn_like(x)).next_latents
        assert torch.equal(theirs, ode) and torch.equal(ode, sde), i
        x = ode


@pytest.mark.parametrize("true_cfg_scale, rows", [(1.0, 1), (2.0, 2)])
def test_batched_sample_j_equals_solo_and_a_sample_takes_the_guidance_kinds_rows(flux_engine, true_cfg_scale, rows):
    params = SamplingParams(
        height=64,
        width=64,
        num_inference_steps=4,
        noise_level=0.7,
        seed=11,
        guidance_scale=3.5,
        true_cfg_scale=true_cfg_scale,
        negative_prompt="blurry",
    )
    flux_engine.reset_stats()
    outs = flux_engine.generate_batched(PROMPT, 3, params)
    # Distilled guidance: one row per sample; true CFG adds each sample's uncond row to the forward.
    assert flux_engine.stats()["rows_per_forward_hist"] == {3 * rows: params.num_inference_steps}
    for j, out in enumerate(outs):
        assert (out.negative_prompt_embeds is not None) == (rows == 2)
        assert out.transition_spec.guidance_scale == 3.5 and out.transition_spec.true_cfg_scale == true_cfg_scale
        solo = flux_engine.generate(PROMPT, params.replace(seed=params.seed + j))
        torch.testing.assert_close(out.all_latents, solo.all_latents, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.all_log_probs, solo.all_log_probs, atol=ATOL, rtol=0)


def test_guidance_errors_name_the_field_and_the_fix(flux_engine):
    from flowrl.models.flux import FluxAdapter

    one_row = DiffusionEngine(flux_engine.adapter, max_batch_rows=1)
    try:
        params = _ode(3.5, 1.0, steps=2)
        assert one_row.generate(PROMPT, params).image.shape == (3, 64, 64)  # distilled guidance: one row
        with pytest.raises(ValueError, match=r"true_cfg_scale=2.0 needs 2 rows per sample .* max_batch_rows=1"):
            one_row.generate(PROMPT, params.replace(true_cfg_scale=2.0))
        with pytest.raises(ValueError, match=r"SamplingParams.true_cfg_scale=nan must be a finite number"):
            one_row.generate(PROMPT, params.replace(true_cfg_scale=float("nan")))
    finally:
        one_row.shutdown()
    with pytest.raises(ValueError, match=r"max_sequence_length=600 \(model.max_sequence_length\) .* \[1, 512\]"):
        FluxAdapter(flux_engine.adapter.pipeline, "cpu", torch.float32, max_sequence_length=600)


def _train_config(path, output, *overrides):
    from small_runs import small_run_config

    return small_run_config(
        path,
        output,
        "rollout.sampling.guidance_scale=3.5",
        "rollout.val_sampling.guidance_scale=3.5",
        "rollout.sampling.negative_prompt=blurry",
        "model.max_sequence_length=64",  # shorter T5 prompts than FLUX's 512: faster, and the setting is used
        *overrides,
    )


def test_true_cfg_rollout_log_probs_match_the_trainers_recompute(build_trainer, tiny_flux_path, tmp_path):
    """With true CFG the trainer re-scores each row with its stored negative embeddings in the same
    forward (distilled guidance alone: the 3-step run below)."""
    from flowrl.engine.output import TransitionSpec
    from flowrl.rollout.batch import RolloutBatch

    cfg = _train_config(
        tiny_flux_path,
        tmp_path,
        "rollout.n=3",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4",
        "algorithm.old_log_prob=recompute",
        "rollout.sampling.true_cfg_scale=2.0",
    )
    trainer = build_trainer(cfg)
    rows = trainer.prompts.next_rows()
    for i, row in enumerate(rows):
        row["uid"] = f"u{i}"
    out = trainer.agent_loop.generate_sequences(RolloutBatch.from_rows(rows).repeat(3))
    tensors = {k: v for k, v in out.batch.items() if k != "images"}
    assert "negative_prompt_embeds" in tensors
    # Each row records the true-CFG weight it was drawn with, and is re-scored with it.
    specs = TransitionSpec.from_columns(out.non_tensor_batch)
    assert [spec.true_cfg_scale for spec in specs] == [2.0] * 6
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    metrics = trainer.algorithm.updater.prepare_and_update(tensors, specs, advantages, torch.ones(6), step=1)
    # CPU float32: the same function on the same inputs, only the batch composition differs.
    assert metrics["actor/logprob_gap_max"] < 1e-6
    assert metrics["actor/grad_norm"] > 0.0


def test_three_step_lora_run_and_its_export_loaded_by_flux_pipeline(build_trainer, tiny_flux_path, tmp_path):
    from diffusers import FluxPipeline

    from flowrl.models.flux import FluxAdapter
    from flowrl.run.checkpoint import latest_checkpoint

    targets = ",".join(FluxAdapter.default_lora_targets)  # Flow-GRPO's FLUX targets, every one present
    cfg = _train_config(
        tiny_flux_path,
        tmp_path,
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.total_steps=3",
        "trainer.save_every=3",
        "trainer.lora.enabled=true",
        "trainer.lora.rank=4",
        "trainer.lora.alpha=16",
        "trainer.lr=0.05",
        f"trainer.lora.target_modules=[{targets}]",
    )
    trainer = build_trainer(cfg)
    summary = trainer.fit()
    records = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    steps = [r for r in records if "actor/grad_norm" in r]
    assert summary["steps"] == 3 and [r["step"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["actor/policy_loss"]) and r["actor/grad_norm"] > 0 for r in steps)
    # Every step's rollout log-probs are the trainer's (CPU float32), the policy moving in between.
    assert all(r["actor/logprob_gap_max"] < 1e-6 for r in steps)
    lora_dir = latest_checkpoint(cfg.trainer.output_dir) / "lora"
    assert (lora_dir / "pytorch_lora_weights.safetensors").is_file()

    def sample(pipe):
        generator = torch.Generator().manual_seed(0)
        return pipe(
            prompt=PROMPT, height=64, width=64, num_inference_steps=3, generator=generator, output_type="pt"
        ).images

    pipe = FluxPipeline.from_pretrained(str(tiny_flux_path))
    pipe.set_progress_bar_config(disable=True)
    base = sample(pipe)
    pipe.load_lora_weights(str(lora_dir))
    with_lora = sample(pipe)
    assert (with_lora - base).abs().max() > 1e-4
    torch.testing.assert_close(with_lora, sample(trainer.adapter.pipeline), rtol=1e-4, atol=1e-5)


def test_every_attention_backward_gets_its_gradient_in_the_outputs_layout():
    """cuDNN's attention backward (torch 2.11, cuDNN 9.19 on an H200) reuses the plan it built for
    one shape whatever the strides of the output's gradient; a single-stream block's gradient, a
    slice of its concatenation's, is strided unlike the double-stream blocks', and the reused plan
    read out of bounds (an eager FLUX training step died with an illegal memory access). The
    adapter hands every attention output's gradient on contiguous, in the output's own layout."""
    import torch.nn.functional as F

    from flowrl.bench.models import build_bench_model

    adapter = build_bench_model("tiny-flux", "cpu", torch.float32).adapter
    adapter.transformer.requires_grad_(True)
    sdpa = F.scaled_dot_product_attention
    layouts = []

    def spy(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        out.register_hook(lambda grad, out_strides=out.stride(): layouts.append((grad.stride(), out_strides)))
        return out

    latents = torch.randn((2, *adapter.latent_shape(64, 64)))
    enc = adapter.encode_prompts(["a", "b"])
    guidance = adapter.guidance_embedding_kwargs(torch.full((2,), 3.5))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", spy)
        velocity = adapter.velocity(
            latents, torch.tensor([0.9, 0.3]), enc, [None, None], torch.ones(2), 64, 64, **guidance
        )
        velocity.square().sum().backward()
    transformer = adapter.transformer
    assert len(layouts) == len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
    assert all(grad == out for grad, out in layouts), layouts


@pytest.mark.gpu
def test_eager_bf16_training_backward_on_cuda_with_cudnn_attention_first():
    """The eager training step that died in cuDNN's attention backward (the test above says why),
    on the tiny model: bf16 autocast, cuDNN attention preferred, every gradient finite."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flowrl.bench.models import build_bench_model

    adapter = build_bench_model("tiny-flux", "cuda", torch.bfloat16).adapter
    adapter.transformer.requires_grad_(True)
    latents = torch.randn((3, *adapter.latent_shape(64, 64)), device="cuda")
    enc = adapter.encode_prompts(["a", "b", "c"])
    guidance = adapter.guidance_embedding_kwargs(torch.full((3,), 3.5, device="cuda"))
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    sigmas = torch.tensor([0.9, 0.5, 0.3], device="cuda")
    with sdpa_kernel(backends, set_priority=True), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(2):  # the second backward reuses the first one's attention plans
            velocity = adapter.velocity(
                latents, sigmas, enc, [None] * 3, torch.ones(3, device="cuda"), 64, 64, **guidance
            )
            velocity.float().square().mean().backward()
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad).all() for p in adapter.transformer.parameters() if p.grad is not None)

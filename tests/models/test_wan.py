"""Wan text to video on the tiny checkpoints (Wan2.1, Wan2.2-TI2V-5B, Wan2.2-A14B's two experts):
the engine's ODE sampling is WanPipeline's on the same noise, frames included; batched rows equal
solo rows, the experts switching row by row at the boundary; frame counts and sizes the pipeline
cannot make are refused before any work with the rule named; a 3-step LoRA run whose rollout
log-probs are the trainer's, whose validation videos are frame strips and mp4s, and whose export
WanPipeline loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from wan_runs import FRAMES, SIZE, wan_train_config

from flowrl.engine import DiffusionEngine, SamplingParams

PROMPT = "a red circle moving right"
ATOL = 1e-5


@pytest.fixture(scope="module")
def wan_paths(tmp_path_factory):
    from flowrl.models.debug.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_wan")
    return {kind: build_tiny_checkpoint(kind, root / kind, seed=0) for kind in ("wan", "wan2.2", "wan2.2-a14b")}


@pytest.fixture(scope="module")
def wan_engine(wan_paths):
    engine = DiffusionEngine.from_pretrained(wan_paths["wan"], max_batch_rows=32)
    yield engine
    engine.shutdown()


def _ode(steps=4, guidance_scale=4.5):
    return SamplingParams(
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=steps,
        noise_level=0.0,
        logprobs=False,
        sde_window=(0, steps - 1),  # keep the trajectory
        seed=3,
        guidance_scale=guidance_scale,
    )


@pytest.mark.parametrize("kind", ["wan", "wan2.2", "wan2.2-a14b"])
def test_ode_engine_matches_wan_pipeline_on_the_same_noise(wan_paths, kind):
    """Over a FlowMatchEulerDiscreteScheduler (the ODE step flowrl takes), the engine's trajectory,
    final latent and decoded frames are WanPipeline's: CFG in one forward, Wan2.2-TI2V's per-token
    timesteps as one per row, the A14B experts switched at the boundary (the schedule crosses it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from flowrl.models.registry import FAMILIES, read_model_family

    path = wan_paths[kind]
    pipe = WanPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    family = read_model_family(path)
    adapter = next(cls for name, cls in FAMILIES.values() if name == family)(pipe, "cpu", torch.float32)
    params = _ode()
    if kind == "wan2.2-a14b":
        sigmas = adapter.sigmas(params.num_inference_steps, SIZE, SIZE)
        assert sigmas[0] >= adapter.boundary_sigma > sigmas[1]  # both experts are used
    engine = DiffusionEngine(adapter)
    try:
        ours = engine.generate(PROMPT, params)
    finally:
        engine.shutdown()
    assert ours.image.shape == (FRAMES, 3, SIZE, SIZE)
    trajectory = []

    def record(pipeline, step, timestep, tensors):
        trajectory.append(tensors["latents"][0].clone())
        return tensors

    kwargs = dict(
        prompt=PROMPT,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        max_sequence_length=adapter.max_sequence_length,
        latents=ours.all_latents[:1].clone(),  # the engine's seeded noise
    )
    final = pipe(**kwargs, output_type="latent", callback_on_step_end=record).frames
    video = pipe(**kwargs, output_type="pt").frames  # (1, F, 3, H, W) in [0, 1]
    torch.testing.assert_close(ours.all_latents[1:], torch.stack(trajectory[:-1]), atol=ATOL, rtol=ATOL)
    assert (adapter.decode(final, SIZE, SIZE)[0].int() - ours.image.int()).abs().max() <= 1
    assert ((video[0] * 255).round().int() - ours.image.int()).abs().max() <= 1
    # The seeded start is the pipeline's prepare_latents with the same generator.
    theirs = pipe.prepare_latents(
        1, adapter.latent_channels, SIZE, SIZE, FRAMES, torch.float32, "cpu", torch.Generator().manual_seed(3)
    )
    assert torch.equal(ours.all_latents[0], theirs[0])


def test_schedule_is_the_checkpoints_unipc_flow_sigmas(wan_engine):
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler.from_config(wan_engine.adapter.scheduler.config)
    scheduler.set_timesteps(20)
    ours = wan_engine.adapter.sigmas(20, 240, 416)
    torch.testing.assert_close(ours[1:], scheduler.sigmas[1:], atol=0, rtol=0)
    # The scheduler's first sigma is 1 up to round-off (1 - 1e-6); flowrl's is 1, so the first SDE
    # step takes Flow-GRPO's rule at sigma 1 instead of sqrt(s / (1 - s)) ~ 1000.
    assert 0 < 1.0 - float(scheduler.sigmas[0]) < 1e-5 and float(ours[0]) == 1.0


def test_a_first_sde_step_keeps_the_latents_scale(wan_engine):
    from flowrl.sampler import sde_step

    sigmas = wan_engine.adapter.sigmas(8, 48, 48)
    x = torch.randn(2, 16, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    step = sde_step(
        x, torch.zeros_like(x), sigmas[:1].expand(2), sigmas[1:2].expand(2), 0.7,
        noise=torch.randn(x.shape, generator=torch.Generator().manual_seed(1)), sigma_first_step=sigmas[1],
    )  # fmt: skip
    assert float(step.next_latents.std()) < 2.0


def test_flop_counts_grow_with_the_frames(wan_engine):
    """A video's transformer forward and decode are counted over all its latent frames (MFU of
    video runs), not as one picture: 5 frames (2 latent frames) cost more than 1, 9 (3) more still."""
    from flowrl.run.flops import decode_flops_per_image, transformer_flops_per_row

    adapter = wan_engine.adapter
    forwards = [transformer_flops_per_row(adapter, SIZE, SIZE, num_frames=n) for n in (1, 5, 9)]
    decodes = [decode_flops_per_image(adapter, SIZE, SIZE, n) for n in (1, 5, 9)]
    assert forwards[0] < forwards[1] < forwards[2] and decodes[0] < decodes[1] < decodes[2]
    # Each latent frame adds at least as much as the one before (linear layers, quadratic attention).
    assert forwards[2] - forwards[1] >= forwards[1] - forwards[0] > 0


def test_batched_samples_equal_solo_samples(wan_engine):
    params = SamplingParams(
        height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=4, noise_level=0.7, seed=11, guidance_scale=4.5
    )
    wan_engine.reset_stats()
    outs = wan_engine.generate_batched(PROMPT, 3, params)
    assert wan_engine.stats()["rows_per_forward_hist"] == {6: params.num_inference_steps}  # 3 samples x CFG
    for j, out in enumerate(outs):
        assert out.transition_spec.num_frames == FRAMES
        assert out.all_latents.shape[1:] == (16, 2, SIZE // 8, SIZE // 8)  # (C, (F - 1) / 4 + 1, h, w)
        solo = wan_engine.generate(PROMPT, params.replace(seed=params.seed + j))
        torch.testing.assert_close(out.all_latents, solo.all_latents, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.all_log_probs, solo.all_log_probs, atol=ATOL, rtol=0)


def test_two_experts_switch_row_by_row_in_one_batch(wan_paths):
    """Rows on both sides of the boundary in one call: each row is what it is alone, and the
    rows below the boundary come from transformer_2 (swapping the experts changes them; training
    one expert: tests/models/test_wan_a14b.py)."""
    from flowrl.models.registry import load_adapter

    adapter = load_adapter(wan_paths["wan2.2-a14b"])
    latents = torch.randn(
        (3, *adapter.latent_shape(SIZE, SIZE, num_frames=FRAMES)), generator=torch.Generator().manual_seed(0)
    )
    sigma = torch.tensor([0.95, 0.5, 0.9])
    cond = adapter.encode_prompts([PROMPT, "a blue square", PROMPT])
    uncond = adapter.encode_prompts([""]) * 2 + [None]
    g = torch.full((3,), 4.5)
    with torch.no_grad():
        batched = adapter.velocity(latents, sigma, cond, uncond, g, SIZE, SIZE)
        for i in range(3):
            solo = adapter.velocity(
                latents[i : i + 1], sigma[i : i + 1], cond[i : i + 1], uncond[i : i + 1], g[:1], SIZE, SIZE
            )
            torch.testing.assert_close(batched[i : i + 1], solo, atol=ATOL, rtol=0)
        adapter.transformer, adapter.transformer_2 = adapter.transformer_2, adapter.transformer
        swapped = adapter.velocity(latents, sigma, cond, uncond, g, SIZE, SIZE)
    assert (swapped - batched).abs().amax(dim=(1, 2, 3, 4)).min() > 1e-3


def test_bad_frame_counts_and_sizes_are_refused_before_any_work(wan_engine, wan_paths):
    from flowrl.models.base import check_frames
    from flowrl.models.registry import load_adapter
    from flowrl.run.checks import check_guidance_settings

    wan_engine.reset_stats()
    params = _ode()
    with pytest.raises(ValueError, match=r"num_frames=6 is not of the form 4k\+1 .*; use 5 or 9"):
        wan_engine.generate(PROMPT, params.replace(num_frames=6))
    with pytest.raises(ValueError, match=r"height=40 is not a multiple of 16"):
        wan_engine.generate(PROMPT, params.replace(height=40))
    with pytest.raises(ValueError, match=r"num_frames=0 must be an integer in \[1, 1025\]"):
        wan_engine.generate(PROMPT, params.replace(num_frames=0))
    assert wan_engine.stats()["num_forwards"] == 0
    # Wan2.2-TI2V's VAE compresses 16x and its patches are 2x2: sizes are multiples of 32.
    wan22 = DiffusionEngine(load_adapter(wan_paths["wan2.2"]))
    try:
        with pytest.raises(ValueError, match=r"height=48 is not a multiple of 32"):
            wan22.generate(PROMPT, params.replace(height=48))
        assert wan22.stats()["num_forwards"] == 0
    finally:
        wan22.shutdown()
    with pytest.raises(ValueError, match=r"num_frames=5: this model makes images"):
        check_frames(None, params)
    # A run's settings are checked against the family before the model loads.
    from flowrl.config.sections import RolloutConfig

    rollout = RolloutConfig()
    rollout.sampling = rollout.sampling.replace(num_frames=8)
    with pytest.raises(ValueError, match=r"rollout.sampling.num_frames=8 is not of the form 4k\+1"):
        check_guidance_settings(wan_paths["wan"], rollout)


def test_random_weight_wan_architectures():
    from flowrl.models.debug.random_weights import published_parameter_count
    from flowrl.models.registry import load_adapter, read_model_family

    assert read_model_family("random:wan2.1-1.3b") == "wan2.1" and read_model_family("random:wan2.2-5b") == "wan2.2"
    # Transformer + VAE: 1.42 B for Wan2.1-1.3B (the VAE 0.13 B); about 5 B for Wan2.2-TI2V-5B.
    assert 1.3e9 < published_parameter_count("wan2.1-1.3b") < 1.6e9
    assert 4.8e9 < published_parameter_count("wan2.2-5b") < 6.0e9
    adapter = load_adapter("random:tiny-wan2.2", warn=False)
    engine = DiffusionEngine(adapter)
    try:
        out = engine.generate("x", _ode(steps=2))
    finally:
        engine.shutdown()
    assert adapter.random_weights == "tiny-wan2.2" and out.image.shape == (FRAMES, 3, SIZE, SIZE)
    assert out.prompt_embeds.shape == (adapter.max_sequence_length, 32)


def _train_config(path, output, *overrides):
    steps = ("rollout.sampling.num_inference_steps=4", "rollout.val_sampling.num_inference_steps=4")
    return wan_train_config(path, output, *steps, *overrides)


def test_three_step_lora_run_log_prob_gap_and_its_export_loaded_by_wan_pipeline(build_trainer, wan_paths, tmp_path):
    from diffusers import WanPipeline

    from flowrl.models.wan import WanAdapter
    from flowrl.run.checkpoint import latest_checkpoint

    targets = ",".join(WanAdapter.default_lora_targets)
    cfg = _train_config(
        wan_paths["wan"],
        tmp_path,
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.total_steps=3",
        "trainer.save_every=3",
        "trainer.val_every=3",
        "trainer.num_val_images=2",
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
    # Validation draws each video as a frame strip in the grid and writes it as an mp4 beside it.
    grids = sorted(Path(cfg.trainer.output_dir).rglob("step_*.png"))
    videos = sorted(Path(cfg.trainer.output_dir).rglob("step_*_videos/*.mp4"))
    assert len(grids) == 2 and len(videos) == 4  # before training and after step 3, two videos each
    lora_dir = latest_checkpoint(cfg.trainer.output_dir) / "lora"
    assert (lora_dir / "pytorch_lora_weights.safetensors").is_file()

    def sample(pipe):
        generator = torch.Generator().manual_seed(0)
        return pipe(
            prompt=PROMPT,
            height=SIZE,
            width=SIZE,
            num_frames=FRAMES,
            num_inference_steps=3,
            generator=generator,
            max_sequence_length=32,
            output_type="pt",
        ).frames

    pipe = WanPipeline.from_pretrained(str(wan_paths["wan"]))
    pipe.set_progress_bar_config(disable=True)
    base = sample(pipe)
    pipe.load_lora_weights(str(lora_dir))
    with_lora = sample(pipe)
    assert (with_lora - base).abs().max() > 1e-4
    torch.testing.assert_close(with_lora, sample(trainer.adapter.pipeline), rtol=1e-4, atol=1e-5)

"""generate / generate_batched produce valid samples that do not depend on their batch mates."""

from __future__ import annotations

import asyncio

import pytest
import torch

ATOL = 1e-5


def assert_valid(out, params):
    w = out.sde_window[1] - out.sde_window[0]
    assert out.image.dtype == torch.uint8 and out.image.shape == (3, params.height, params.width)
    assert out.all_latents.dtype == torch.float32 and out.all_latents.shape[0] == w + 1
    assert out.all_log_probs.shape == (w,) and out.all_log_probs.dtype == torch.float32
    assert torch.isfinite(out.all_log_probs).all() and torch.isfinite(out.all_latents).all()
    assert out.sigmas.shape == out.next_sigmas.shape == (w,)
    assert (out.next_sigmas < out.sigmas).all()
    assert out.prompt_embeds_mask.dtype == torch.bool
    assert out.prompt_embeds.shape[0] == out.prompt_embeds_mask.shape[0]


def test_generate_batched_gives_n_valid_distinct_samples(engine, params):
    outs = engine.generate_batched("a photo of a cat", 4, params)
    assert len(outs) == 4
    for j, out in enumerate(outs):
        assert_valid(out, params)
        assert out.seed == params.seed + j
        # No window configured: every step but the last is stochastic.
        assert out.sde_window == (0, params.num_inference_steps - 1)
        assert out.negative_prompt_embeds is None and out.negative_prompt_embeds_mask is None
    for a in range(4):
        for b in range(a + 1, 4):
            assert (outs[a].all_latents[-1] - outs[b].all_latents[-1]).abs().max() > 1e-2
            assert not torch.equal(outs[a].image, outs[b].image)


def test_batched_sample_j_equals_solo_seed_plus_j(engine, params):
    outs = engine.generate_batched("a red sign with text", 3, params)
    for j, out in enumerate(outs):
        solo = engine.generate("a red sign with text", params.replace(seed=params.seed + j))
        torch.testing.assert_close(out.all_latents, solo.all_latents, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.all_log_probs, solo.all_log_probs, atol=ATOL, rtol=0)
        assert (out.image.int() - solo.image.int()).abs().max() <= 1


def test_shared_initial_noise_starts_a_request_from_its_first_samples_noise(engine, params):
    """DanceGRPO's init_same_noise: one starting latent per request, the SDE noise each sample's own;
    the first sample is the one a plain request draws."""
    shared = engine.generate_batched("a red sign with text", 3, params.replace(shared_initial_noise=True))
    plain = engine.generate_batched("a red sign with text", 3, params)
    assert shared[0].sde_window[0] == 0  # all_latents[:, 0] is the starting noise
    for j in range(3):
        assert torch.equal(shared[j].all_latents[0], plain[0].all_latents[0])
    torch.testing.assert_close(shared[0].all_latents, plain[0].all_latents, atol=ATOL, rtol=0)
    assert not torch.equal(plain[1].all_latents[0], plain[0].all_latents[0])
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert (shared[a].all_latents[-1] - shared[b].all_latents[-1]).abs().max() > 1e-2


def test_cfg_rows_share_the_forward_and_match_solo(engine, params):
    cfg = params.replace(guidance_scale=4.0, negative_prompt="blurry")
    engine.reset_stats()
    outs = engine.generate_batched("a dog on the street", 3, cfg)
    hist = engine.stats()["rows_per_forward_hist"]
    assert hist == {6: cfg.num_inference_steps}, hist  # 3 samples x (cond + uncond) in each forward
    for j, out in enumerate(outs):
        assert out.negative_prompt_embeds is not None and out.negative_prompt_embeds_mask is not None
        solo = engine.generate("a dog on the street", cfg.replace(seed=cfg.seed + j))
        torch.testing.assert_close(out.all_latents, solo.all_latents, atol=ATOL, rtol=0)
    # Guidance changes the result (the uncond rows are really used).
    plain = engine.generate("a dog on the street", params)
    assert (plain.all_latents[-1] - outs[0].all_latents[-1]).abs().max() > 1e-3


def test_explicit_and_drawn_windows(engine, params):
    out = engine.generate("a cat", params.replace(sde_window=(2, 4)))
    assert out.sde_window == (2, 4) and out.all_latents.shape[0] == 3
    sigmas = engine.adapter.sigmas(params.num_inference_steps, 64, 64)
    torch.testing.assert_close(out.sigmas, sigmas[2:4])
    drawn_params = params.replace(sde_window_size=2, sde_window_range=(0, 4), seed=11)
    drawn = engine.generate_batched("a cat", 8, drawn_params)
    for j, out in enumerate(drawn):  # each sample's window is its own seed's, as a single request draws it
        start, end = out.sde_window
        assert end - start == 2 and 0 <= start and end <= 4
        assert engine.generate("a cat", drawn_params.replace(seed=11 + j)).sde_window == out.sde_window
    assert len({o.sde_window for o in drawn}) > 1  # 8 seeds over 3 possible windows


def test_ode_sampling_is_deterministic_and_has_no_logprobs(engine, params):
    ode = params.replace(noise_level=0.0, logprobs=False)
    a = engine.generate("a cat", ode.replace(seed=1))
    b = engine.generate("a cat", ode.replace(seed=1))
    assert a.all_log_probs is None
    torch.testing.assert_close(a.all_latents, b.all_latents, atol=0, rtol=0)


def test_async_api_from_many_coroutines(engine, params):
    prompts = ["a cat", "a dog", "a red sign", "blue poster"]

    async def main():
        singles = [engine.generate_async(p, params.replace(seed=100 + i)) for i, p in enumerate(prompts)]
        group = engine.generate_batched_async("hello world", 2, params.replace(seed=7))
        return await asyncio.gather(*singles, group)

    engine.reset_stats()
    *singles, group = asyncio.run(main())
    assert [o.prompt for o in singles] == prompts and len(group) == 2
    assert max(engine.stats()["rows_per_forward_hist"]) > 1  # they shared forwards
    solo = engine.generate("a dog", params.replace(seed=101))
    torch.testing.assert_close(singles[1].all_latents, solo.all_latents, atol=ATOL, rtol=0)


def test_generate_list_of_prompts(engine, params):
    outs = engine.generate(["a cat", "a dog"], params)
    assert [o.prompt for o in outs] == ["a cat", "a dog"]
    assert [o.seed for o in outs] == [params.seed, params.seed + 1]


def test_prompt_is_encoded_once(engine, params):
    engine.reset_stats()
    engine.generate_batched("a blue street poster with the word open", 5, params)
    engine.generate("a blue street poster with the word open", params)
    stats = engine.stats()
    assert stats["num_prompt_encodes"] <= 1  # 0 if an earlier test encoded it already
    assert stats["num_prompt_cache_hits"] >= 1


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance"])
def test_sde_types_produce_finite_logprobs(engine, params, sde_type):
    out = engine.generate("a cat", params.replace(sde_type=sde_type, noise_level=0.5))
    assert torch.isfinite(out.all_log_probs).all()


def test_deterministic_request_without_logprobs_keeps_only_the_final_latent(engine, params):
    """An ODE request that scores nothing has no window: the final latent alone (what the
    forward-process algorithms train on), the same image as the ODE with its trajectory kept."""
    ode = params.replace(noise_level=0.0, logprobs=False)
    final_only = engine.generate("a cat", ode)
    assert final_only.sde_window == (ode.num_inference_steps, ode.num_inference_steps)
    assert final_only.all_latents.shape[0] == 1 and final_only.sigmas.numel() == 0
    with_trajectory = engine.generate("a cat", ode.replace(sde_window=(0, 2)))
    assert with_trajectory.all_latents.shape[0] == 3
    assert torch.equal(final_only.image, with_trajectory.image)  # decoded from the same final latent

"""Properties of the shared sampler math: ODE limit, log-prob formula, rollout/trainer parity."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl import sampler


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance"])
def test_noise_level_zero_is_the_euler_ode_step(sde_type):
    x, v, eps = rand(3, 4, 5, seed=1), rand(3, 4, 5, seed=2), rand(3, 4, 5, seed=3)
    s = torch.tensor([1.0, 0.6, 0.3])
    s_next = torch.tensor([0.8, 0.3, 0.0])
    out = sampler.sde_step(x, v, s, s_next, 0.0, sde_type, noise=eps, sigma_first_step=torch.full((3,), 0.8))
    expected = x + v * (s_next - s).view(-1, 1, 1)
    torch.testing.assert_close(out.next_latents, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(sampler.ode_step(x, v, s, s_next), expected, atol=1e-6, rtol=0)
    assert torch.isfinite(out.next_latents).all()


def test_sde_logprob_matches_torch_normal():
    x, v, eps = rand(4, 2, 3, 3, seed=4), rand(4, 2, 3, 3, seed=5), rand(4, 2, 3, 3, seed=6)
    s = torch.tensor([0.9, 0.7, 0.5, 0.2])
    s_next = torch.tensor([0.7, 0.5, 0.2, 0.05])
    a = torch.tensor([0.7, 0.7, 1.2, 0.3])
    out = sampler.sde_step(x, v, s, s_next, a, "sde", noise=eps)
    std = out.std.view(-1, 1, 1, 1)
    reference = torch.distributions.Normal(out.mean, std).log_prob(out.next_latents).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, reference, atol=1e-5, rtol=1e-6)
    # And the std is the Flow-GRPO one: a * sqrt(s / (1 - s)) * sqrt(-dt).
    expected_std = a * torch.sqrt(s / (1 - s)) * torch.sqrt(s - s_next)
    torch.testing.assert_close(out.std, expected_std)


def test_sde_mean_formula_by_hand():
    x, v = torch.tensor([[0.5, -1.0]]), torch.tensor([[2.0, 0.25]])
    s, s_next, a = 0.6, 0.4, 0.7
    out = sampler.sde_step(x, v, torch.tensor([s]), torch.tensor([s_next]), a, "sde", noise=torch.zeros(1, 2))
    dt = s_next - s
    std_t = a * math.sqrt(s / (1 - s))
    mean = x + v * dt + (std_t**2 / (2 * s)) * (x + (1 - s) * v) * dt
    torch.testing.assert_close(out.next_latents, mean)


def test_first_step_uses_sigma_one_in_the_denominator():
    x, v, eps = rand(1, 8, seed=7), rand(1, 8, seed=8), rand(1, 8, seed=9)
    out = sampler.sde_step(x, v, torch.tensor([1.0]), torch.tensor([0.9]), 0.7, "sde", noise=eps, sigma_first_step=0.9)
    expected_std = 0.7 * math.sqrt(1.0 / (1 - 0.9)) * math.sqrt(0.1)
    assert abs(out.std.item() - expected_std) < 1e-5 and torch.isfinite(out.log_prob).all()


def _dance_grpo_step(v, x, eta, sigma, sigma_next, prev_sample):
    """DanceGRPO's `flux_step` (fastvideo/train_grpo_flux.py; MixGRPO's `dance_grpo_step`) for one
    row, in its own terms: the score estimate from the predicted x0, the Langevin correction of the
    Euler mean, std eta * sqrt(delta_t), and its log-prob (whose normalising terms its code drops:
    they cancel in every ratio)."""
    dsigma = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = x + dsigma * v + (-0.5 * eta**2 * score) * dsigma
    std = eta * math.sqrt(sigma - sigma_next)
    log_prob = (-((prev_sample - mean) ** 2) / (2 * std**2)).mean()
    return mean, std, log_prob


def test_dance_step_is_dance_grpos():
    """The "dance" kernel's mean and std equal DanceGRPO's, and its log-prob is that Gaussian's
    with the normaliser: DanceGRPO's (constants dropped) plus -log(std) - log sqrt(2 pi)."""
    x, v, eps = rand(4, 2, 3, 3, seed=30), rand(4, 2, 3, 3, seed=31), rand(4, 2, 3, 3, seed=32)
    s = torch.tensor([1.0, 0.8, 0.45, 0.2])  # sigma 1 included: dance needs no sigma_1 substitute
    s_next = torch.tensor([0.8, 0.45, 0.2, 0.05])
    eta = 0.3
    out = sampler.sde_step(x, v, s, s_next, eta, "dance", noise=eps)
    for row in range(4):
        mean, std, log_prob = _dance_grpo_step(
            v[row], x[row], eta, float(s[row]), float(s_next[row]), out.next_latents[row]
        )
        torch.testing.assert_close(out.mean[row], mean, atol=1e-6, rtol=0)
        assert abs(float(out.std[row]) - std) < 1e-6
        normaliser = -math.log(std) - 0.5 * math.log(2 * math.pi)
        assert abs(float(out.log_prob[row]) - (float(log_prob) + normaliser)) < 1e-5
        torch.testing.assert_close(out.next_latents[row], mean + std * eps[row], atol=1e-6, rtol=0)
    assert torch.equal(out.kl_std, torch.full((4,), eta))  # the KL divides by the constant eta
    reference = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1)).log_prob(out.next_latents)
    torch.testing.assert_close(out.log_prob, reference.mean(dim=(1, 2, 3)), atol=1e-5, rtol=1e-6)


def test_cps_logprob_is_negative_squared_distance():
    x, v, eps = rand(2, 6, seed=10), rand(2, 6, seed=11), rand(2, 6, seed=12)
    s, s_next = torch.tensor([0.8, 0.5]), torch.tensor([0.6, 0.2])
    out = sampler.sde_step(x, v, s, s_next, 0.8, "cps", noise=eps)
    std = s_next * math.sin(0.8 * math.pi / 2)
    torch.testing.assert_close(out.std, std)
    torch.testing.assert_close(out.log_prob, -((out.next_latents - out.mean) ** 2).mean(dim=1))


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance"])
def test_scoring_a_sampled_latent_reproduces_its_logprob(sde_type):
    """The trainer path (next_latents=) gives the rollout path's log-prob for the same numbers."""
    x, v, eps = rand(3, 16, seed=13), rand(3, 16, seed=14), rand(3, 16, seed=15)
    s, s_next = torch.tensor([0.9, 0.6, 0.4]), torch.tensor([0.6, 0.4, 0.1])
    rollout = sampler.sde_step(x, v, s, s_next, 0.7, sde_type, noise=eps)
    trainer = sampler.sde_step(x, v, s, s_next, 0.7, sde_type, next_latents=rollout.next_latents)
    torch.testing.assert_close(trainer.log_prob, rollout.log_prob, atol=1e-6, rtol=0)


def test_rows_are_independent_of_batch_mates():
    x, v, eps = rand(5, 32, seed=16), rand(5, 32, seed=17), rand(5, 32, seed=18)
    s, s_next = torch.linspace(0.9, 0.5, 5), torch.linspace(0.7, 0.3, 5)
    batched = sampler.sde_step(x, v, s, s_next, 0.7, "sde", noise=eps)
    for i in range(5):
        single = sampler.sde_step(
            x[i : i + 1], v[i : i + 1], s[i : i + 1], s_next[i : i + 1], 0.7, "sde", noise=eps[i : i + 1]
        )
        torch.testing.assert_close(single.next_latents[0], batched.next_latents[i], atol=0, rtol=0)
        torch.testing.assert_close(single.log_prob[0], batched.log_prob[i], atol=1e-7, rtol=0)


def test_kl_is_zero_for_equal_means_and_positive_otherwise():
    x, v = rand(2, 10, seed=19), rand(2, 10, seed=20)
    step = sampler.sde_step(x, v, torch.tensor([0.8, 0.5]), torch.tensor([0.6, 0.3]), 0.7, "sde", noise=x)
    assert torch.equal(sampler.kl_to_reference(step, step.mean), torch.zeros(2))
    kl = sampler.kl_to_reference(step, step.mean + 0.1)
    torch.testing.assert_close(kl, 0.01 / (2 * step.kl_std**2))


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_kl_std_is_the_references(sde_type):
    """The KL divides by Flow-GRPO's std: for "sde" the diffusion coefficient a * sqrt(s / (1 - s))
    (sigma_1 in place of s = 1), without the step's sqrt(-dt); for "cps" the transition std."""
    x, v = rand(3, 6, seed=21), rand(3, 6, seed=22)
    s, s_next, a = torch.tensor([1.0, 0.7, 0.4]), torch.tensor([0.85, 0.4, 0.1]), 0.7
    step = sampler.sde_step(x, v, s, s_next, a, sde_type, noise=x, sigma_first_step=torch.full((3,), 0.85))
    if sde_type == "sde":
        s_den = torch.tensor([0.85, 0.7, 0.4])
        torch.testing.assert_close(step.kl_std, a * torch.sqrt(s / (1 - s_den)))
        torch.testing.assert_close(step.std, step.kl_std * torch.sqrt(s - s_next))
    else:
        torch.testing.assert_close(step.kl_std, step.std)


def test_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="sde_type"):
        sampler.sde_step(x, x, torch.ones(1), torch.zeros(1), 0.5, "euler", noise=x)
    with pytest.raises(ValueError, match="exactly one"):
        sampler.sde_step(x, x, torch.ones(1), torch.zeros(1), 0.5, "sde")


def test_window_draw_is_inside_the_range():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        start, end = sampler.draw_sde_window(10, 2, (0, 5), gen)
        assert end - start == 2 and 0 <= start and end <= 5
    assert sampler.default_sde_window(10) == (0, 9)

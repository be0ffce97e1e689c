"""algorithm.policy_loss's objectives against independent implementations of their references:
GRPO-Guard's RatioNorm and gradient reweight as verl-omni's GRPOGuardLoss writes them (and
Flow-Factory's per-row ratio), Flow-DPPO's drop rule as verl-omni's FlowDPPOLoss writes them; each
from Gaussian log-probs built here, not by flowrl.sampler."""

import math

import pytest
import torch

from flowrl.trainer.loss import clipped_policy_loss
from flowrl.trainer.objectives import dppo_drop, ratio_norm


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _transitions(std, seed=0, drift=0.05):
    """Rows of one step: old and new Gaussian means (B, 4, 6), the next latents drawn from the old
    policy's Gaussian, and both policies' log-probs (Flow-GRPO's: normalised, mean over elements)."""
    rows = std.shape[0]
    old_mean = _rand(rows, 4, 6, seed=seed)
    mean = old_mean + drift * _rand(rows, 4, 6, seed=seed + 1)
    eps = _rand(rows, 4, 6, seed=seed + 2)
    nxt = old_mean + std.view(-1, 1, 1) * eps

    def log_prob(mu):
        s = std.view(-1, 1, 1)
        return (-((nxt - mu) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2))

    return mean, old_mean, eps, log_prob(mean), log_prob(old_mean)


def _verl_omni_guard(old_log_prob, log_prob, advantages, old_mean, mean, std_dev_t, sqrt_dt, clip):
    """verl-omni diffusion_algos.py GRPOGuardLoss.compute_loss, restated."""
    sigma_t = std_dev_t.mean()
    sqrt_dt_mean = sqrt_dt.mean()
    scale = sqrt_dt_mean * sigma_t
    mean_diff_sq = (mean - old_mean).pow(2).mean(dim=(1, 2))
    ratio = torch.exp((log_prob - old_log_prob + mean_diff_sq / (2 * scale**2)) * scale)
    per_elem = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip))
    return torch.mean(per_elem) / sqrt_dt_mean**2, ratio


def test_ratio_norm_is_verl_omnis_on_one_step():
    """Rows at one step (verl-omni's per-micro-batch scale is then each row's own)."""
    rows, dt, eta = 6, 0.1, 0.7
    std_dev_t = torch.full((rows,), eta * math.sqrt(0.6 / 0.4))  # Flow-GRPO's diffusion coefficient
    sqrt_dt = torch.full((rows,), math.sqrt(dt))
    std = std_dev_t * sqrt_dt
    mean, old_mean, eps, log_prob, old_log_prob = _transitions(std, seed=1, drift=0.02)
    advantages = torch.tensor([1.5, -0.5, 0.8, -2.0, 0.3, -1.0], dtype=torch.float64)
    clip = 2e-3
    expected_loss, expected_ratio = _verl_omni_guard(
        old_log_prob, log_prob, advantages, old_mean, mean, std_dev_t, sqrt_dt, clip
    )
    out = ratio_norm(log_prob, old_log_prob, mean, old_mean, std, torch.full((rows,), dt), advantages, clip)
    assert torch.allclose(out.ratio, expected_ratio, atol=1e-9, rtol=0)
    assert abs(float(out.terms.mean()) - float(expected_loss)) < 1e-6
    assert 0 < int(out.acted.sum()) < rows  # both sides of the clip are exercised
    # RatioNorm's property: the ratio is exp(mean(eps * (mu - mu_old))), whatever the noise scale.
    torch.testing.assert_close(out.ratio, torch.exp((eps * (mean - old_mean)).mean(dim=(1, 2))))


def test_ratio_norm_per_row_is_flow_factorys():
    """Rows at different steps: each row's ratio uses its own transition std, as Flow-Factory's
    GRPOGuardTrainer writes it: exp(dlogp * s + mse / (2 s))."""
    std = torch.tensor([0.5, 0.2, 0.05, 0.01], dtype=torch.float64)
    mean, old_mean, _, log_prob, old_log_prob = _transitions(std, seed=5, drift=0.01)
    mse = (mean - old_mean).pow(2).mean(dim=(1, 2))
    expected = torch.exp((log_prob - old_log_prob) * std + mse / (2 * std))
    neg_dt = torch.tensor([0.2, 0.1, 0.05, 0.02], dtype=torch.float64)
    advantages = torch.ones(4, dtype=torch.float64)
    out = ratio_norm(log_prob, old_log_prob, mean, old_mean, std, neg_dt, advantages, 1.0)
    assert torch.allclose(out.ratio, expected, atol=1e-9, rtol=0)
    torch.testing.assert_close(out.terms, -expected / neg_dt)  # unclipped at clip 1: -A * ratio / (-dt)


def _verl_omni_dppo(old_log_prob, log_prob, advantages, old_mean, mean, std_dev_t, sqrt_dt, tau):
    """verl-omni diffusion_algos.py FlowDPPOLoss.compute_loss, restated (add_kl_coefficient on)."""
    ratio = torch.exp(log_prob - old_log_prob)
    sigma_t = (std_dev_t * sqrt_dt).view(-1, 1, 1)
    kl = ((mean - old_mean).pow(2) / (2 * sigma_t.pow(2))).mean(dim=(1, 2))
    high = kl >= tau
    remove = (high & (ratio > 1.0) & (advantages > 0)) | (high & (ratio < 1.0) & (advantages < 0))
    per_elem = torch.where(~remove, -advantages * ratio, torch.zeros(()))
    return per_elem.mean(), remove, kl


def test_dppo_drop_rule_is_verl_omnis():
    rows = 8
    std_dev_t = torch.linspace(0.5, 1.5, rows, dtype=torch.float64)
    sqrt_dt = torch.linspace(0.2, 0.4, rows, dtype=torch.float64)
    std = std_dev_t * sqrt_dt
    # Every other row drifts far (divergence past tau), and the ratios move either way of 1.
    mean, old_mean, _, _, old_log_prob = _transitions(std, seed=9, drift=0.05)
    far = torch.tensor([1.0, 0.0] * (rows // 2), dtype=torch.float64).view(-1, 1, 1)
    mean = mean + far * 0.3 * _rand(rows, 4, 6, seed=12)
    log_prob = old_log_prob + 0.1 * _rand(rows, seed=13)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -2.0, 0.5, -0.5], dtype=torch.float64)
    tau = 1e-2
    expected_loss, expected_dropped, expected_kl = _verl_omni_dppo(
        old_log_prob, log_prob, advantages, old_mean, mean, std_dev_t, sqrt_dt, tau
    )
    out = dppo_drop(log_prob, old_log_prob, mean, old_mean, std, advantages, tau)
    assert torch.equal(out.acted, expected_dropped)
    assert 0 < int(out.acted.sum()) < int((expected_kl >= tau).sum())  # corrective far rows are kept
    assert abs(float(out.terms.mean()) - float(expected_loss)) < 1e-6
    torch.testing.assert_close(out.divergence, expected_kl)


def test_guard_through_the_loss_takes_the_row_weights_and_normalizer():
    """The objective's terms go through the loss as the clipped ones do: weighted, normalised."""
    std = torch.full((3,), 0.3)
    mean, old_mean, _, log_prob, old_log_prob = _transitions(std.double(), seed=20)
    mean, old_mean, log_prob, old_log_prob = (t.float() for t in (mean, old_mean, log_prob, old_log_prob))
    advantages, neg_dt = torch.tensor([1.0, -1.0, 2.0]), torch.full((3,), 0.1)
    weights = torch.tensor([1.0, 0.0, 1.0])
    surrogate = ratio_norm(log_prob, old_log_prob, mean, old_mean, std, neg_dt, advantages, 1e-3)
    out = clipped_policy_loss(
        log_prob, old_log_prob, advantages, 1e-3, weights=weights, normalizer=4.0, surrogate=surrogate
    )
    assert float(out.loss) == pytest.approx(float((surrogate.terms * weights).sum()) / 4.0, rel=1e-6)
    assert float(out.clipfrac) == pytest.approx(float(surrogate.acted[[0, 2]].float().mean()))
    assert float(out.divergence) == pytest.approx(float(surrogate.divergence[[0, 2]].mean()), rel=1e-6)

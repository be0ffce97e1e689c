"""AWM (flowrl.trainer.awm): its surrogate log-prob, clipped loss and KL terms equal the
reference's formulas, its rollouts are the trained weights', an update starts at ratio 1, resume
keeps its EMA policy, and its settings are refused elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
from resume_runs import assert_resumed_as_straight

from flowrl.trainer.awm_loss import awm_advantages, awm_policy_loss, surrogate_log_prob

AWM = (
    "algorithm.name=awm",
    "rollout.sampling.noise_level=0.0",
    "rollout.sampling.logprobs=false",
    "rollout.n=3",
    "trainer.prompts_per_step=2",
    "trainer.micro_batch_size=2",
    "trainer.lr=0.01",
    "algorithm.train_timestep_fraction=0.5",
    "algorithm.clip_range=1.0",
)


def _reference_log_prob(model_output, noise, clean, timestep, weighting, power):
    """scxue/advantage_weighted_matching compute_log_prob_awm's weighting, from its formula."""
    log_prob = -((model_output.double() - (noise.double() - clean.double())) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = timestep.view(-1).double()
    if weighting == "t":
        return log_prob * t
    if weighting == "t2":
        return log_prob * t**2
    if weighting == "uniform":
        return log_prob
    if weighting == "huber":
        return -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    return -(torch.pow(-log_prob + 1e-10, power) - math.pow(1e-10, power)) * t / power


@pytest.mark.parametrize("weighting", ["ghuber", "uniform", "t", "t2", "huber"])
def test_surrogate_log_prob_equals_the_reference(weighting):
    g = torch.Generator().manual_seed(1)
    v, noise, x0 = (torch.randn(4, 3, 5, 5, generator=g) for _ in range(3))
    t = torch.rand(4, generator=g)
    ours = surrogate_log_prob(v, x0, noise, t, weighting, 0.25)
    torch.testing.assert_close(ours, _reference_log_prob(v, noise, x0, t, weighting, 0.25), rtol=1e-9, atol=1e-12)


def test_policy_loss_and_its_gradient_equal_the_reference():
    """The reference's loss over a batch: clamp, rescale, PPO's clip on exp(logp - logp_old),
    the mean of the max, plus the two velocity KLs."""
    g = torch.Generator().manual_seed(2)
    v0 = torch.randn(6, 3, 4, 4, generator=g)
    noise, x0, v_ref, v_ema = (torch.randn(6, 3, 4, 4, generator=g) for _ in range(4))
    t = torch.rand(6, generator=g)
    adv = torch.randn(6, generator=g) * 4
    v_start = v0 + 0.05 * torch.randn(6, 3, 4, 4, generator=g)  # the update's starting weights differ
    clip, beta, ema_beta = 0.2, 0.003, 1.0

    v_a = v0.clone().requires_grad_(True)
    lp = surrogate_log_prob(v_a, x0, noise, t, "ghuber", 0.25)
    old = surrogate_log_prob(v_start, x0, noise, t, "ghuber", 0.25)
    policy, ratio, clipped = awm_policy_loss(lp, old, awm_advantages(adv.double(), 5.0, 1.0), clip)
    kl = ((v_a - v_ref) ** 2).mean(dim=(1, 2, 3))
    ema_kl = ((v_a - v_ema) ** 2).mean(dim=(1, 2, 3))
    ours = (policy.float() + beta * kl + ema_beta * ema_kl).mean()
    ours.backward()

    v_b = v0.clone().requires_grad_(True)
    a = torch.clamp(adv, -5.0, 5.0) / 5.0 * 1.0
    r = torch.exp(
        _reference_log_prob(v_b, noise, x0, t, "ghuber", 0.25)
        - _reference_log_prob(v_start, noise, x0, t, "ghuber", 0.25)
    )
    policy_ref = torch.mean(torch.maximum(-a * r, -a * torch.clamp(r, 1 - clip, 1 + clip)))
    ref = (
        policy_ref
        + beta * ((v_b - v_ref) ** 2).mean(dim=(1, 2, 3)).mean()
        + ema_beta * ((v_b - v_ema) ** 2).mean(dim=(1, 2, 3)).mean()
    )
    ref.backward()
    assert abs(float(ours.detach()) - float(ref.detach())) < 1e-6
    torch.testing.assert_close(v_a.grad, v_b.grad, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(clipped, (r.detach() - 1).abs() > clip)


def test_a_run_is_on_policy_and_resumes_with_its_ema_policy(build_trainer, make_cfg):
    small = (
        *AWM,
        "trainer.lora.enabled=true",
        "trainer.lora.rank=4",
        "algorithm.kl_beta=0.01",
        "trainer.updates_per_step=2",
        "algorithm.awm.ema_decay_rate=0.3",
        "algorithm.awm.ema_decay_max=0.6",
    )
    keys = ("reward/mean", "actor/policy_loss", "actor/kl", "actor/ema_kl", "actor/grad_norm", "actor/ratio")
    a = assert_resumed_as_straight(build_trainer, make_cfg, small, keys, ("trainable", "ema_policy"))
    assert a[-1]["actor/ema_kl"] > 0 and a[-1]["actor/ratio"] != 1.0  # the second optimizer step moved


def test_the_first_optimizer_step_has_ratio_one(build_trainer, make_cfg):
    trainer = build_trainer(make_cfg(*AWM, "trainer.total_steps=1"))
    metrics = trainer.train_step()
    assert metrics["actor/ratio"] == pytest.approx(1.0, abs=1e-9) and metrics["actor/clipfrac"] == 0.0


def test_its_settings_are_refused_for_other_algorithms(make_cfg):
    with pytest.raises(ValueError, match=r"algorithm\.awm\.ghuber_power=0\.5 is a setting of algorithm\.name=awm"):
        make_cfg("algorithm.awm.ghuber_power=0.5")
    with pytest.raises(
        ValueError, match=r"algorithm\.clip_range=0\.2 is a setting of algorithm\.name=flow_grpo or awm"
    ):
        make_cfg(
            "algorithm.name=diffusion_nft",
            "rollout.sampling.noise_level=0",
            "rollout.sampling.logprobs=false",
            "algorithm.clip_range=0.2",
        )

"""Clipped PPO loss against hand-computed values, including both clipping sides and weights."""

import math

import pytest
import torch

from flowrl.trainer.loss import clipped_policy_loss


def test_unclipped_ratio_one_gives_minus_mean_advantage():
    logp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    out = clipped_policy_loss(logp, logp.detach().clone(), adv, clip_range=0.2)
    assert float(out.policy_loss) == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    assert float(out.ratio_mean) == 1.0 and float(out.ratio_max) == 1.0
    assert float(out.clipfrac) == 0.0 and float(out.approx_kl) == 0.0
    out.loss.backward()
    # d/dlogp of mean(-A * exp(logp - old)) at ratio 1 = -A / B
    torch.testing.assert_close(logp.grad, -adv / 3)


def test_clipping_hand_computed():
    eps = 0.1
    old = torch.zeros(4)
    # ratios: 1.5 (A>0: clipped to 1.1), 0.5 (A>0: unclipped wins, 0.5), 1.5 (A<0: unclipped wins), 0.5 (A<0: clipped 0.9)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5])).requires_grad_(True)
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0])
    out = clipped_policy_loss(logp, old, adv, clip_range=eps)
    per_row = [-2.0 * 1.1, -2.0 * 0.5, 1.0 * 1.5, 1.0 * 0.9]
    assert float(out.policy_loss) == pytest.approx(sum(per_row) / 4, rel=1e-6)
    assert float(out.clipfrac) == 1.0
    assert float(out.ratio_max) == pytest.approx(1.5) and float(out.ratio_mean) == pytest.approx(1.0)
    expected_kl = 0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4
    assert float(out.approx_kl) == pytest.approx(expected_kl, rel=1e-6)
    out.loss.backward()
    # clipped rows have no gradient; unclipped ones get -A * ratio / B
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -2.0 * 0.5 / 4, 1.0 * 1.5 / 4, 0.0]))


def test_weights_exclude_rows_and_kl_adds_beta_times_mean():
    logp = torch.tensor([0.0, 0.0, 0.0])
    adv = torch.tensor([1.0, 3.0, 100.0])
    weights = torch.tensor([1.0, 1.0, 0.0])
    kl = torch.tensor([0.2, 0.4, 50.0])
    out = clipped_policy_loss(logp, logp, adv, clip_range=1e-4, kl=kl, kl_beta=0.5, weights=weights)
    assert float(out.policy_loss) == pytest.approx(-2.0)
    assert float(out.kl) == pytest.approx(0.3)
    assert float(out.loss) == pytest.approx(-2.0 + 0.5 * 0.3)
    assert out.num_rows == 2


def test_no_counted_row_gives_the_on_policy_metrics():
    logp = torch.tensor([0.5, -0.5], requires_grad=True)
    out = clipped_policy_loss(logp, torch.zeros(2), torch.ones(2), clip_range=1e-4, weights=torch.zeros(2))
    assert out.num_rows == 0 and float(out.loss) == 0.0
    assert float(out.ratio_mean) == 1.0 and float(out.ratio_max) == 1.0
    assert float(out.clipfrac) == 0.0 and float(out.approx_kl) == 0.0


def test_metrics_count_only_weighted_rows():
    """An excluded row's far-off ratio moves none of the metrics (means over counted rows)."""
    logp = torch.log(torch.tensor([1.2, 0.9, 50.0]))
    out = clipped_policy_loss(
        logp, torch.zeros(3), torch.ones(3), clip_range=0.15, weights=torch.tensor([1.0, 1.0, 0.0])
    )
    assert out.num_rows == 2
    assert float(out.ratio_max) == pytest.approx(1.2) and float(out.ratio_mean) == pytest.approx(1.05)
    assert float(out.clipfrac) == pytest.approx(0.5)
    assert float(out.approx_kl) == pytest.approx(0.25 * (math.log(1.2) ** 2 + math.log(0.9) ** 2), rel=1e-6)


def test_clip_range_must_be_positive():
    with pytest.raises(ValueError, match="clip_range"):
        clipped_policy_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), clip_range=0.0)

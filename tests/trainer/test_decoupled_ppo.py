"""Decoupled PPO (AReaL, arXiv 2505.24298, eq. 5, with verl's truncated behaviour weight) for rows
drawn by older weights than the update starts from: the loss equals an independent implementation
of the formula, rows of the current weights train exactly as plain PPO, and a stale batch's clip
acts as on an on-policy one (centred on the update's starting weights) where centring it on the
behaviour policy would clip nearly every pair."""

import numpy as np
import torch

from flowrl.trainer.loss import clipped_policy_loss
from flowrl.trainer.plan import Forward

CLIP = 1e-4
CAP = 2.0


def _decoupled_reference(log_prob, prox, behaviour, adv, clip, cap, weights, normalizer):
    """The objective in float64 numpy, written from the paper's formula: per pair
    min(pi_prox / pi_behav, cap) * max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = pi / pi_prox,
    summed with the row weights over the normalizer; and its gradient in log_prob."""
    lp, px, bh, a = (np.asarray(x, dtype=np.float64) for x in (log_prob, prox, behaviour, adv))
    r = np.exp(lp - px)
    w = np.minimum(np.exp(px - bh), cap)
    unclipped, clipped = -a * r, -a * np.clip(r, 1 - clip, 1 + clip)
    loss = float(np.sum(w * np.maximum(unclipped, clipped) * weights) / normalizer)
    # d/dlp: the unclipped branch's -A r where it is the larger (or the ratio is inside the range).
    active = (unclipped > clipped) | (np.abs(r - 1) <= clip)
    grad = np.where(active, w * unclipped, 0.0) * weights / normalizer
    return loss, grad, w


def test_loss_equals_the_decoupled_formula_and_fresh_rows_are_plain_ppo():
    gen = torch.Generator().manual_seed(0)
    n = 64
    prox = torch.randn(n, generator=gen, dtype=torch.float64) * 0.1
    log_prob = (prox + torch.randn(n, generator=gen, dtype=torch.float64) * 3e-4).requires_grad_(True)
    behaviour = prox + torch.randn(n, generator=gen, dtype=torch.float64) * 0.5  # far: many weights capped
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    weights = (torch.rand(n, generator=gen) > 0.2).double()
    out = clipped_policy_loss(
        log_prob,
        prox,
        adv,
        CLIP,
        weights=weights,
        normalizer=50.0,
        behaviour_log_prob=behaviour,
        behaviour_weight_cap=CAP,
    )
    out.loss.backward()
    loss, grad, w = _decoupled_reference(
        log_prob.detach(), prox, behaviour, adv, CLIP, CAP, weights.numpy(), normalizer=50.0
    )
    assert abs(float(out.loss.detach()) - loss) < 1e-6
    np.testing.assert_allclose(log_prob.grad.numpy(), grad, atol=1e-6, rtol=0)
    counted = weights.numpy() > 0
    assert abs(float(out.behaviour_weight) - w[counted].mean()) < 1e-6
    assert abs(float(out.behaviour_capped) - (w[counted] >= CAP).mean()) < 1e-6
    assert 0 < float(out.behaviour_capped) < 1  # the cap acted on some pairs, not all
    # A row drawn by the proximal weights passes its own denominator: weight exactly 1, plain PPO.
    lp = log_prob.detach().float().requires_grad_(True)
    plain = clipped_policy_loss(lp, prox.float(), adv.float(), CLIP, weights=weights.float(), normalizer=50.0)
    fresh = clipped_policy_loss(
        lp, prox.float(), adv.float(), CLIP, weights=weights.float(), normalizer=50.0, behaviour_log_prob=prox.float()
    )
    assert torch.equal(plain.loss, fresh.loss) and abs(float(fresh.behaviour_weight) - 1.0) < 1e-6


def _log_probs(trainer, tensors, specs, train_steps):
    """(N, K) log-probs of every row with the current weights, scored as the update's forwards."""
    updater = trainer.algorithm.updater
    rows = torch.arange(train_steps.shape[0])
    return torch.stack(
        [
            updater.score_no_grad(tensors, Forward(rows, k, train_steps[:, k], list(specs))).log_prob.float()
            for k in range(train_steps.shape[1])
        ],
        dim=1,
    )


def test_a_stale_batch_trains_with_the_decoupled_objective_and_a_comparable_clip(
    build_trainer, make_cfg, take_rollout, monkeypatch
):
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=4",
            "trainer.updates_per_step=2",
            "trainer.micro_batch_size=4",
            "trainer.lora.enabled=true",
            "trainer.lr=0.01",
            "algorithm.old_log_prob=recompute",
            f"algorithm.clip_range={CLIP}",
            f"algorithm.behaviour_weight_cap={CAP}",
        )
    )
    updater = trainer.algorithm.updater
    tensors, specs = take_rollout(trainer)  # drawn by version 0
    advantages = torch.linspace(-1.5, 1.5, 8)
    versions = np.zeros(8, dtype=np.int64)
    on_policy = updater.prepare_and_update(tensors, specs, advantages, torch.ones(8), step=1, policy_versions=versions)
    assert "actor/behaviour_weight_mean" not in on_policy  # version 0 drew them: plain PPO
    assert updater.num_optimizer_steps == 2

    # The same rows again, now two optimizer steps stale.
    plan = updater.plan(tensors, specs, step=2)
    mini_batches = [torch.cat(step) for step in plan.optimizer_steps]
    prox = _log_probs(trainer, tensors, specs, plan.train_steps)  # the weights the update starts from
    behaviour = tensors["all_log_probs"].gather(1, plan.train_steps).float()
    behaviour_clipped = float(((torch.exp(prox - behaviour) - 1).abs() > CLIP).float().mean())
    direct = {}
    original = updater._optimizer_step

    def on_step():
        index = len(direct)
        rows = mini_batches[index]
        now = _log_probs(trainer, tensors, specs, plan.train_steps)[rows]
        ref_loss, _, w = _decoupled_reference(
            now, prox[rows], behaviour[rows], advantages[rows, None], CLIP, CAP, 1.0, now.numel()
        )
        ratio = torch.exp(now - prox[rows])
        direct[index] = (ref_loss, float(((ratio - 1).abs() > CLIP).float().mean()), w)
        return original()

    monkeypatch.setattr(updater, "_optimizer_step", on_step)
    stale = updater.prepare_and_update(tensors, specs, advantages, torch.ones(8), step=2, policy_versions=versions)
    first, second = updater.records
    for index, record in enumerate((first, second)):
        assert abs(record.loss - direct[index][0]) < 1e-6, (index, record.loss, direct[index][0])
        assert abs(record.clipfrac - direct[index][1]) < 1e-6
    weights = np.concatenate([direct[i][2].ravel() for i in (0, 1)])
    assert abs(stale["actor/behaviour_weight_mean"] - weights.mean()) < 1e-5
    # The clip is centred on the update's starting weights: none clipped at the first optimizer step,
    # the second's share like an on-policy update's; centred on the behaviour policy (rollout
    # log-probs as denominators) many pairs would start outside the clip range (more, the staler).
    assert stale["actor/clipfrac_first_step"] == 0.0 == on_policy["actor/clipfrac_first_step"]
    assert stale["actor/clipfrac"] == stale["actor/clipfrac_step_2"] == second.clipfrac
    assert 0 < stale["actor/clipfrac"] <= 1.0 and 0 < on_policy["actor/clipfrac"]
    assert abs(stale["actor/clipfrac"] - on_policy["actor/clipfrac"]) <= 0.25
    assert behaviour_clipped >= 0.25  # 0.375 here (the on-policy run: 0.35, the stale one 0.25)

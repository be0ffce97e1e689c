"""DiffusionNFT (flowrl.trainer.diffusion_nft): its loss and old-policy schedule equal the
reference's formulas, its rollouts come from the old policy exactly, an update's gradient is the
mean of the per-pair losses over the step, a resumed run equals a straight one, and settings of
other algorithms or rollouts it cannot train on are refused before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_runs import assert_resumed_as_straight

from flowrl.trainer.nft_loss import nft_loss, optimality_weight
from flowrl.trainer.scheduled_average import ScheduledAverage

NFT = (
    "algorithm.name=diffusion_nft",
    "rollout.sampling.noise_level=0.0",
    "rollout.sampling.logprobs=false",
    "rollout.n=3",
    "trainer.prompts_per_step=2",
    "trainer.micro_batch_size=2",
    "trainer.lr=0.01",
    "algorithm.train_timestep_fraction=0.5",
)


def _reference_terms(v, v_old, v_ref, x0, xt, t, adv, beta, adv_max, kl_beta):
    a = torch.clamp(adv, -adv_max, adv_max)
    r = torch.clamp(a / adv_max / 2.0 + 0.5, 0, 1)
    te = t.view(-1, 1, 1, 1)
    pos_pred = beta * v + (1 - beta) * v_old.detach()
    neg_pred = (1.0 + beta) * v_old.detach() - beta * v
    x0_pos = xt - te * pos_pred
    with torch.no_grad():
        w_pos = torch.abs(x0_pos.double() - x0.double()).mean(dim=(1, 2, 3), keepdim=True).clip(min=0.00001)
    pos_loss = ((x0_pos - x0) ** 2 / w_pos).mean(dim=(1, 2, 3))
    x0_neg = xt - te * neg_pred
    with torch.no_grad():
        w_neg = torch.abs(x0_neg.double() - x0.double()).mean(dim=(1, 2, 3), keepdim=True).clip(min=0.00001)
    neg_loss = ((x0_neg - x0) ** 2 / w_neg).mean(dim=(1, 2, 3))
    policy = ((r * pos_loss / beta + (1.0 - r) * neg_loss / beta) * adv_max).mean()
    kl = ((v - v_ref) ** 2).mean(dim=(1, 2, 3)).mean()
    return policy + kl_beta * kl


@pytest.mark.parametrize("beta,kl_beta", [(1.0, 0.0), (0.1, 1e-4), (0.5, 0.3)])
def test_loss_equals_the_reference_formula_and_its_gradient(beta, kl_beta):
    g = torch.Generator().manual_seed(3)
    shape = (5, 4, 6, 6)
    x0, noise, v_old, v_ref = (torch.randn(shape, generator=g) for _ in range(4))
    t = torch.rand(5, generator=g) * 0.9 + 0.05
    adv = torch.randn(5, generator=g) * 4  # some beyond the clamp
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    v_a = torch.randn(shape, generator=g, requires_grad=True)
    v_b = v_a.detach().clone().requires_grad_(True)
    ours = nft_loss(v_a, v_old, x0, xt, t, adv, beta, 5.0, kl_beta, v_ref if kl_beta else None).loss.mean()
    ref = _reference_terms(v_b, v_old, v_ref, x0, xt, t, adv, beta, 5.0, kl_beta)
    assert abs(float(ours.detach()) - float(ref.detach())) <= 1e-6 * max(1.0, abs(float(ref.detach())))
    ours.backward()
    ref.backward()
    torch.testing.assert_close(v_a.grad, v_b.grad, rtol=1e-6, atol=1e-9)


def test_optimality_weight_maps_the_clamped_advantage_to_zero_one():
    adv = torch.tensor([-9.0, -5.0, 0.0, 2.5, 5.0, 7.0])
    torch.testing.assert_close(optimality_weight(adv, 5.0), torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0]))


def _return_decay(step, flat, rate, uphold):
    """The reference's return_decay, from its formula."""
    return 0.0 if step < flat else min((step - flat) * rate, uphold)


@pytest.mark.parametrize("flat,rate,top", [(0, 0.001, 0.5), (75, 0.0075, 0.999), (2, 0.3, 0.8)])
def test_old_policy_follows_the_reference_schedule(flat, rate, top):
    param = torch.nn.Parameter(torch.zeros(3))
    old = ScheduledAverage({"w": param}, flat, rate, top)
    expected = torch.zeros(3, dtype=torch.float64)
    for t in range(1, 200, 7):
        with torch.no_grad():
            param.add_(torch.tensor([1.0, -2.0, 0.5]) * t / 50)
        d = _return_decay(t, flat, rate, top)
        assert old.current_decay(t) == pytest.approx(d, abs=1e-15)
        old.step(t)
        expected = expected * d + param.detach().double() * (1 - d)
        torch.testing.assert_close(old.averages["w"].double(), expected, rtol=1e-6, atol=1e-6)


def test_rollouts_come_from_the_old_policy_exactly(build_trainer, make_cfg, tiny_sd3_path):
    """After updates that move the old policy away from the trained weights, a training rollout
    equals one drawn by an engine holding the old weights alone."""
    from flowrl.engine import DiffusionEngine
    from flowrl.models import load_adapter
    from flowrl.models.lora import apply_trainable, load_trainable_state_dict

    cfg = make_cfg(*NFT, "trainer.total_steps=2", "algorithm.nft.old_decay_rate=0.4", "algorithm.nft.old_decay_max=0.9")
    trainer = build_trainer(cfg)
    trainer.fit()
    old = {name: average.clone() for name, average in trainer.algorithm.old.averages.items()}
    trained = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters() if p.requires_grad}
    assert max((old[n] - trained[n]).abs().max() for n in old) > 1e-4  # the two differ
    params = cfg.rollout.sampling.replace(seed=5)
    with trainer.rollout_weights():
        ours = trainer.engine.generate("a red circle", params)
    # The trained weights are back after the rollout.
    for n, p in trainer.adapter.transformer.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), trained[n])

    adapter = load_adapter(str(tiny_sd3_path), device="cpu", dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.trainer.seed)
        apply_trainable(adapter.transformer, cfg.trainer.lora)
    load_trainable_state_dict(adapter.transformer, old)
    engine = DiffusionEngine(adapter)
    try:
        theirs = engine.generate("a red circle", params)
    finally:
        engine.shutdown()
    torch.testing.assert_close(ours.all_latents, theirs.all_latents, rtol=0, atol=0)
    assert ours.all_latents.shape[0] == 1  # the final latent alone


def _metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if '"reward/mean"' in line]


def test_resume_equals_straight_run(build_trainer, make_cfg):
    small = (
        *NFT,
        "trainer.lora.enabled=true",
        "trainer.lora.rank=4",
        "algorithm.kl_beta=0.01",
        "trainer.updates_per_step=2",
        "algorithm.nft.old_decay_rate=0.3",
        "algorithm.nft.old_decay_max=0.9",
    )
    keys = ("reward/mean", "actor/policy_loss", "actor/kl", "actor/old_deviation", "actor/grad_norm")
    a = assert_resumed_as_straight(build_trainer, make_cfg, small, keys, ("trainable", "old_policy"))
    assert a[-1]["actor/old_deviation"] > 0  # the old policy lags the trained weights


def test_an_update_is_the_mean_of_the_pairs_losses(build_trainer, make_cfg, monkeypatch):
    """One optimizer step's gradient equals that of the mean, over every trained (sample,
    timestep) pair, of the loss computed here from the pair's noise, timestep and velocities."""
    from flowrl.engine.output import TransitionSpec
    from flowrl.trainer.forward_process import global_rows, plan_pairs, rollout_timesteps
    from flowrl.trainer.plan import seeded_generator
    from flowrl.trainer.velocity import conditional_velocity

    cfg = make_cfg(*NFT, "trainer.total_steps=1", "trainer.micro_batch_size=4")
    trainer = build_trainer(cfg)
    algo = trainer.algorithm
    grads = {}

    def on_step(original=algo.optim.step):
        grads.update(
            {
                n: p.grad.detach().clone()
                for n, p in trainer.adapter.transformer.named_parameters()
                if p.grad is not None
            }
        )
        return original()

    captured = {}
    prepare = algo.prepare

    def capture(rollout, rows, weights, step):
        captured.update(rollout=rollout, rows=rows, weights=weights, step=step)
        with torch.no_grad():
            captured["params"] = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters()}
        return prepare(rollout, rows, weights, step)

    monkeypatch.setattr(algo.optim, "step", on_step)
    monkeypatch.setattr(algo, "prepare", capture)
    trainer.fit()

    # Recompute by hand from the weights the update started from (old policy == them at step 1).
    transformer = trainer.adapter.transformer
    with torch.no_grad():
        for n, p in transformer.named_parameters():
            p.copy_(captured["params"][n])
    rollout, rows, weights, step = (captured[k] for k in ("rollout", "rows", "weights", "step"))
    tensors = {k: v for k, v in rollout.batch.items() if k != "images"}
    specs = TransitionSpec.from_columns(rollout.non_tensor_batch)
    timesteps = rollout_timesteps(trainer.adapter, specs)
    trained = rows.trained(weights.keep)
    plan = plan_pairs(timesteps, specs, trained, step, cfg.trainer, cfg.algorithm.train_timestep_fraction, False)
    glob = global_rows(trained, len(specs))
    x0 = tensors["all_latents"][:, -1]
    adv = torch.from_numpy(weights.values[rows.mine]).float()
    total, count = 0.0, 0
    transformer.zero_grad(set_to_none=True)
    transformer.train()
    for row in np.flatnonzero(glob >= 0):
        for k in range(plan.num_trained_steps):
            index = int(plan.train_steps[row, k])
            t = timesteps[row, index].view(1)
            noise = torch.randn(
                x0.shape[1:], generator=seeded_generator(cfg.trainer.seed, step, 17, 0, int(glob[row]) + 1, k)
            )
            xt = ((1 - t) * x0[row] + t * noise)[None]
            mb = {name: v[[row]] for name, v in tensors.items()}
            with torch.no_grad():
                v_old = conditional_velocity(trainer.adapter, mb, xt, t, [specs[row]])
            v = conditional_velocity(trainer.adapter, mb, xt, t, [specs[row]])
            total = total + _reference_terms(v, v_old, v_old, x0[[row]], xt, t, adv[[row]], 1.0, 5.0, 0.0)
            count += 1
    (total / count).backward()
    transformer.eval()
    assert grads
    for n, p in transformer.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("algorithm.clip_range=0.2",), "algorithm.clip_range=0.2 is a setting of algorithm.name=flow_grpo"),
        (
            ("algorithm.old_log_prob=recompute",),
            "algorithm.old_log_prob='recompute' is a setting of algorithm.name=flow_grpo",
        ),
        (("rollout.sampling.noise_level=0.7",), "rollout.sampling.noise_level=0.7: algorithm.name=diffusion_nft"),
        (("rollout.sampling.sde_window_size=2",), "rollout.sampling.sde_window_size=2"),
    ],
)
def test_settings_it_cannot_use_are_refused_before_loading(make_cfg, overrides, message):
    from flowrl.run.checks import check_before_loading

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_before_loading(make_cfg(*NFT, *overrides))


def test_nft_settings_are_refused_for_flow_grpo(make_cfg):
    with pytest.raises(ValueError, match=r"algorithm\.nft\.beta=0\.1 is a setting of algorithm\.name=diffusion_nft"):
        make_cfg("algorithm.nft.beta=0.1")


def test_cfg_rollouts_are_refused(build_trainer, make_cfg):
    with pytest.raises(ValueError, match="guidance_scale=4.5.*CFG-free"):
        build_trainer(make_cfg(*NFT, "rollout.sampling.guidance_scale=4.5"))

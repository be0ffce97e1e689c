"""FlowGRPO's variants on the tiny model: GRPO-Guard and Flow-DPPO train against the old policy's
recomputed step means, the KL on the velocity equals its formula on the model's own velocities,
the default update's metrics are unchanged, and combinations the references do not make are
refused naming the field and the fix."""

import pytest
import torch

from flowrl.models.base import PromptEncoding
from flowrl.models.lora import adapter_disabled

# The metrics of a default FlowGRPO update (recompute, two optimizer steps): no variant adds one.
DEFAULT_UPDATE_METRICS = {
    "actor/policy_loss",
    "actor/clipfrac",
    "actor/ratio_mean",
    "actor/approx_kl",
    "actor/kl",
    "actor/clipfrac_first_step",
    "actor/clipfrac_step_1",
    "actor/clipfrac_step_2",
    "actor/ratio_max",
    "actor/grad_norm",
    "actor/num_optimizer_steps",
    "actor/num_trained_steps_per_sample",
    "actor/logprob_gap_mean",
    "actor/logprob_gap_max",
    "actor/old_log_prob_early_share",
    "memory/gradient_checkpointing",
}


def _variant(make_cfg, *overrides):
    return make_cfg(
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=2",
        "trainer.updates_per_step=2",
        "algorithm.old_log_prob=recompute",
        "trainer.lr=0.05",
        *overrides,
    )


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "grpo_guard", "dppo"])
def test_variants_train_against_the_recomputed_old_means(build_trainer, make_cfg, take_rollout, policy_loss):
    overrides = [f"algorithm.policy_loss={policy_loss}"]
    if policy_loss == "dppo":
        overrides.append("algorithm.dppo_tau=1e-12")  # every moved step is past tau
    trainer = build_trainer(_variant(make_cfg, *overrides))
    updater = trainer.algorithm.updater
    tensors, specs = take_rollout(trainer)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    batch = updater.prepare(tensors, specs, advantages, step=1)
    if policy_loss == "ppo_clip":
        assert batch.old_means is None
    else:  # the recompute's means, at each recomputed row's trained steps, beside its denominators
        forwards = batch.plan.recompute_forwards()
        assert forwards
        for forward in forwards:
            expected = updater.score_no_grad(tensors, forward)
            torch.testing.assert_close(batch.old_means[forward.rows, forward.k], expected.mean, atol=1e-6, rtol=0)
            torch.testing.assert_close(batch.old[forward.rows, forward.k], expected.log_prob, atol=1e-6, rtol=0)
    metrics = updater.update(batch)
    assert metrics["actor/num_optimizer_steps"] == 2
    assert metrics["actor/clipfrac_first_step"] == 0.0  # on-policy: ratio exactly 1, nothing acted on
    assert metrics["actor/ratio_max"] != 1.0 or metrics["actor/ratio_mean"] != 1.0  # the second step's moved
    if policy_loss == "ppo_clip":
        assert set(metrics) == DEFAULT_UPDATE_METRICS
    else:
        assert set(metrics) == DEFAULT_UPDATE_METRICS | {"actor/divergence"}
        assert metrics["actor/divergence"] > 0.0  # the second step's means moved from the old ones
    if policy_loss == "dppo":
        assert metrics["actor/clipfrac_step_2"] > 0.0  # past tau, moving with the advantage: dropped


def _reference_velocity_kl(trainer, tensors, specs) -> float:
    """Mean over rows and window steps of mean((v - v_ref)^2), from adapter.velocity with the LoRA
    on and off."""
    adapter, spec = trainer.adapter, specs[0]
    num_rows, window = tensors["sigmas"].shape
    cond = [
        PromptEncoding(
            tensors["prompt_embeds"][i], tensors["prompt_embeds_mask"][i], tensors["pooled_prompt_embeds"][i]
        )
        for i in range(num_rows)
    ]
    guidance = torch.full((num_rows,), spec.guidance_scale)
    kls = []
    with torch.no_grad():
        for k in range(window):
            args = (tensors["all_latents"][:, k], tensors["sigmas"][:, k], cond, [None] * num_rows, guidance)
            v = adapter.velocity(*args, spec.height, spec.width)
            with adapter_disabled(adapter.transformer):
                v_ref = adapter.velocity(*args, spec.height, spec.width)
            kls += ((v - v_ref) ** 2).reshape(num_rows, -1).mean(dim=1).tolist()
    return sum(kls) / len(kls)


def test_velocity_kl_equals_its_formula_on_a_perturbed_lora(build_trainer, make_cfg, take_rollout):
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=2",
            "trainer.micro_batch_size=4",
            "trainer.lora.enabled=true",
            "algorithm.kl_beta=0.01",
            "algorithm.kl_type=velocity",
            "algorithm.old_log_prob=recompute",
        )
    )
    tensors, specs = take_rollout(trainer)
    with torch.no_grad():  # LoRA B starts at 0 (policy == reference): move it
        gen = torch.Generator().manual_seed(3)
        for name, p in trainer.adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    expected = _reference_velocity_kl(trainer, tensors, specs)
    metrics = trainer.algorithm.updater.prepare_and_update(
        tensors, specs, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4), step=1
    )
    assert expected > 0
    assert metrics["actor/kl"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.policy_loss=grpo_guard"], r"algorithm.old_log_prob='rollout' .*old_log_prob=recompute"),
        (["algorithm.policy_loss=dppo"], r"algorithm.old_log_prob='rollout' .*old_log_prob=recompute"),
        (
            ["algorithm.policy_loss=grpo_guard", "algorithm.old_log_prob=recompute", "rollout.sampling.sde_type=cps"],
            r"rollout.sampling.sde_type='cps' .*sde_type=sde or dance",
        ),
        (["algorithm.dppo_tau=1e-3"], r"algorithm.dppo_tau=0.001 .*policy_loss=dppo"),
        (
            ["algorithm.policy_loss=dppo", "algorithm.old_log_prob=recompute", "algorithm.clip_range=1e-5"],
            r"algorithm.clip_range=1e-05 .*clips no ratio",
        ),
        (["algorithm.kl_type=velocity"], r"algorithm.kl_type='velocity' .*kl_beta > 0"),
        (["algorithm.advantage_aggregation=gdpo"], r"algorithm.advantage_aggregation='gdpo' .*reward.components"),
    ],
)
def test_combinations_the_references_do_not_make_are_refused(make_cfg, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_cfg(*overrides)


def test_gdpo_trains_on_the_reward_components_by_label(build_trainer, make_cfg):
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=2",
            "reward.name=null",
            "reward.components=[{name: jpeg_compressibility, label: small, weight: 0.5}, {name: image_contrast}]",
            "algorithm.advantage_aggregation=gdpo",
        )
    )
    assert trainer.algorithm.component_weights == {"small": 0.5, "image_contrast": 1.0}
    metrics = trainer.train_step()
    assert metrics["adv/num_rows_trained"] > 0 and metrics["actor/num_optimizer_steps"] == 1
    assert "reward/small/mean" in metrics and "reward/image_contrast/mean" in metrics


def test_shared_initial_noise_is_shared_within_each_group(build_trainer, make_cfg, take_rollout):
    trainer = build_trainer(
        make_cfg("rollout.n=3", "trainer.prompts_per_step=2", "rollout.sampling.shared_initial_noise=true")
    )
    tensors, _ = take_rollout(trainer)
    start = tensors["all_latents"][:, 0]  # the default window starts at step 0: the starting noise
    assert torch.equal(start[0], start[1]) and torch.equal(start[0], start[2])
    assert torch.equal(start[3], start[4]) and torch.equal(start[3], start[5])
    assert not torch.equal(start[0], start[3])
    assert not torch.equal(tensors["all_latents"][0, 1], tensors["all_latents"][1, 1])  # own SDE noise
    with pytest.raises(ValueError, match=r"shared_initial_noise=True .*enable_batched_diffusion=true"):
        make_cfg("rollout.sampling.shared_initial_noise=true", "rollout.enable_batched_diffusion=false")

"""The KL term is Flow-GRPO's: mean over elements of (mu - mu_ref)^2 / (2 std_t^2), with
std_t = a * sqrt(s / (1 - s)) the diffusion coefficient (sigma_1 in place of s = 1), not the
step's transition std. Checked on a perturbed LoRA against a computation from the model's
velocities and the formulas, without flowrl.sampler."""

import math

import pytest
import torch

from flowrl.models.base import PromptEncoding
from flowrl.models.lora import adapter_disabled


def _reference_kl(trainer, tensors, specs) -> float:
    """Mean over rows and window steps of the reference KL, from adapter.velocity and the formulas."""
    adapter = trainer.adapter
    spec = specs[0]
    assert all(s == spec for s in specs)
    schedule = adapter.sigmas(spec.num_inference_steps, spec.height, spec.width)
    sigma_1 = float(schedule[1])
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
            x = tensors["all_latents"][:, k]
            s = tensors["sigmas"][:, k]
            dt = (tensors["next_sigmas"][:, k] - s).view(-1, 1, 1, 1)
            args = (x, s, cond, [None] * num_rows, guidance, spec.height, spec.width)
            v = adapter.velocity(*args)
            with adapter_disabled(adapter.transformer):
                v_ref = adapter.velocity(*args)
            for row in range(num_rows):
                s_row = float(s[row])
                std_t = spec.noise_level * math.sqrt(s_row / (1.0 - (sigma_1 if s_row >= 1.0 else s_row)))

                def mean(v_row):
                    return x[row] + v_row * dt[row] + std_t**2 / (2 * s_row) * (x[row] + (1 - s_row) * v_row) * dt[row]

                sq = ((mean(v[row]) - mean(v_ref[row])) ** 2).mean()
                kls.append(float(sq) / (2 * std_t**2))
    return sum(kls) / len(kls)


def test_kl_equals_the_reference_form_on_a_perturbed_lora(build_trainer, make_cfg, take_rollout):
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=2",
            "trainer.micro_batch_size=4",
            "trainer.lora.enabled=true",
            "algorithm.kl_beta=0.04",
            "algorithm.old_log_prob=recompute",
        )
    )
    tensors, specs = take_rollout(trainer)
    assert float(tensors["sigmas"][0, 0]) == 1.0  # the first window step starts at sigma 1 (sigma_1 case)
    with torch.no_grad():  # LoRA B starts at 0 (policy == reference): move it
        gen = torch.Generator().manual_seed(3)
        for name, p in trainer.adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    expected = _reference_kl(trainer, tensors, specs)
    # One optimizer step per training step: every pair is scored before the weights change.
    metrics = trainer.algorithm.updater.prepare_and_update(
        tensors, specs, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4), step=1
    )
    assert expected > 0
    assert metrics["actor/kl"] == pytest.approx(expected, rel=1e-4)

"""The GPU recipes are the references' setups: each header names its reference and its intentional
differences, and the LoRA each one trains has the reference's size on the real architecture
(built on the meta device from the published configs: no weights, no memory)."""

from pathlib import Path

import pytest
import torch

from flowrl.config import load_config
from flowrl.models.debug.architectures import QWEN_IMAGE_TRANSFORMER, SD35_MEDIUM_TRANSFORMER
from flowrl.models.lora import apply_trainable

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _header(name: str) -> str:
    """The recipe's leading comment block."""
    lines = (RECIPES / f"{name}.yaml").read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return "\n".join(lines[:end])


def _lora_parameters(transformer_cls, config: dict, lora_cfg) -> tuple[int, list[str]]:
    """(LoRA parameter count, adapted module names) of the recipe's LoRA on the architecture."""
    with torch.device("meta"):
        transformer = transformer_cls(**config)
        params = apply_trainable(transformer, lora_cfg)
    adapted = [name for name, module in transformer.named_modules() if hasattr(module, "lora_A")]
    return sum(p.numel() for p in params), adapted


@pytest.mark.parametrize(
    "recipe, architecture, rank, millions",
    [
        ("sd35_medium_ocr_lora", "SD3Transformer2DModel", 32, 18.8),  # Flow-GRPO: attn.* only
        ("qwen_image_ocr_lora", "QwenImageTransformer2DModel", 64, 424.7),  # verl-omni: attention + MLPs
    ],
)
def test_recipe_lora_has_the_reference_size(recipe, architecture, rank, millions):
    import diffusers

    cfg = load_config(str(RECIPES / f"{recipe}.yaml"))
    assert cfg.trainer.lora.rank == rank and cfg.trainer.lora.alpha == 2 * rank
    config = SD35_MEDIUM_TRANSFORMER if architecture.startswith("SD3") else QWEN_IMAGE_TRANSFORMER
    count, adapted = _lora_parameters(getattr(diffusers, architecture), config, cfg.trainer.lora)
    assert round(count / 1e6, 1) == millions, count
    if recipe.startswith("sd35"):
        assert not any(".attn2." in name for name in adapted)  # the dual-attention blocks stay frozen
        assert any(".attn.add_q_proj" in name for name in adapted)
    else:
        assert any(".img_mlp.net.2" in name for name in adapted) and any(
            ".txt_mlp.net.0.proj" in name for name in adapted
        )


@pytest.mark.parametrize(
    "recipe, text_length, ema",
    [
        ("sd35_medium_ocr_lora", 128, True),
        ("qwen_image_ocr_lora", 256, False),
        ("sd35_large_ocr_lora", 128, True),
        ("flux_dev_pickscore_lora", 128, True),
    ],
)
def test_recipe_takes_the_reference_settings_and_says_where_it_differs(recipe, text_length, ema):
    cfg = load_config(str(RECIPES / f"{recipe}.yaml"))
    assert cfg.model.max_sequence_length == text_length
    assert cfg.trainer.updates_per_step == 2 and cfg.algorithm.zero_std_policy == "drop"
    assert cfg.trainer.ema.enabled is ema
    header = _header(recipe)
    assert "# Reference: " in header and "# Intentional differences:" in header
    assert header.count("\n# - ") >= 3  # one bullet per difference


@pytest.mark.parametrize(
    "recipe, settings",
    [
        ("toy_cpu_dance", {"rollout.sampling.sde_type": "dance", "algorithm.std_mode": "group"}),
        ("toy_cpu_guard", {"algorithm.policy_loss": "grpo_guard", "trainer.updates_per_step": 2}),
        ("flux_dev_dancegrpo_lora", {"rollout.sampling.sde_type": "dance", "rollout.sampling.noise_level": 0.3}),
        ("qwen_image_mixgrpo_lora", {"rollout.sde_window_draw": "progressive", "rollout.sampling.sde_window_size": 4}),
        (
            "qwen_image_mixgrpo_flash_lora",
            {
                "rollout.sde_window_draw": "progressive",
                "rollout.sde_window_shift_every": 20,
                "rollout.sampling.ode_solver": "dpmpp_2m",
                "rollout.sampling.ode_tail_ratio": 0.4,
            },
        ),
        ("toy_cpu_flash", {"rollout.sampling.ode_solver": "dpmpp_2m", "rollout.sampling.ode_tail_ratio": 0.4}),
        ("sd35_medium_ocr_guard_lora", {"algorithm.policy_loss": "grpo_guard", "algorithm.clip_range": 2e-6}),
        ("sd35_medium_ocr_dppo_lora", {"algorithm.policy_loss": "dppo", "algorithm.dppo_tau": 1e-5}),
        (  # verl-omni's Wan2.2-5B DanceGRPO values
            "wan22_5b_dancegrpo_lora",
            {
                "rollout.sampling.sde_type": "dance",
                "rollout.sampling.noise_level": 1.2,
                "rollout.sampling.sde_window_size": 2,
                "rollout.sampling.sde_window_range": (0, 5),
                "rollout.sampling.num_inference_steps": 10,
                "trainer.updates_per_step": 4,
                "trainer.lr": 1e-5,
            },
        ),
    ],
)
def test_variant_recipes_load_set_their_variant_and_name_their_reference(recipe, settings):
    cfg = load_config(str(RECIPES / f"{recipe}.yaml"))
    for key, value in settings.items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert node == value, key
    header = _header(recipe)
    assert "Reference:" in header and "Intentional differences" in header

"""Random weights at published architectures (`model.path=random:NAME`): the configs' sizes, the
in-place building, the random prompts, and the errors."""

from __future__ import annotations

import pytest
import torch

from flowrl.models.debug.architectures import (
    ARCHITECTURES,
    FIXED_LENGTH_TEXT,
    FLUX_DEV_TRANSFORMER,
    QWEN_IMAGE_TRANSFORMER,
    RANDOM_WEIGHT_MODULES,
    SD3_MEDIUM_TRANSFORMER,
    SD35_LARGE_TRANSFORMER,
    SD35_MEDIUM_TRANSFORMER,
    Z_IMAGE_TRANSFORMER,
)
from flowrl.models.debug.random_weights import build_random_module
from flowrl.models.flux import FluxAdapter
from flowrl.models.qwen_image import QwenImageAdapter
from flowrl.models.registry import FAMILIES, load_adapter, read_model_family
from flowrl.models.sd3 import SD3Adapter
from flowrl.models.z_image import ZImageAdapter


@pytest.mark.parametrize(
    "cls_name, config, billions",
    [
        ("SD3Transformer2DModel", SD3_MEDIUM_TRANSFORMER, 2.03),  # stable-diffusion-3-medium
        ("SD3Transformer2DModel", SD35_MEDIUM_TRANSFORMER, 2.24),  # stable-diffusion-3.5-medium
        ("SD3Transformer2DModel", SD35_LARGE_TRANSFORMER, 8.06),  # stable-diffusion-3.5-large
        ("QwenImageTransformer2DModel", QWEN_IMAGE_TRANSFORMER, 20.4),  # Qwen-Image
        ("FluxTransformer2DModel", FLUX_DEV_TRANSFORMER, 11.9),  # FLUX.1-dev
        ("ZImageTransformer2DModel", Z_IMAGE_TRANSFORMER, 6.15),  # Z-Image (-Turbo)
    ],
)
def test_published_configs_have_published_sizes(cls_name, config, billions):
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = getattr(diffusers, cls_name)(**config)
    count = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(count - billions) / billions < 0.01


def test_every_name_is_buildable_and_of_a_known_family():
    families = {family for family, _ in FAMILIES.values()}
    for name, (family, *_) in ARCHITECTURES.items():
        assert family in families, name
        assert name.startswith("tiny-") or name in RANDOM_WEIGHT_MODULES, name
        assert read_model_family(f"random:{name}") == family  # nothing built
    assert set(FIXED_LENGTH_TEXT) <= families


def test_random_module_is_built_in_place_with_default_scale():
    linear = build_random_module(
        torch.nn.Linear, {"in_features": 64, "out_features": 32}, torch.device("cpu"), torch.bfloat16
    )
    assert linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu"
    assert not linear.weight.requires_grad
    assert 0 < linear.weight.float().abs().max() <= 1 / 8  # U(-1/sqrt(64), 1/sqrt(64))
    assert float(linear.bias.abs().max()) == 0.0


def test_random_adapter_is_the_familys_with_random_prompts(capsys):
    adapter = load_adapter("random:tiny-sd3", dtype=torch.float32)
    assert "RANDOM WEIGHTS" in capsys.readouterr().err
    assert isinstance(adapter, SD3Adapter) and adapter.random_weights == "tiny-sd3"
    a, b, a_again = adapter.encode_prompts(["a", "b", "a"])
    assert a.embeds.shape == (77 + 32, 64) and a.pooled.shape == (64,) and bool(a.mask.all())
    assert torch.equal(a.embeds, a_again.embeds) and not torch.equal(a.embeds, b.embeds)
    assert adapter.pipeline.transformer is adapter.transformer and adapter.pipeline.text_encoder is None


@pytest.mark.parametrize(
    "name, cls, length, tokens",
    [
        ("tiny-sd3", SD3Adapter, 40, 77 + 40),
        ("tiny-flux", FluxAdapter, 40, 40),
        ("tiny-qwen", QwenImageAdapter, 8, 8),
        ("tiny-z-image", ZImageAdapter, 8, 8),
    ],
)
def test_prompt_length_follows_max_sequence_length(name, cls, length, tokens):
    """SD3 pads every prompt to CLIP's 77 + T5's max_sequence_length, FLUX to T5's alone;
    Qwen-Image's and Z-Image's prompts are as long as they are, at most max_sequence_length."""
    adapter = load_adapter(f"random:{name}", max_sequence_length=length, warn=False)
    assert isinstance(adapter, cls) and adapter.max_sequence_length == length
    assert adapter.encode_prompts(["x"])[0].embeds.shape[0] == tokens


def test_unknown_name_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"model.path='random:sd9'.*sd35-medium.*qwen-image"):
        read_model_family("random:sd9")
    with pytest.raises(ValueError, match="num_layers=2 is for the published architectures"):
        load_adapter("random:tiny-qwen", num_layers=2)

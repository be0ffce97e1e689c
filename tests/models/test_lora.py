"""LoRA's low-rank product runs in the activations' dtype over float32 master weights
(flowrl.models.lora.forward_in_activation_dtype, installed by flowrl.models.lora): values, gradients, and the cases that
keep peft's own forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.models.debug.tiny import build_tiny_pipeline
from flowrl.models.lora import adapter_disabled, apply_trainable


def _lora_cfg(**extra):
    return SimpleNamespace(
        enabled=True,
        rank=4,
        alpha=8.0,
        target_modules=["attn.to_q", "attn.to_k"],
        init="gaussian",
        dropout=0.0,
        **extra,
    )


def _adapted_transformer(dtype):
    transformer = build_tiny_pipeline("sd3", seed=0).transformer.to(dtype)
    torch.manual_seed(0)
    params = apply_trainable(transformer, _lora_cfg())
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)  # as after some training (B starts at zero)
    return transformer, params


def _first_lora_linear(transformer):
    from peft.tuners.lora.layer import Linear as LoraLinear

    return next(m for m in transformer.modules() if type(m) is LoraLinear)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_product_runs_in_the_activation_dtype_over_float32_weights(dtype):
    transformer, params = _adapted_transformer(dtype)
    assert params and all(p.dtype == torch.float32 for p in params)  # master weights stay float32
    layer = _first_lora_linear(transformer)
    x = torch.randn(3, 5, layer.in_features, dtype=dtype)
    a, b, scale = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    out = layer(x)
    assert out.dtype == dtype
    expected = layer.base_layer(x) + (x @ a.to(dtype).t()) @ (b * scale).to(dtype).t()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    # peft's own forward (float32 product): the same values up to the activations' rounding; in
    # float32 exactly, since the scale (alpha / rank = 2) is a power of two and moving it is exact
    peft_out = type(layer).forward(layer, x)
    tolerance = 0 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), peft_out.float(), atol=tolerance, rtol=tolerance)


def test_gradients_reach_the_float32_lora_weights_and_match_peft_in_float32():
    transformer, params = _adapted_transformer(torch.float32)
    layer = _first_lora_linear(transformer)
    x = torch.randn(2, 7, layer.in_features)
    grads = []
    for forward in (layer.forward, lambda t: type(layer).forward(layer, t)):
        for p in params:
            p.grad = None
        forward(x).square().sum().backward()
        grads.append({name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None})
    assert set(grads[0]) == {"lora_A.default.weight", "lora_B.default.weight"}
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_bf16_model_gets_float32_gradients():
    transformer, params = _adapted_transformer(torch.bfloat16)
    layer = _first_lora_linear(transformer)
    layer(torch.randn(2, 4, layer.in_features, dtype=torch.bfloat16)).float().square().sum().backward()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert a.grad is not None and a.grad.dtype == torch.float32 and a.grad.abs().sum() > 0
    assert b.grad is not None and b.grad.dtype == torch.float32 and b.grad.abs().sum() > 0


def test_disabled_adapter_is_the_base_model():
    """The KL reference (adapter_disabled) still sees the base projection alone."""
    transformer, _ = _adapted_transformer(torch.bfloat16)
    layer = _first_lora_linear(transformer)
    x = torch.randn(2, 4, layer.in_features, dtype=torch.bfloat16)
    with adapter_disabled(transformer):
        torch.testing.assert_close(layer(x), layer.base_layer(x), atol=0, rtol=0)
    assert not torch.equal(layer(x), layer.base_layer(x))


def test_lora_variants_keep_pefts_forward():
    """DoRA (a peft variant this forward does not implement) runs peft's own forward."""
    from peft import LoraConfig

    transformer = build_tiny_pipeline("sd3", seed=0).transformer
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["attn.to_q"], use_dora=True))
    from flowrl.models.lora import _compute_lora_in_activation_dtype

    assert _compute_lora_in_activation_dtype(transformer) > 0
    layer = _first_lora_linear(transformer)
    x = torch.randn(2, 4, layer.in_features)
    torch.testing.assert_close(layer(x), type(layer).forward(layer, x), atol=0, rtol=0)

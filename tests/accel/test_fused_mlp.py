"""The GELU-epilogue MLP op (flowrl.accel.fused_mlp): same function and gradients as the
unfused module, switched in without changing parameters, and bypassed where it must be or
where `gelu_epilogue=False` says so."""

from __future__ import annotations

import torch

from flowrl.accel.fused_mlp import fuse_gelu_epilogues, linear_gelu_tanh
from flowrl.bench.models import build_bench_model


def test_op_matches_unfused_math_and_gradients():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(linear_gelu_tanh, (x, w, b))
    fused = linear_gelu_tanh(x, w, b)
    reference = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")
    torch.testing.assert_close(fused, reference, rtol=0, atol=0)
    (g_fused,) = torch.autograd.grad(fused.square().sum(), w)
    (g_ref,) = torch.autograd.grad(reference.square().sum(), w)
    torch.testing.assert_close(g_fused, g_ref)


def test_switch_keeps_velocity_and_state_dict_and_falls_back_under_lora(monkeypatch):
    from peft import LoraConfig, inject_adapter_in_model

    import flowrl.accel.fused_mlp as fused_mlp

    adapter = build_bench_model("tiny-sd3", "cpu", torch.float32).adapter
    blocks = len(adapter.transformer.transformer_blocks)
    latents = torch.randn((2, *adapter.latent_shape(64, 64)))
    enc = adapter.encode_prompts(["a", "b"])
    args = (latents, torch.tensor([0.9, 0.3]), enc, [None, None], torch.ones(2), 64, 64)
    keys = list(adapter.transformer.state_dict())
    calls = []
    monkeypatch.setattr(fused_mlp, "linear_gelu_tanh", lambda *a: calls.append(1) or linear_gelu_tanh(*a))
    with torch.no_grad():
        reference = adapter.velocity(*args)
        count = fuse_gelu_epilogues(adapter.transformer)
        fused = adapter.velocity(*args)
    assert count == 2 * blocks - 1  # ff + ff_context (the last block has no context MLP)
    assert len(calls) == count
    assert list(adapter.transformer.state_dict()) == keys
    torch.testing.assert_close(fused, reference, rtol=0, atol=0)
    # LoRA on the image MLPs' first projection: those MLPs take the module's own path (LoRA
    # applied), the context MLPs stay fused.
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["ff.net.0.proj"]), adapter.transformer)
    for name, param in adapter.transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    calls.clear()
    with torch.no_grad():
        with_lora = adapter.velocity(*args)
    assert len(calls) == count - blocks
    assert (with_lora - reference).abs().max() > 1e-3


def test_compiled_module_raises_the_recompile_limit_in_the_calling_thread():
    """torch 2.13 keeps dynamo config overrides per thread; the engine thread must still get
    the raised limit, or regional compilation silently falls back to eager after 8 graphs."""
    import threading

    from flowrl.accel.regional_compile import compile_in_place

    module = torch.nn.Linear(4, 4)
    compile_in_place(module, "eager")
    seen = []

    def call():
        module(torch.randn(3, 4))
        config = torch._dynamo.config
        seen.append(getattr(config, "recompile_limit", None) or config.cache_size_limit)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert seen and seen[0] >= 64


def test_mixed_dtypes_and_autocast_take_the_module_path(monkeypatch):
    import pytest
    from diffusers.models.attention import FeedForward

    import flowrl.accel.fused_mlp as fused_mlp

    ff = FeedForward(8, activation_fn="gelu-approximate")
    assert fuse_gelu_epilogues(ff) == 1
    calls = []
    monkeypatch.setattr(fused_mlp, "linear_gelu_tanh", lambda *a: calls.append(1) or linear_gelu_tanh(*a))
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(ff(x), FeedForward.forward(ff, x), rtol=0, atol=0)
    assert len(calls) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(ff(x), FeedForward.forward(ff, x), rtol=0, atol=0)
    assert len(calls) == 1  # autocast: the module's own (casting) path
    with pytest.raises(RuntimeError, match="dtype"):  # the module's own error, not the op's
        ff(x.double())
    assert len(calls) == 1
    from flowrl.accel.options import AccelOptions

    assert fuse_gelu_epilogues(ff, AccelOptions(gelu_epilogue=False)) == 1  # switched off: the module's path
    torch.testing.assert_close(ff(x), FeedForward.forward(ff, x), rtol=0, atol=0)
    assert len(calls) == 1

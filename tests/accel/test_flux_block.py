"""FLUX.1's single-stream blocks with the output projection split over their two branches
(flowrl.accel.flux): the same function and gradients as diffusers' block, parameters untouched,
and diffusers' own forward where the split does not apply or is switched off."""

from __future__ import annotations

import types

import pytest
import torch

import flowrl.accel.flux as flux
from flowrl.accel.options import AccelOptions
from flowrl.bench.models import build_bench_model


def _block_inputs(block, seed: int = 0, text: int = 3, image: int = 8, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    dim = block.proj_out.out_features
    head_dim = block.attn.head_dim
    rope_len = text + image
    angles = torch.randn(rope_len, head_dim, generator=gen)
    return (
        torch.randn(batch, image, dim, generator=gen, dtype=torch.float64),
        torch.randn(batch, text, dim, generator=gen, dtype=torch.float64),
        torch.randn(batch, dim, generator=gen, dtype=torch.float64),
        (angles.cos().double(), angles.sin().double()),
    )


@pytest.fixture
def adapter():
    return build_bench_model("tiny-flux", "cpu", torch.float32).adapter


def test_split_block_equals_diffusers_block_with_gradients(adapter):
    block = adapter.transformer.single_transformer_blocks[0].double().requires_grad_(True)
    keys = list(block.state_dict())
    image, text, temb, rope = _block_inputs(block)
    image.requires_grad_(True)
    stock = type(block).forward(block, image, text, temb, rope)
    stock_grads = torch.autograd.grad(sum(t.square().sum() for t in stock), [image, block.proj_out.weight])
    flux.install(adapter, AccelOptions())
    assert isinstance(block.forward, types.MethodType) and block.forward.__func__ is flux.split_output_forward
    split = block(image, text, temb, rope)
    split_grads = torch.autograd.grad(sum(t.square().sum() for t in split), [image, block.proj_out.weight])
    for a, b in zip(split, stock):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # summation order only
    for a, b in zip(split_grads, stock_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert list(block.state_dict()) == keys


def test_switched_off_or_with_lora_on_a_projection_runs_diffusers_forward(adapter, monkeypatch):
    from peft import LoraConfig, inject_adapter_in_model

    calls = []
    monkeypatch.setattr(flux, "linear_gelu_tanh", lambda *a: calls.append(1) or torch.zeros(()))
    block = adapter.transformer.single_transformer_blocks[0]
    image, text, temb, (cos, sin) = (t.float() if torch.is_tensor(t) else t for t in _block_inputs(block))
    rope = (cos.float(), sin.float())
    stock = type(block).forward(block, image, text, temb, rope)
    flux.install(adapter, AccelOptions(split_output=False))
    for a, b in zip(block(image, text, temb, rope), stock):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["proj_out"]), adapter.transformer)
    flux.install(adapter, AccelOptions())
    for a, b in zip(block(image, text, temb, rope), stock):  # LoRA's B starts at zero: the same function
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not calls  # neither call took the split path


def test_compile_adapter_installs_it_on_every_single_stream_block(adapter):
    from flowrl.accel import compile_adapter

    compile_adapter(adapter, "eager")
    blocks = adapter.transformer.single_transformer_blocks
    assert all(b.forward.__func__ is flux.split_output_forward and b._flowrl_accel.split_output for b in blocks)
    compile_adapter(adapter, "eager", split_output=False)
    assert not any(b._flowrl_accel.split_output for b in blocks)


def test_compiled_training_forward_and_backward_equal_eager():
    """With grad (the trainer's passes), the compiled blocks, split projection and the adapter's
    attention-gradient hook included, give eager's velocity and gradients."""
    from flowrl.accel import compile_adapter

    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        adapter = build_bench_model("tiny-flux", "cpu", torch.float32).adapter
        adapter.transformer.requires_grad_(True)
        if compiled:
            compile_adapter(adapter, "aot_eager")
        gen = torch.Generator().manual_seed(3)
        latents = torch.randn((2, *adapter.latent_shape(64, 64)), generator=gen)
        enc = adapter.encode_prompts(["a", "b"])
        guidance = adapter.guidance_embedding_kwargs(torch.full((2,), 3.5))
        velocity = adapter.velocity(
            latents, torch.tensor([0.9, 0.3]), enc, [None, None], torch.ones(2), 64, 64, **guidance
        )
        velocity.square().sum().backward()
        proj_out = adapter.transformer.single_transformer_blocks[0].proj_out.weight.grad
        to_q = adapter.transformer.transformer_blocks[0].attn.to_q.weight.grad
        results.append((velocity.detach(), proj_out, to_q))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)

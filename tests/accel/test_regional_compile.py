"""Gradient checkpointing of blocks compiled in place (flowrl.accel.regional_compile): the
checkpoint is taken inside each block's compiled grad graph, with the values and gradients of
the same model without checkpointing and the activation memory of a checkpointed one."""

from __future__ import annotations

import pytest
import torch

from flowrl.accel import compile_adapter, is_compiled
from flowrl.accel.regional_compile import checkpoint_inside
from flowrl.bench.models import build_bench_model, make_trainable
from flowrl.trainer.grad_checkpointing import saved_activation_bytes


def _cfg_inputs(adapter) -> tuple:
    """`adapter.velocity` arguments: two 64 px rows with prompts, CFG 2 on empty negatives."""
    latents = torch.randn((2, *adapter.latent_shape(64, 64)))
    return (
        latents,
        torch.tensor([0.9, 0.3]),
        adapter.encode_prompts(["a", "b"]),
        adapter.encode_prompts(["", ""]),
        torch.full((2,), 2.0),
        64,
        64,
    )


def _forward_backward(adapter, inputs: tuple, params) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The velocity of `inputs` and the float32 gradients of `params` from its squared mean, the
    gradients cleared after."""
    velocity = adapter.velocity(*inputs)
    velocity.square().mean().backward()
    grads = [p.grad.float() for p in params]
    for p in params:
        p.grad = None
    return velocity.detach(), grads


# The Qwen-Image block (flowrl's own checkpointing) and the SD3 block (diffusers' own hook) with
# aot_eager, the same dynamo and autograd partition without inductor's C++ compile; inductor itself
# on the Qwen-Image block is slow-marked (about 80 s on a CI worker with a cold compile cache).
@pytest.mark.parametrize(
    ("model", "backend"),
    [
        ("tiny-qwen", "aot_eager"),
        ("tiny-sd3", "aot_eager"),
        pytest.param("tiny-qwen", "inductor", marks=pytest.mark.slow),
    ],
)
def test_checkpoint_inside_compiled_blocks_keeps_values_and_saves_memory(model, backend):
    torch.manual_seed(0)
    adapter = build_bench_model(model, "cpu", torch.bfloat16).adapter
    transformer = adapter.transformer
    params = make_trainable(transformer, 4, adapter.default_lora_targets)
    transformer.enable_gradient_checkpointing()  # before compiling, as the trainer does
    assert not is_compiled(adapter)
    compile_adapter(adapter, backend)
    assert is_compiled(adapter)  # the trainer then takes log-prob values from the no-grad graph
    assert transformer._gradient_checkpointing_func is checkpoint_inside
    block = transformer.transformer_blocks[0]
    routed = []
    checkpointed_call = block._flowrl_checkpointed_call
    block._flowrl_checkpointed_call = lambda *args: routed.append(1) or checkpointed_call(*args)

    inputs = _cfg_inputs(adapter)
    results = {}

    def forward_backward(mode):
        velocity, grads = _forward_backward(adapter, inputs, params)
        results[mode] = (velocity, torch.stack([g.norm() for g in grads]))

    for mode in ("inside", "none"):
        if mode == "none":
            transformer.disable_gradient_checkpointing()
        forward_backward(mode)  # compiles
        routed.clear()
        results[f"{mode} bytes"] = saved_activation_bytes(lambda: forward_backward(mode), transformer)
        assert routed == ([1] if mode == "inside" else [])  # the block's grad call went through its checkpoint
    assert torch.equal(results["inside"][0], results["none"][0])
    torch.testing.assert_close(results["inside"][1], results["none"][1], rtol=0.05, atol=1e-6)  # bf16 backward
    # What stays saved with the checkpoint inside: the blocks' inputs and each checkpoint's RNG
    # state (the CPU generator's 5056 bytes), against every activation without it.
    assert results["inside bytes"] < 0.4 * results["none bytes"], results


class _TwoLayers(torch.nn.Module):
    """A module of this file: dynamo skips frames of torch.nn's own modules, such as Sequential."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.second(torch.nn.functional.gelu(self.first(x)))


def test_compile_in_place_options_reach_the_grad_and_the_no_grad_graphs():
    """compile_in_place(options=...): inductor settings for every compiled call, with and without
    grad (the no-grad graph has settings of its own too): a custom pass set through them runs
    when the grad call compiles, and again when the no-grad call compiles its own graph."""
    from flowrl.accel.regional_compile import compile_in_place

    passes = []

    def record(graph):
        passes.append(graph)

    module = _TwoLayers()
    compile_in_place(
        module, "inductor", no_grad_options={"max_autotune": False}, options={"post_grad_custom_post_pass": record}
    )
    x = torch.randn(3, 8)
    module(x).sum().backward()
    after_grad_call = len(passes)
    with torch.no_grad():
        module(x)
    assert module.first.weight.grad is not None
    assert 0 < after_grad_call < len(passes), (after_grad_call, len(passes))

"""Qwen-Image blocks as the engine compiles them (flowrl.accel.qwen_image.block): the same function and
gradients as diffusers' blocks in float32, activations kept sequence-major from block to block,
diffusers' forward where the sequence-major one does not apply, and a batch of one reusing the
compiled batch >= 2 graph."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.accel import compile_adapter
from flowrl.accel.qwen_image import block as qwen_block
from flowrl.accel.qwen_image.block import prepare_for_compile
from flowrl.bench.models import build_bench_model


@pytest.fixture(scope="module")
def stock():
    torch.manual_seed(0)
    return build_bench_model("tiny-qwen", "cpu", torch.float32).adapter


def _velocity_args(adapter, rows: int, ragged: bool):
    """Inputs of adapter.velocity: rows of one 64 px batch, text of different lengths when ragged
    (a padded, masked text batch)."""
    enc = adapter.encode_prompts(["long prompt", "short", "x"][:rows])
    if ragged:
        enc[1].embeds, enc[1].mask = enc[1].embeds[:5], enc[1].mask[:5]
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn((rows, *adapter.latent_shape(64, 64)), generator=gen)
    return (latents, torch.tensor([0.9, 0.3, 0.5])[:rows], enc, [None] * rows, torch.ones(rows), 64, 64)


@pytest.mark.parametrize("ragged", [False, True])
def test_sequence_major_blocks_compute_diffusers_function(stock, ragged):
    prepared = copy.deepcopy(stock)
    assert prepare_for_compile(prepared.transformer) and not prepare_for_compile(prepared.transformer)
    layouts = []
    for block in prepared.transformer.transformer_blocks:
        block.register_forward_pre_hook(
            lambda m, a, kw: layouts.append(
                [kw[k].transpose(0, 1).is_contiguous() for k in ("hidden_states", "encoder_hidden_states")]
            ),
            with_kwargs=True,
        )
    args = _velocity_args(stock, 3, ragged)
    with torch.no_grad():
        reference, result = stock.velocity(*args), prepared.velocity(*args)
    torch.testing.assert_close(result, reference, atol=1e-6, rtol=1e-6)
    # Every block, the first included, received (L, B, D) memory from the input hooks or the block before.
    assert layouts == [[True, True]] * len(prepared.transformer.transformer_blocks)


def test_sequence_major_blocks_have_diffusers_gradients(stock):
    prepared = copy.deepcopy(stock)
    prepare_for_compile(prepared.transformer)
    args = _velocity_args(stock, 2, ragged=True)
    grads = []
    for adapter in (stock, prepared):
        block = adapter.transformer.transformer_blocks[0]
        params = [
            block.attn.to_q.weight,
            block.attn.add_v_proj.weight,
            block.img_mlp.net[2].weight,
            block.txt_mod[1].bias,
        ]
        for p in params:
            p.requires_grad_(True)
        try:
            adapter.velocity(*args).square().mean().backward()
            grads.append([p.grad.clone() for p in params])
        finally:
            for p in params:
                p.requires_grad_(False)
                p.grad = None
    for got, want in zip(*reversed(grads)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_blocks_sequence_major_cannot_serve_fall_back_to_diffusers_forward():
    """zero_cond_t (the edit models' per-token modulation) is not implemented sequence-major: those
    blocks run diffusers' forward (with the real-RoPE processor) and compute the same function."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=8,
        axes_dims_rope=(4, 6, 6),
        zero_cond_t=True,
    ).eval()
    kwargs = dict(
        hidden_states=torch.randn(2, 16, 16),
        encoder_hidden_states=torch.randn(2, 5, 8),
        timestep=torch.tensor([0.7, 0.2]),
        img_shapes=[[(1, 4, 4)]] * 2,
        return_dict=False,
    )
    with torch.no_grad():
        reference = model(**kwargs)[0]
        prepare_for_compile(model)
        result = model(**kwargs)[0]
    torch.testing.assert_close(result, reference, atol=1e-6, rtol=1e-6)


def test_batch_of_one_reuses_the_compiled_graph(stock, monkeypatch):
    """A compiled block graph is specialised to its input layout; a batch of 1 padded per block
    (batch-major) would compile a second graph. Padded at the model input it stays sequence-major."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counting_backend))
    torch._dynamo.reset()
    adapter = copy.deepcopy(stock)
    compile_adapter(adapter)
    with torch.no_grad():
        for rows in (3, 1, 2):
            reference = stock.velocity(*_velocity_args(stock, rows, ragged=False))
            torch.testing.assert_close(
                adapter.velocity(*_velocity_args(stock, rows, ragged=False)), reference, atol=1e-5, rtol=1e-5
            )
    assert len(graphs) == 1


def test_lora_on_sequence_major_blocks_has_diffusers_values_and_gradients(stock):
    """The trainer's setting: a peft LoRA adapter on every attention projection of both streams
    (B made non-zero, as after some training). Velocity and LoRA gradients equal those of
    diffusers' blocks (None alike where a parameter does not reach the output: the last block's
    text-stream output projection)."""
    from flowrl.config.sections import LoraConfig
    from flowrl.models.lora import apply_trainable

    args = _velocity_args(stock, 2, ragged=True)
    results = []
    for sequence_major in (False, True):
        adapter = copy.deepcopy(stock)
        torch.manual_seed(1)  # the same LoRA initialisation in both copies
        params = apply_trainable(
            adapter.transformer, LoraConfig(rank=4, alpha=4, target_modules=list(adapter.default_lora_targets))
        )
        with torch.no_grad():
            for name, param in adapter.transformer.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.05)
        if sequence_major:
            prepare_for_compile(adapter.transformer)
        velocity = adapter.velocity(*args)
        velocity.square().mean().backward()
        results.append((velocity.detach(), [p.grad for p in params]))
    (v_ref, g_ref), (v_seq, g_seq) = results
    torch.testing.assert_close(v_seq, v_ref, atol=1e-6, rtol=1e-6)
    assert len(g_seq) == len(g_ref) > 0 and sum(g is not None for g in g_ref) > len(g_ref) // 2
    for got, want in zip(g_seq, g_ref):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_compiled_lora_rollout_graph_folds_the_low_rank_terms(stock):
    """The tiny Qwen-Image with the trainer's LoRA adapter, compiled (aot_eager on the CPU): its
    no-grad graph runs every adapted projection as the folded op, with the eager model's velocity."""
    from flowrl.config.sections import LoraConfig
    from flowrl.models.lora import apply_trainable

    adapter = copy.deepcopy(stock)
    torch.manual_seed(1)
    apply_trainable(adapter.transformer, LoraConfig(rank=4, alpha=4, target_modules=list(adapter.default_lora_targets)))
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    args = _velocity_args(adapter, 3, ragged=False)
    with torch.no_grad():
        eager = adapter.velocity(*args)
    calls = []
    real_op = torch.ops.flowrl.lora_linear.default

    def counted(*a):
        calls.append(a[0].shape)
        return real_op(*a)

    from flowrl.accel import lora_fold

    def compiled_velocity(**switches):
        compile_adapter(adapter, backend="aot_eager", **switches)
        calls.clear()
        original, lora_fold.lora_linear = lora_fold.lora_linear, counted
        try:
            with torch.no_grad():
                return adapter.velocity(*args)
        finally:
            lora_fold.lora_linear = original

    compiled = compiled_velocity()
    blocks = len(adapter.transformer.transformer_blocks)
    assert len(calls) == 8 * blocks  # q, k, v and output projections of both streams
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    # Called again with the switch off, the compiled graphs retrace without the op (an A/B in one
    # process), and back on, with it.
    torch.testing.assert_close(compiled_velocity(lora_fold=False), eager, atol=1e-5, rtol=1e-5)
    assert calls == []
    compiled_velocity(lora_fold=True)
    assert len(calls) == 8 * blocks


@pytest.mark.gpu
def test_cudnn_attention_output_feeds_the_projections_without_a_copy():
    """The layout's premise on CUDA: SDPA (cuDNN on Hopper) writes its output in the query's
    (L, B, H, D) layout, so the sequence-major output is a view and each stream's rows are a
    contiguous slice the output projections read in place."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(0)  # Qwen-Image's head width (128), two heads
    block = QwenImageTransformerBlock(dim=256, num_attention_heads=2, attention_head_dim=128).to("cuda", torch.bfloat16)
    attn, width = block.attn, 256
    img, txt = (
        torch.randn(256, 4, width, device="cuda", dtype=torch.bfloat16),
        torch.randn(16, 4, width, device="cuda", dtype=torch.bfloat16),
    )
    seen = {}
    real_linear = torch.nn.functional.linear

    def recording_linear(x, weight, bias=None):
        if weight is attn.to_out[0].weight:
            seen["to_out_input"] = x
        return real_linear(x, weight, bias)

    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*a, **kw):
        seen["sdpa_output"] = real_sdpa(*a, **kw)
        return seen["sdpa_output"]

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(qwen_block.F, "scaled_dot_product_attention", recording_sdpa)
        patch.setattr(torch.nn.functional, "linear", recording_linear)
        qwen_block._joint_attention(attn, img, txt, None, None)
    x = seen["to_out_input"]
    assert x.is_contiguous()
    assert x.untyped_storage().data_ptr() == seen["sdpa_output"].untyped_storage().data_ptr()  # a view, not a copy

"""Qwen-Image blocks as the engine compiles them (flowrl.accel.qwen_image.block): the same function and
gradients as diffusers' blocks in float32, activations kept sequence-major from block to block,
diffusers' forward where the sequence-major one does not apply, and a batch of one reusing the
compiled batch >= 2 graph."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.accel import compile_adapter
from flowrl.accel.lora_fold import fold_lora_projections
from flowrl.accel.options import AccelOptions
from flowrl.accel.qwen_image import block as qwen_block
from flowrl.accel.qwen_image import joint_linear
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
    from flowrl.trainer.lora import apply_trainable

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


def test_lora_wrapped_projections_take_the_rollout_kernels_when_their_term_folds(stock):
    """The q/k kernel and the joint v projection need plain GEMM outputs: plain projections, or
    the trainer's LoRA projections, whose rollout graphs accumulate the low-rank term inside the
    GEMM's output (flowrl.accel.lora_fold). With LoRA dropout that fold does not apply, and
    neither do the kernels."""
    from flowrl.config.sections import LoraConfig
    from flowrl.trainer.lora import apply_trainable

    attn = stock.transformer.transformer_blocks[0].attn
    assert qwen_block._plain_qk_projections(attn) and joint_linear.applies(attn.add_v_proj, attn.to_v)
    for dropout, applies in ((0.0, True), (0.1, False)):
        adapter = copy.deepcopy(stock)
        apply_trainable(
            adapter.transformer,
            LoraConfig(rank=4, alpha=4, dropout=dropout, target_modules=list(adapter.default_lora_targets)),
        )
        fold_lora_projections(adapter.transformer)  # as compile_adapter does
        attn = adapter.transformer.transformer_blocks[0].attn
        assert qwen_block._plain_qk_projections(attn) is applies
        assert joint_linear.applies(attn.add_v_proj, attn.to_v) is applies


def test_compiled_lora_rollout_graph_folds_the_low_rank_terms(stock):
    """The tiny Qwen-Image with the trainer's LoRA adapter, compiled (aot_eager on the CPU): its
    no-grad graph runs every adapted projection as the folded op, with the eager model's velocity."""
    from flowrl.config.sections import LoraConfig
    from flowrl.trainer.lora import apply_trainable

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


def _cuda_block(heads: int = 2):
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(0)  # Qwen-Image's head width (128)
    block = QwenImageTransformerBlock(dim=heads * 128, num_attention_heads=heads, attention_head_dim=128)
    block = block.to("cuda", torch.bfloat16).requires_grad_(False).eval()
    with torch.no_grad():  # norm weights other than 1, so that a wrong weight would show
        for norm in (block.attn.norm_q, block.attn.norm_k, block.attn.norm_added_q, block.attn.norm_added_k):
            norm.weight.uniform_(0.5, 1.5)
    return block


def _tables(tokens: int, head_dim: int = 128):
    angles = torch.rand(tokens, head_dim // 2, device="cuda") * 6.28
    return angles.cos().repeat_interleave(2, -1).contiguous(), torch.stack([-angles.sin(), angles.sin()], -1).flatten(
        -2
    ).contiguous()


def _compiled_sequence_major_block(use_kernels: bool, lora: bool = False):
    """A CUDA block compiled as the rollout compiles it (sequence-major forward, real RoPE), with
    the hand-written kernels on or off (with `lora`, also the fold of the low-rank terms into the
    projections' GEMMs), and the arguments of one call (4 rows, 16 text and 256 image tokens).
    `lora`: the trainer's rank-8 adapter on the attention projections, B nonzero."""
    from flowrl.accel.regional_compile import compile_in_place

    block = _cuda_block()
    if lora:
        from flowrl.models.qwen_image import QwenImageAdapter
        from flowrl.trainer.lora import inject_lora

        inject_lora(block, 8, QwenImageAdapter.default_lora_targets)
        torch.manual_seed(2)
        for name, param in block.named_parameters():
            if "lora_B" in name:
                param.data.normal_(std=0.05)
    options = AccelOptions(qk_kernel=use_kernels, norm_kernel=use_kernels, lora_fold=use_kernels)
    qwen_block.prepare_block(block, options)
    fold_lora_projections(block, options)
    compile_in_place(block, "inductor", "eager")
    torch.manual_seed(1)
    img = torch.randn(256, 4, 256, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    txt = torch.randn(16, 4, 256, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    kwargs = dict(
        hidden_states=img,
        encoder_hidden_states=txt,
        encoder_hidden_states_mask=None,
        temb=torch.randn(4, 256, device="cuda", dtype=torch.bfloat16),
        image_rotary_emb=(_tables(256), _tables(16)),
    )
    return block, kwargs


def test_qk_kernel_reproduces_only_diffusers_rmsnorm():
    """flowrl.accel.qwen_image.qk_norm_rope.applicable: never on the CPU, and never for a norm whose rounding
    it does not reproduce (torch's own RMSNorm), whatever the device."""
    from diffusers.models.normalization import RMSNorm

    from flowrl.accel.qwen_image import qk_norm_rope

    x = torch.zeros(2, 3, 4, 128, dtype=torch.bfloat16)
    rope = ((torch.ones(2, 128), torch.zeros(2, 128)),) * 2
    assert not qk_norm_rope.applicable(x, RMSNorm(128, eps=1e-6).to(torch.bfloat16), rope)  # CPU tensor
    if torch.cuda.is_available():
        x = x.cuda()
        assert (
            qk_norm_rope.applicable(x, RMSNorm(128, eps=1e-6).to("cuda", torch.bfloat16), rope)
            == qk_norm_rope.available()
        )
        assert not qk_norm_rope.applicable(x, torch.nn.RMSNorm(128).to("cuda", torch.bfloat16), rope)


@pytest.mark.gpu
def test_joint_norm_rope_kernel_rounds_like_pytorch():
    """flowrl.accel.qwen_image.qk_norm_rope on CUDA against the PyTorch expression it replaces (RMSNorm +
    rotation + join) in bf16: equal up to the mean's reduction order and rsqrt's last bit, which
    move a small fraction of the elements by a bf16 step of the normed values."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from flowrl.accel.qwen_image import qk_norm_rope

    attn = _cuda_block(heads=3).attn
    rope = (_tables(200), _tables(13))  # 5 rows x 3 heads: a token's rows fill part of a program
    img, txt = (torch.randn(n, 5, 3 * 128, device="cuda", dtype=torch.bfloat16) * 4 for n in (200, 13))
    with torch.no_grad():
        q_pair, k_pair, v_pair = qwen_block._projected_heads(attn, img, txt)
        assert qk_norm_rope.applicable(q_pair[1], attn.norm_q, rope)
        pairs = qwen_block._normed_rotated(attn, q_pair, k_pair, v_pair, rope, seq_dim=0)[:2]
        want = [torch.cat((img_part, txt_part)) for txt_part, img_part in pairs]  # image rows first
        got = [
            qk_norm_rope.joint_rotated(*q_pair, attn.norm_added_q, attn.norm_q, rope),
            qk_norm_rope.joint_rotated(*k_pair, attn.norm_added_k, attn.norm_k, rope),
        ]
    for g, w in zip(got, want):
        assert g.shape == w.shape == (213, 5, 3, 128) and g.dtype == torch.bfloat16
        diff = (g.float() - w.float()).abs()
        assert (diff > 0).float().mean().item() < 2e-3
        assert (diff <= 2**-6 * w.float().abs().amax(-1, keepdim=True)).all()  # a step of the head's values


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True])
def test_compiled_rollout_block_uses_the_kernel_and_agrees(lora):
    """A compiled sequence-major block without grad calls the q/k kernel, the joint v projection
    and the modulated-norm kernel (in the generated code) and gives the block's output as with
    inductor's own kernels, up to bf16 rounding; with grad (the training graph) it keeps
    inductor's kernels. With the trainer's LoRA adapter the same holds, its low-rank terms folded
    into the projections (flowrl::lora_linear, and the joint v projection's LoRA operands)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._inductor.utils import run_and_get_code

    outputs = {}
    for use_kernel in (True, False):
        block, kwargs = _compiled_sequence_major_block(use_kernel, lora)
        with torch.no_grad():
            out, code = run_and_get_code(lambda: block(**kwargs))
        code = "\n".join(code)
        assert ("joint_norm_rope" in code) == use_kernel
        assert ("joint_linear" in code) == use_kernel  # v written into the joint buffer
        assert ("_modulated_norm_kernel" in code) == use_kernel  # flowrl.accel.qwen_image.modulated_norm
        assert ("lora_linear" in code) == (use_kernel and lora)  # q, k and the output projections
        outputs[use_kernel] = torch.cat([t.float().flatten() for t in out])
        if use_kernel:
            _, grad_code = run_and_get_code(lambda: block(**kwargs))  # grad enabled: the training graph
            grad_code = "\n".join(grad_code)
            assert "joint_norm_rope" not in grad_code and "lora_linear" not in grad_code
            assert "_modulated_norm_kernel" not in grad_code
    torch.testing.assert_close(outputs[True], outputs[False], atol=0.05, rtol=0.02)


@pytest.mark.gpu
def test_compiled_rollout_block_under_autocast_keeps_autocast_rounding():
    """Under bf16 autocast (a rollout with the trainer's mixed precision) LayerNorm returns
    float32, so the modulated input is rounded once, by the next linear layer. The modulated-norm
    kernel rounds as a bf16 model without autocast does, so it may not run there (with it, the
    rollout's and trainer's log-probs differed by mean 2.4e-5). The q/k kernel's RMSNorm
    and rotation are the same under autocast, and the joint v projection casts its inputs as
    autocast does, so both stay."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._inductor.utils import run_and_get_code

    block, kwargs = _compiled_sequence_major_block(use_kernels=True)
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, code = run_and_get_code(lambda: block(**kwargs))
            eager = qwen_block._sequence_major_forward(block, **kwargs)
        _, plain_code = run_and_get_code(lambda: block(**kwargs))  # autocast off: a graph of its own
    code, plain_code = "\n".join(code), "\n".join(plain_code)
    assert "joint_norm_rope" in code and "_modulated_norm_kernel" not in code and "joint_linear" in code
    assert "_modulated_norm_kernel" in plain_code and "joint_linear" in plain_code
    for got, want in zip(out, eager):
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [3072, 320])  # Qwen-Image's width, and one that is no power of two
def test_modulated_norm_kernel_rounds_like_pytorch(width):
    """flowrl.accel.qwen_image.modulated_norm on CUDA against the block's PyTorch expressions in bf16: the
    gate + residual bit for bit; LayerNorm + modulation equal up to the float32 reduction order
    of the mean and variance, which moves a small fraction of the values by one bf16 step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from flowrl.accel.qwen_image import modulated_norm

    torch.manual_seed(0)
    x, y = (torch.randn(37, 5, width, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2))
    params = torch.randn(5, 6 * width, device="cuda", dtype=torch.bfloat16)  # a modulation output
    shift, scale, gate = params[:, : 3 * width].chunk(3, dim=-1)  # strided views, as in the block
    norm = torch.nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
    assert modulated_norm.applicable(x, norm) and not modulated_norm.applicable(x.cpu(), norm)
    assert not modulated_norm.applicable(x, torch.nn.LayerNorm(width).cuda())  # affine weights: not reproduced

    def close(got, want):
        diff = (got.float() - want.float()).abs()
        assert (diff > 0).float().mean().item() < 2e-3
        assert (diff <= 2**-7 * want.float().abs().amax(-1, keepdim=True) + 2**-7).all()

    with torch.no_grad():
        want_sum = x + gate * y
        assert torch.equal(modulated_norm.residual(x, gate, y), want_sum)
        close(modulated_norm.modulated(x, norm, shift, scale), norm(x) * (1 + scale) + shift)
        got_sum, got_mod = modulated_norm.residual_modulated(x, gate, y, norm, shift, scale)
        assert torch.equal(got_sum, want_sum)
        close(got_mod, norm(want_sum) * (1 + scale) + shift)

"""Qwen-Image transformer blocks as the engine compiles them: real-arithmetic RoPE, a
sequence-major memory layout, and hand-written kernels and a modulation table for the rollout.

All are installed per instance by `prepare_for_compile` (flowrl.accel.compile_adapter). The first
two change how the same math runs and are exact in float32 (tests/accel/test_qwen_block.py); the
others serve only rollout forwards (no grad), are exact up to bf16 rounding, and each has a
switch of flowrl.accel.options.AccelOptions (named below; a block reads them from
`block._flowrl_accel`):

1. Rotary embeddings in real arithmetic (`_rotate`, tables from `_real_rope_tables`): diffusers
   rotates with complex tensors, for which inductor generates no code, so they would run eagerly
   (several extra float32 passes over q and k per block).

2. Sequence-major activations (`sequence_major`). Joint attention runs over [text tokens, image tokens]. With
   diffusers' batch-major (B, L, D) activations that join is a copy of q, k and v into a joint
   buffer (for v, whose producers are GEMMs, a kernel of its own), and the split of the attention
   output back into the two streams is another copy of the whole output. Stored sequence-major
   ((L, B, D) in memory; the tensors still have the (B, L, D) shape diffusers passes between
   blocks), each stream is a contiguous run of rows of the joint buffer: cuDNN attention writes
   its output in its query's layout, so the two output projections read their rows in place.
   The image rows come first, so the keys a row with padded text sees are a prefix of the joint
   sequence: rollout forwards attend per run of equal text lengths without a mask
   (flowrl.accel.qwen_image.prefix_attention; `prefix_attention`).
   (Inductor writes a GEMM's output only into a buffer of its own, so the v join is a copy,
   except in rollout graphs: item 3.) The training step gains most, its graphs copying more.
   The transformer's input projections (`img_in`, `txt_in`) hand the first block sequence-major
   tensors through forward hooks, every block returns that layout, and the final norm reads it.
   A block also accepts batch-major tensors (then the layout costs copies, not correctness).

3. In the rollout's compiled graphs (no grad), the joint q and k are built by a hand-written
   Triton kernel (flowrl.accel.qwen_image.qk_norm_rope: RMSNorm, rotation and the text/image
   join, with eager's rounding points; `qk_kernel`). Training graphs and eager runs keep the
   PyTorch expression (`_normed_rotated`). There, too, the text and image v projections write
   into one joint buffer (flowrl.accel.qwen_image.joint_linear; `joint_v`) instead of being
   copied into it. Both take LoRA-wrapped projections too: in these graphs the low-rank term is
   accumulated inside the projection's GEMM output (flowrl.accel.lora_fold).

4. Also in the rollout's compiled graphs, each stream's LayerNorm + modulation, gate + residual,
   and the two together run in one hand-written kernel (flowrl.accel.qwen_image.modulated_norm;
   `norm_kernel`) instead of inductor's three, with eager's rounding points.

5. The modulation parameters come from the block's `img_mod` / `txt_mod` GEMMs, or, when the
   forward's `joint_attention_kwargs` carry table rows (rollout forwards without grad), from a
   per-timestep table computed once per weight version (flowrl.accel.qwen_image.modulation;
   `modulation_table`).

Blocks that need features this forward does not implement (per-token modulation of the edit
models, `zero_cond_t`, attention kwargs) run diffusers' own forward with the real-RoPE processor.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

import flowrl.accel.qwen_image.joint_linear as joint_linear
import flowrl.accel.qwen_image.modulated_norm as modulated_norm
import flowrl.accel.qwen_image.prefix_attention as prefix_attention
import flowrl.accel.qwen_image.qk_norm_rope as qk_norm_rope
from flowrl.accel.lora_fold import folds
from flowrl.accel.options import AccelOptions
from flowrl.accel.qwen_image.modulation import ROWS_KEY


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., D) with adjacent pairs (x[2k], x[2k+1]) as (re, im): the
    complex product (re + i im)(cos_k + i sin_k), in real arithmetic, in float32. The tables are
    expanded to the head width (see `_real_rope_tables`) and broadcast against x by the caller:
    cos = (c0, c0, c1, c1, ...), sin = (-s0, s0, -s1, s1, ...), so out = x * cos + swap_pairs(x) *
    sin. This pair-swap form compiles to a much faster kernel than unbinding and re-stacking the
    pairs (benchmarks/qwen_block_parts.py times both)."""
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos + swapped * sin).type_as(x)


def _real_rope_tables(module, args, output):
    """Forward hook of the transformer's RoPE module: complex tables (S, D/2) -> the expanded real
    tables `_rotate` takes, (S, D) each, once per forward and outside the compiled blocks."""
    tables = []
    for freqs in output:
        cos, sin = freqs.real.float(), freqs.imag.float()
        tables.append(
            (cos.repeat_interleave(2, dim=-1).contiguous(), torch.stack([-sin, sin], dim=-1).flatten(-2).contiguous())
        )
    return tuple(tables)


def _joint_mask(text_mask: torch.Tensor | None, batch: int, image_tokens: int, image_first: bool = False):
    """(B, 1, 1, L) boolean mask over the joint keys ([text, image], or [image, text] with
    `image_first`) from the text mask (B, L_txt), or None."""
    if text_mask is None:
        return None
    image_mask = text_mask.new_ones((batch, image_tokens))
    parts = (image_mask, text_mask) if image_first else (text_mask, image_mask)
    return torch.cat(parts, dim=1)[:, None, None, :]


def _split_heads(attn, x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (attn.heads, -1))


def _projected_heads(attn, img: torch.Tensor, txt: torch.Tensor):
    """Both streams' q, k, v projections split into heads: three (text, image) pairs."""
    projections = ((attn.add_q_proj, attn.to_q), (attn.add_k_proj, attn.to_k), (attn.add_v_proj, attn.to_v))
    return tuple(
        (_split_heads(attn, txt_proj(txt)), _split_heads(attn, img_proj(img))) for txt_proj, img_proj in projections
    )


def _rotated_qkv(attn, img: torch.Tensor, txt: torch.Tensor, rope, seq_dim: int):
    """Both streams' q, k, v, split into heads, with q and k RMS-normed and rotated: three
    (text, image) pairs. seq_dim: the token dim of img and txt (1 batch-major, 0 sequence-major);
    rope: the (cos, sin) tables of the image and the text tokens, (S, Dh) each, or None."""
    return _normed_rotated(attn, *_projected_heads(attn, img, txt), rope, seq_dim)


def _normed_rotated(attn, q_pair, k_pair, v_pair, rope, seq_dim: int):
    """_rotated_qkv after the projections: q and k pairs RMS-normed and rotated, v as it is."""
    (txt_q, img_q), (txt_k, img_k) = q_pair, k_pair
    img_q, img_k = attn.norm_q(img_q), attn.norm_k(img_k)
    txt_q, txt_k = attn.norm_added_q(txt_q), attn.norm_added_k(txt_k)
    if rope is not None:  # tables (S, Dh) -> (S, 1, ..., Dh), broadcasting over the dims after the tokens
        ones = [1] * (img_q.dim() - seq_dim - 2)
        (img_cos, img_sin), (txt_cos, txt_sin) = (
            (c.view(c.shape[0], *ones, -1), s.view(s.shape[0], *ones, -1)) for c, s in rope
        )
        img_q, img_k = _rotate(img_q, img_cos, img_sin), _rotate(img_k, img_cos, img_sin)
        txt_q, txt_k = _rotate(txt_q, txt_cos, txt_sin), _rotate(txt_k, txt_cos, txt_sin)
    return (txt_q, img_q), (txt_k, img_k), v_pair


def _plain_qk_projections(attn) -> bool:
    """The q and k projections of both streams produce plain GEMM outputs in the rollout's graphs:
    nn.Linear, or LoRA Linears whose low-rank term is accumulated inside the GEMM's output there
    (flowrl.accel.lora_fold). Left to inductor, a LoRA projection's output is a sum that would
    have to be stored before the hand-written kernel reads it."""
    return all(type(p) is torch.nn.Linear or folds(p) for p in (attn.to_q, attn.to_k, attn.add_q_proj, attn.add_k_proj))


def _joint_kernel_applies(attn, img_q: torch.Tensor, rope, options: AccelOptions) -> bool:
    """Whether a sequence-major block builds its joint q and k with the hand-written kernel
    (flowrl.accel.qwen_image.qk_norm_rope): inside a compiled graph without grad (the rollout's; training
    graphs keep inductor's differentiable kernel, eager runs PyTorch's ops), on CUDA, with plain
    q/k projections and norms the kernel reproduces. Autocast does not change RMSNorm or the
    rotation, so the kernel applies under it, and the joint v projection casts its inputs as
    autocast would (flowrl.accel.qwen_image.joint_linear). `options.qk_kernel` off turns it off,
    and with it the joint v projection; `options.joint_v` off only the latter."""
    return (
        options.qk_kernel
        and not torch.is_grad_enabled()
        and torch.compiler.is_compiling()
        and _plain_qk_projections(attn)
        and all(
            qk_norm_rope.applicable(img_q, norm, rope)
            for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
        )
    )


def _joint_qkv(attn, img: torch.Tensor, txt: torch.Tensor, rope, options: AccelOptions):
    """The joint (L_img + L_txt, B, H, Dh) q, k, v of sequence-major streams, image rows first (the
    keys a row with padded text sees are then a prefix: flowrl.accel.qwen_image.prefix_attention)."""
    q_pair = (_split_heads(attn, attn.add_q_proj(txt)), _split_heads(attn, attn.to_q(img)))
    k_pair = (_split_heads(attn, attn.add_k_proj(txt)), _split_heads(attn, attn.to_k(img)))
    if not _joint_kernel_applies(attn, q_pair[1], rope, options):
        v_pair = (_split_heads(attn, attn.add_v_proj(txt)), _split_heads(attn, attn.to_v(img)))
        pairs = _normed_rotated(attn, q_pair, k_pair, v_pair, rope, seq_dim=0)
        return tuple(torch.cat((img_part, txt_part)) for txt_part, img_part in pairs)
    q = qk_norm_rope.joint_rotated(*q_pair, attn.norm_added_q, attn.norm_q, rope)
    k = qk_norm_rope.joint_rotated(*k_pair, attn.norm_added_k, attn.norm_k, rope)
    if options.joint_v and joint_linear.applies(attn.to_v, attn.add_v_proj):
        v = joint_linear.joint_projection(img, attn.to_v, txt, attn.add_v_proj, options.lora_low_rank_first)
        return q, k, _split_heads(attn, v)
    return q, k, torch.cat((_split_heads(attn, attn.to_v(img)), _split_heads(attn, attn.add_v_proj(txt))))


class RealRopeQwenAttention:
    """Qwen-Image's joint text-image attention (the math of diffusers' QwenDoubleStreamAttnProcessor2_0)
    on batch-major tensors with real-arithmetic RoPE: the processor of blocks that run diffusers'
    forward (see the module docstring). Takes the tables made by `_real_rope_tables`."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        attention_mask=None,
        image_rotary_emb=None,
    ):
        assert encoder_hidden_states is not None and attention_mask is None
        attention_mask = _joint_mask(encoder_hidden_states_mask, *hidden_states.shape[:2])
        pairs = _rotated_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb, seq_dim=1)
        # Joint sequence [text, image] (diffusers' order in this batch-major path); SDPA wants (B, H, L, D).
        q, k, v = (torch.cat(pair, dim=1).transpose(1, 2) for pair in pairs)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[1](attn.to_out[0](out[:, seq_txt:].contiguous()))  # to_out[1]: dropout
        return img_out, attn.to_add_out(out[:, :seq_txt].contiguous())


def _joint_attention(
    attn,
    img: torch.Tensor,
    txt: torch.Tensor,
    text_mask: torch.Tensor | None,
    rope,
    options: AccelOptions = AccelOptions(),
    text_lengths: torch.Tensor | None = None,
):
    """RealRopeQwenAttention's math on sequence-major streams img (L_img, B, D), txt (L_txt, B, D);
    returns the two streams' outputs, sequence-major. The joint buffers are (L, B, H, Dh) with the
    image rows first, so each stream is a contiguous block of rows (see the module docstring).
    text_lengths: each row's valid text tokens (a CPU int64 tensor; the mask's leading True
    values), with which a padded batch runs `prefix_attention` instead of the masked call (the
    hook passes them only where that pays)."""
    image_tokens, batch = img.shape[:2]
    # (L, B, H, Dh) -> the (B, H, L, Dh) view SDPA takes; no copy.
    q, k, v = (t.permute(1, 2, 0, 3) for t in _joint_qkv(attn, img, txt, rope, options))
    if text_mask is not None and text_lengths is not None and options.prefix_attention and prefix_attention.applies(q):
        out = prefix_attention.attention(q, k, v, text_lengths, key_offset=image_tokens)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=_joint_mask(text_mask, batch, image_tokens, image_first=True)
        )
    out = out.permute(2, 0, 1, 3).flatten(2).to(q.dtype)  # (L, B, H*Dh): a view when cuDNN kept q's layout
    img_out = attn.to_out[1](attn.to_out[0](out[:image_tokens]))  # to_out[1]: dropout
    return img_out, attn.to_add_out(out[image_tokens:])


def _autocast_on(x: torch.Tensor) -> bool:
    """Whether autocast is on for x's device. Under autocast LayerNorm returns float32, so the
    modulated input stays float32 until the next linear layer casts it once: not the bf16
    rounding points the modulated-norm kernel reproduces. (Dynamo guards compiled graphs on the
    autocast state.)"""
    return torch.is_autocast_enabled(x.device.type)


def _norm_kernel_applies(block, img: torch.Tensor) -> bool:
    """Whether a sequence-major block runs its LayerNorm + modulation and gate + residual steps
    with the hand-written kernel (flowrl.accel.qwen_image.modulated_norm): as the q/k kernel, only
    inside a compiled graph without grad (the rollout's), on CUDA, with the LayerNorms it
    reproduces, with `norm_kernel` on, and not under autocast (the trainer's mixed precision,
    whose rounding points the kernel does not reproduce: with it, a rollout under bf16 autocast
    and the trainer's graph would differ by a log-prob gap)."""
    return (
        block._flowrl_accel.norm_kernel
        and not torch.is_grad_enabled()
        and torch.compiler.is_compiling()
        and not _autocast_on(img)
        and all(
            modulated_norm.applicable(img, norm)
            for norm in (block.img_norm1, block.img_norm2, block.txt_norm1, block.txt_norm2)
        )
    )


def _modulated_input(x: torch.Tensor, norm, params: torch.Tensor, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Adaptive-norm input of sequence-major x (L, B, D) with per-row params (B, 3D): norm(x) *
    (1 + scale) + shift, with the (B, D) shift, scale and gate broadcast over the sequence dim;
    returns it and the gate."""
    shift, scale, gate = params.chunk(3, dim=-1)
    if kernel:
        return modulated_norm.modulated(x, norm, shift, scale), gate
    return norm(x) * (1 + scale) + shift, gate


def _residual_modulated_input(x, gate, y, norm, params: torch.Tensor, kernel: bool):
    """x + gate * y, then that sum's `_modulated_input`: (sum, input, gate)."""
    if not kernel:
        x = x + gate * y
        return x, *_modulated_input(x, norm, params, kernel)
    shift, scale, next_gate = params.chunk(3, dim=-1)
    x, modulated = modulated_norm.residual_modulated(x, gate, y, norm, shift, scale)
    return x, modulated, next_gate


def _gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, kernel: bool) -> torch.Tensor:
    return modulated_norm.residual(x, gate, y) if kernel else x + gate * y


def _sequence_major_forward(
    self,
    hidden_states,
    encoder_hidden_states,
    encoder_hidden_states_mask,
    temb,
    image_rotary_emb=None,
    joint_attention_kwargs=None,
    modulate_index=None,
):
    """QwenImageTransformerBlock.forward's math on sequence-major activations (module docstring).
    Same signature and return value ((text, image) states of diffusers' shapes)."""
    kwargs = dict(joint_attention_kwargs or {})
    table_rows = kwargs.pop(ROWS_KEY, None)
    text_lengths = kwargs.pop(prefix_attention.TEXT_LENGTHS_KEY, None)
    if modulate_index is not None or self.zero_cond_t or kwargs:
        return type(self).forward(
            self,
            hidden_states,
            encoder_hidden_states,
            encoder_hidden_states_mask,
            temb,
            image_rotary_emb,
            joint_attention_kwargs,
            modulate_index,
        )
    img, txt = hidden_states.transpose(0, 1), encoder_hidden_states.transpose(0, 1)  # (L, B, D)
    if table_rows is None:
        img_mod, txt_mod = self.img_mod(temb), self.txt_mod(temb)
    else:  # rows of the per-timestep table (flowrl.accel.qwen_image.modulation), no GEMM
        img_mod, txt_mod = self._flowrl_modulation.index_select(1, table_rows).unbind(0)
    img_mod1, img_mod2 = img_mod.chunk(2, dim=-1)
    txt_mod1, txt_mod2 = txt_mod.chunk(2, dim=-1)
    kernel = _norm_kernel_applies(self, img)
    img_in, img_gate1 = _modulated_input(img, self.img_norm1, img_mod1, kernel)
    txt_in, txt_gate1 = _modulated_input(txt, self.txt_norm1, txt_mod1, kernel)
    img_attn, txt_attn = _joint_attention(
        self.attn, img_in, txt_in, encoder_hidden_states_mask, image_rotary_emb, self._flowrl_accel, text_lengths
    )
    img, img_in, img_gate2 = _residual_modulated_input(img, img_gate1, img_attn, self.img_norm2, img_mod2, kernel)
    txt, txt_in, txt_gate2 = _residual_modulated_input(txt, txt_gate1, txt_attn, self.txt_norm2, txt_mod2, kernel)
    img = _gated_residual(img, img_gate2, self.img_mlp(img_in), kernel)
    txt = _gated_residual(txt, txt_gate2, self.txt_mlp(txt_in), kernel)
    if img.dtype == torch.float16:  # diffusers' overflow guard
        img, txt = img.clip(-65504, 65504), txt.clip(-65504, 65504)
    return txt.transpose(0, 1), img.transpose(0, 1)


def _sequence_major_output(module, args, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of the input projections: (B, L, D) output stored sequence-major."""
    return output.transpose(0, 1).contiguous().transpose(0, 1)


def prepare_block(block: torch.nn.Module, options: AccelOptions = AccelOptions()) -> None:
    """Switch one QwenImageTransformerBlock, per instance, to the real-RoPE processor and (with
    `options.sequence_major`) the sequence-major forward, reading its switches from `options`.
    Its inputs must then come in that layout (prepare_for_compile's hooks store them so)."""
    block.attn.set_processor(RealRopeQwenAttention())
    if options.sequence_major:
        block.forward = types.MethodType(_sequence_major_forward, block)
    block._flowrl_accel = options


def prepare_for_compile(transformer: torch.nn.Module, options: AccelOptions = AccelOptions()) -> bool:
    """Switch a QwenImageTransformer2DModel, per instance, to real-arithmetic RoPE and (unless
    `options.sequence_major` is off: the batch-major baseline that benchmarks compare against)
    sequence-major blocks; see the module docstring. Parameters and state_dict keys are unchanged.
    Returns False when it was switched already; the blocks then take the new `options`, whose
    layout must be the first call's."""
    if getattr(transformer, "_flowrl_compile_ready", False):
        if transformer._flowrl_sequence_major != options.sequence_major:
            raise ValueError(
                f"sequence_major={options.sequence_major} but this transformer's blocks run "
                f"sequence_major={transformer._flowrl_sequence_major} already; the layout is fixed "
                "by the first compile_adapter call"
            )
        for block in transformer.transformer_blocks:
            block._flowrl_accel = options
        return False
    transformer.pos_embed.register_forward_hook(_real_rope_tables)
    for block in transformer.transformer_blocks:
        prepare_block(block, options)
    if options.sequence_major:
        transformer.img_in.register_forward_hook(_sequence_major_output)
        transformer.txt_in.register_forward_hook(_sequence_major_output)
    transformer._flowrl_sequence_major = options.sequence_major
    transformer._flowrl_compile_ready = True
    return True

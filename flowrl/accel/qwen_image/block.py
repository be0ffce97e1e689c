"""Qwen-Image transformer blocks as the engine compiles them: real-arithmetic RoPE and a
sequence-major memory layout.

Both are installed per instance by `prepare_for_compile` (flowrl.accel.compile_adapter), change
how the same math runs and are exact in float32 (tests/accel/test_qwen_block.py):

1. Rotary embeddings in real arithmetic (`_rotate`, tables from `_real_rope_tables`): diffusers
   rotates with complex tensors, for which inductor generates no code, so they would run eagerly
   (several extra float32 passes over q and k per block).

2. Sequence-major activations (`sequence_major`, a switch of flowrl.accel.options.AccelOptions).
   Joint attention runs over [text tokens, image tokens]. With diffusers' batch-major (B, L, D)
   activations that join is a copy of q, k and v into a joint buffer, and the split of the
   attention output back into the two streams is another copy of the whole output. Stored
   sequence-major ((L, B, D) in memory; the tensors still have the (B, L, D) shape diffusers
   passes between blocks), each stream is a contiguous run of rows of the joint buffer: cuDNN
   attention writes its output in its query's layout, so the two output projections read their
   rows in place. The transformer's input projections (`img_in`, `txt_in`) hand the first block
   sequence-major tensors through forward hooks, every block returns that layout, and the final
   norm reads it. A block also accepts batch-major tensors (then the layout costs copies, not
   correctness).

Blocks that need features this forward does not implement (per-token modulation of the edit
models, `zero_cond_t`, attention kwargs) run diffusers' own forward with the real-RoPE processor.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from flowrl.accel.options import AccelOptions


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., D) with adjacent pairs (x[2k], x[2k+1]) as (re, im): the
    complex product (re + i im)(cos_k + i sin_k), in real arithmetic, in float32. The tables are
    expanded to the head width (see `_real_rope_tables`) and broadcast against x by the caller:
    cos = (c0, c0, c1, c1, ...), sin = (-s0, s0, -s1, s1, ...), so out = x * cos + swap_pairs(x) *
    sin. This pair-swap form compiles to a much faster kernel than unbinding and re-stacking the
    pairs."""
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


def _joint_qkv(attn, img: torch.Tensor, txt: torch.Tensor, rope):
    """The joint (L_img + L_txt, B, H, Dh) q, k, v of sequence-major streams, image rows first."""
    pairs = _rotated_qkv(attn, img, txt, rope, seq_dim=0)
    return tuple(torch.cat((img_part, txt_part)) for txt_part, img_part in pairs)


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


def _joint_attention(attn, img: torch.Tensor, txt: torch.Tensor, text_mask: torch.Tensor | None, rope):
    """RealRopeQwenAttention's math on sequence-major streams img (L_img, B, D), txt (L_txt, B, D);
    returns the two streams' outputs, sequence-major. The joint buffers are (L, B, H, Dh) with the
    image rows first, so each stream is a contiguous block of rows (see the module docstring)."""
    image_tokens, batch = img.shape[:2]
    # (L, B, H, Dh) -> the (B, H, L, Dh) view SDPA takes; no copy.
    q, k, v = (t.permute(1, 2, 0, 3) for t in _joint_qkv(attn, img, txt, rope))
    mask = _joint_mask(text_mask, batch, image_tokens, image_first=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = out.permute(2, 0, 1, 3).flatten(2).to(q.dtype)  # (L, B, H*Dh): a view when cuDNN kept q's layout
    img_out = attn.to_out[1](attn.to_out[0](out[:image_tokens]))  # to_out[1]: dropout
    return img_out, attn.to_add_out(out[image_tokens:])


def _modulated_input(x: torch.Tensor, norm, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Adaptive-norm input of sequence-major x (L, B, D) with per-row params (B, 3D): norm(x) *
    (1 + scale) + shift, with the (B, D) shift, scale and gate broadcast over the sequence dim;
    returns it and the gate."""
    shift, scale, gate = params.chunk(3, dim=-1)
    return norm(x) * (1 + scale) + shift, gate


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
    if modulate_index is not None or self.zero_cond_t or joint_attention_kwargs:
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
    img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
    img_in, img_gate1 = _modulated_input(img, self.img_norm1, img_mod1)
    txt_in, txt_gate1 = _modulated_input(txt, self.txt_norm1, txt_mod1)
    img_attn, txt_attn = _joint_attention(self.attn, img_in, txt_in, encoder_hidden_states_mask, image_rotary_emb)
    img = img + img_gate1 * img_attn
    txt = txt + txt_gate1 * txt_attn
    img_in, img_gate2 = _modulated_input(img, self.img_norm2, img_mod2)
    txt_in, txt_gate2 = _modulated_input(txt, self.txt_norm2, txt_mod2)
    img = img + img_gate2 * self.img_mlp(img_in)
    txt = txt + txt_gate2 * self.txt_mlp(txt_in)
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

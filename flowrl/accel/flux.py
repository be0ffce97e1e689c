"""FLUX.1's fast path: its single-stream blocks without the concatenation of their two branches.

A diffusers FluxSingleTransformerBlock runs attention and an MLP side by side on the same normed
tokens, concatenates the attention output (width D) and the GELU'd MLP activation (width 4D) into
one (tokens, 5D) tensor and projects it back with `proj_out`. Compiled, the concatenation is a
kernel that reads both branches and writes the 5D-wide tensor (with the GELU folded into it), the
largest kernel of a profiled rollout after the GEMMs and attention (benchmarks/results/). The same
projection is a sum of two GEMMs over the halves of `proj_out`'s weight:

    proj_out(cat(a, m)) = a @ W[:, :D]^T + m @ W[:, D:]^T + b

so `split_output_forward` computes it that way (the weight halves are views: nothing is copied,
parameters and state_dict stay as they were), and takes the MLP's GELU inside its GEMM's epilogue
(flowrl.accel.fused_mlp, where it applies), which leaves no pass over the 4D-wide activation. The
backward splits no gradient either. Rounding: each half's GEMM rounds its sum once in the model
dtype before the two are added, where the stock projection rounds one sum; in float32 the two
differ by summation order only. Rollout and trainer run the same forward, so their log-probs
still agree.

`install(adapter, options)` (flowrl.accel.compile_adapter, family "flux") switches every single-
stream block to it, unless `options.split_output` is off. A block whose projections are not plain
biased nn.Linear (LoRA on them), or that gets attention kwargs, runs diffusers' own forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from flowrl.accel.fused_mlp import epilogue_applies, linear_gelu_tanh
from flowrl.accel.options import AccelOptions


def _splittable(block) -> bool:
    linear = torch.nn.Linear
    act = block.act_mlp
    return (
        block._flowrl_accel.split_output
        and type(block.proj_mlp) is linear
        and type(block.proj_out) is linear
        and block.proj_mlp.bias is not None
        and block.proj_out.bias is not None
        and isinstance(act, torch.nn.GELU)
        and act.approximate == "tanh"
    )


def split_output_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb=None,
    joint_attention_kwargs=None,
):
    """FluxSingleTransformerBlock.forward with `proj_out` as two GEMMs (module docstring)."""
    if joint_attention_kwargs or not _splittable(self):
        return type(self).forward(
            self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs
        )
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    proj_mlp, proj_out = self.proj_mlp, self.proj_out
    if epilogue_applies(proj_mlp, norm_hidden_states, self._flowrl_accel):
        mlp_hidden_states = linear_gelu_tanh(norm_hidden_states, proj_mlp.weight, proj_mlp.bias)
    else:
        mlp_hidden_states = self.act_mlp(proj_mlp(norm_hidden_states))
    attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb)
    width = attn_output.shape[-1]
    weight = proj_out.weight
    projected = F.linear(attn_output, weight[:, :width], proj_out.bias) + F.linear(mlp_hidden_states, weight[:, width:])
    hidden_states = residual + gate.unsqueeze(1) * projected
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def install(adapter, options: AccelOptions) -> None:
    """Route every single-stream block of `adapter.transformer` through `split_output_forward`
    with `options` (a later call's options replace the earlier ones)."""
    for block in adapter.transformer.single_transformer_blocks:
        block.forward = types.MethodType(split_output_forward, block)
        block._flowrl_accel = options

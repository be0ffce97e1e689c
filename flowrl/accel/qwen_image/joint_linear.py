"""Two streams' projections written straight into one joint buffer: the v of Qwen-Image's joint
attention without the copy that joins it.

Joint attention reads v as one (T + L, B, H*D) sequence-major buffer, text rows first. Projected
separately, text and image v are two GEMM outputs, and inductor copies them into that buffer (it
writes a GEMM's result only into a buffer of its own): a pass over v that does no arithmetic.
This custom op runs the same two cuBLAS calls (`addmm` with the bias, as `F.linear` does) with
`out=` the two row ranges of the joint buffer, so the values are the ones
`torch.cat([F.linear(txt, ...), F.linear(img, ...)])` gives, bit for bit
(tests/accel/test_joint_linear.py). Inductor keeps a custom op whole and calls it.

Used where the q/k kernel is (rollout graphs, no grad; `block._joint_qkv`), for plain
`nn.Linear` projections and for LoRA-wrapped ones whose rollout graphs fold the low-rank term
into the GEMM's output (flowrl.accel.lora_fold: the same cuBLAS calls, into the row ranges).
Under autocast the inputs are cast to the autocast dtype first, as autocast casts a linear
layer's inputs.
"""

from __future__ import annotations

import torch

from flowrl.accel import lora_fold
from flowrl.accel.lora_fold import linear_into


@torch.library.custom_op("flowrl::joint_linear", mutates_args=())
def joint_linear(
    txt: torch.Tensor,
    txt_weight: torch.Tensor,
    txt_bias: torch.Tensor | None,
    txt_down: torch.Tensor | None,
    txt_up: torch.Tensor | None,
    img: torch.Tensor,
    img_weight: torch.Tensor,
    img_bias: torch.Tensor | None,
    img_down: torch.Tensor | None,
    img_up: torch.Tensor | None,
    low_rank_first: bool,
) -> torch.Tensor:
    """(T + L, B, N): txt (T, B, K) and img (L, B, K) through their own linear layers (each with
    its LoRA factors down, up or None, in the GEMM order `low_rank_first`), joined."""
    out = txt.new_empty((txt.shape[0] + img.shape[0], txt.shape[1], txt_weight.shape[0]))
    rows = out.view(-1, out.shape[-1])
    txt_rows = txt.shape[0] * txt.shape[1]
    linear_into(txt.reshape(txt_rows, -1), txt_weight, txt_bias, rows[:txt_rows], txt_down, txt_up, low_rank_first)
    linear_into(img.reshape(-1, img.shape[-1]), img_weight, img_bias, rows[txt_rows:], img_down, img_up, low_rank_first)
    return out


@joint_linear.register_fake
def _(txt, txt_weight, txt_bias, txt_down, txt_up, img, img_weight, img_bias, img_down, img_up, low_rank_first):
    return txt.new_empty((txt.shape[0] + img.shape[0], txt.shape[1], txt_weight.shape[0]))


def _linear(proj: torch.nn.Module) -> torch.nn.Linear | None:
    """The nn.Linear that computes `proj`'s GEMM where the op can run it: proj itself, or the base
    layer of a LoRA Linear whose low-rank term folds (flowrl.accel.lora_fold.folds)."""
    if type(proj) is torch.nn.Linear:
        return proj
    return proj.base_layer if lora_fold.folds(proj) else None


def applies(txt_proj: torch.nn.Module, img_proj: torch.nn.Module) -> bool:
    """Both projections are plain nn.Linear or folding LoRA Linears, with equal output widths."""
    txt_linear, img_linear = _linear(txt_proj), _linear(img_proj)
    return txt_linear is not None and img_linear is not None and txt_linear.out_features == img_linear.out_features


def _operands(proj: torch.nn.Module, dtype: torch.dtype) -> tuple:
    """(weight, bias, down, up) of `proj` in `dtype`; down and up None for a plain Linear."""
    linear = _linear(proj)
    bias = None if linear.bias is None else linear.bias.to(dtype)
    factors = lora_fold.low_rank_factors(proj, dtype) if proj is not linear else (None, None)
    return linear.weight.to(dtype), bias, *factors


def joint_projection(
    txt: torch.Tensor,
    txt_proj: torch.nn.Module,
    img: torch.Tensor,
    img_proj: torch.nn.Module,
    low_rank_first: bool = True,
) -> torch.Tensor:
    """The joint (T + L, B, N) output of txt_proj(txt) and img_proj(img), sequence-major inputs;
    low_rank_first: the GEMM order of LoRA projections (AccelOptions.lora_low_rank_first)."""
    dtype = lora_fold.compute_dtype(img)
    return joint_linear(
        txt.to(dtype).contiguous(),
        *_operands(txt_proj, dtype),
        img.to(dtype).contiguous(),
        *_operands(img_proj, dtype),
        low_rank_first,
    )

"""Two streams' projections written straight into one joint buffer: the v of Qwen-Image's joint
attention without the copy that joins it.

Joint attention reads v as one (L + T, B, H*D) sequence-major buffer, image rows first. Projected
separately, image and text v are two GEMM outputs, and inductor copies them into that buffer (it
writes a GEMM's result only into a buffer of its own): a pass over v that does no arithmetic.
This custom op runs the same two cuBLAS calls (`addmm` with the bias, as `F.linear` does) with
`out=` the two row ranges of the joint buffer, so the values are the ones
`torch.cat([F.linear(first, ...), F.linear(second, ...)])` gives, bit for bit
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
    first: torch.Tensor,
    first_weight: torch.Tensor,
    first_bias: torch.Tensor | None,
    first_down: torch.Tensor | None,
    first_up: torch.Tensor | None,
    second: torch.Tensor,
    second_weight: torch.Tensor,
    second_bias: torch.Tensor | None,
    second_down: torch.Tensor | None,
    second_up: torch.Tensor | None,
    low_rank_first: bool,
) -> torch.Tensor:
    """(T + L, B, N): first (T, B, K) and second (L, B, K) through their own linear layers (each
    with its LoRA factors down, up or None, in the GEMM order `low_rank_first`), joined."""
    out = first.new_empty((first.shape[0] + second.shape[0], first.shape[1], first_weight.shape[0]))
    rows = out.view(-1, out.shape[-1])
    first_rows = first.shape[0] * first.shape[1]
    linear_into(
        first.reshape(first_rows, -1), first_weight, first_bias, rows[:first_rows], first_down, first_up, low_rank_first
    )
    linear_into(
        second.reshape(-1, second.shape[-1]),
        second_weight,
        second_bias,
        rows[first_rows:],
        second_down,
        second_up,
        low_rank_first,
    )
    return out


@joint_linear.register_fake
def _(
    first,
    first_weight,
    first_bias,
    first_down,
    first_up,
    second,
    second_weight,
    second_bias,
    second_down,
    second_up,
    low_rank_first,
):
    return first.new_empty((first.shape[0] + second.shape[0], first.shape[1], first_weight.shape[0]))


def _linear(proj: torch.nn.Module) -> torch.nn.Linear | None:
    """The nn.Linear that computes `proj`'s GEMM where the op can run it: proj itself, or the base
    layer of a LoRA Linear whose low-rank term folds (flowrl.accel.lora_fold.folds)."""
    if type(proj) is torch.nn.Linear:
        return proj
    return proj.base_layer if lora_fold.folds(proj) else None


def applies(first_proj: torch.nn.Module, second_proj: torch.nn.Module) -> bool:
    """Both projections are plain nn.Linear or folding LoRA Linears, with equal output widths."""
    first_linear, second_linear = _linear(first_proj), _linear(second_proj)
    return (
        first_linear is not None
        and second_linear is not None
        and first_linear.out_features == second_linear.out_features
    )


def _operands(proj: torch.nn.Module, dtype: torch.dtype) -> tuple:
    """(weight, bias, down, up) of `proj` in `dtype`; down and up None for a plain Linear and for
    a LoRA Linear's merged weight (flowrl.accel.lora_fold.rollout_operands)."""
    linear = _linear(proj)
    if proj is not linear:
        return lora_fold.rollout_operands(proj, dtype)
    bias = None if linear.bias is None else linear.bias.to(dtype)
    return linear.weight.to(dtype), bias, None, None


def joint_projection(
    first: torch.Tensor,
    first_proj: torch.nn.Module,
    second: torch.Tensor,
    second_proj: torch.nn.Module,
    low_rank_first: bool = True,
) -> torch.Tensor:
    """The joint (T + L, B, N) output of first_proj(first) then second_proj(second), sequence-major
    inputs; low_rank_first: the GEMM order of LoRA projections (AccelOptions.lora_low_rank_first)."""
    dtype = lora_fold.compute_dtype(second)
    return joint_linear(
        first.to(dtype).contiguous(),
        *_operands(first_proj, dtype),
        second.to(dtype).contiguous(),
        *_operands(second_proj, dtype),
        low_rank_first,
    )

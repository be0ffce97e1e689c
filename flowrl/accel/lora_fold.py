"""A LoRA projection of the rollout's compiled graphs as one op that adds the low-rank term inside
cuBLAS: `flowrl::lora_linear`.

Outside compiled graphs, and in training graphs, a LoRA Linear runs the trainer's forward
(flowrl.models.lora.forward_in_activation_dtype: base(x) + (x A^T)(s B)^T in x's dtype). In a
compiled graph without grad (the rollout's, and the trainer's value pass, which runs the same
graph: flowrl.trainer.logprob) `folded_forward` runs the projection as one custom op that inductor
keeps whole. Left to inductor, the sum base + low-rank is a separate pass over the projection's
output: the low-rank GEMM writes a full-width output that an add kernel reads again. The op instead
runs x A^T, then the low-rank GEMM with the base layer's bias into the output, then the base GEMM
accumulating into it in place (cuBLAS beta = 1, read in the GEMM's epilogue): no add kernel, and its output is a plain tensor the GELU epilogue takes.

A LoRA projection followed by a tanh GELU (the first projection of an adapted MLP) cannot take the
GELU into the GEMM that accumulates (cuBLASLt applies it only with a bias vector, not with beta =
1), and a separate GELU pass would read and write the 4x-wide activation once more. There
`lora_linear_gelu_tanh` runs one GEMM over the joint contraction [x | x A^T] [W | s B]^T, with the
bias and the GELU in its epilogue (flowrl.accel.fused_mlp calls it): it copies x into the joint
input instead of writing the wide low-rank output, reading it back and running the GELU pass.

During a training rollout on merged weights (flowrl.accel.lora_merge) the same entry points run
a merged projection as the plain GEMM with W' = W + s B A, so the fast paths that need plain GEMM
outputs still apply.

Exactness: the base GEMM's product is not rounded on its own (the low-rank term plus bias is,
once), so the values differ from the eager expression's by bf16 rounding (in float32 only the
summation order differs); the trainer's log-prob values come from this same graph when the model
is compiled, so the PPO ratio does not see it (tests/trainer/test_gpu.py). Training graphs keep
the differentiable expression.

Under autocast (the trainer's mixed precision, which rollouts share) the op's inputs are cast to
the autocast dtype first, as autocast casts a linear layer's inputs.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from flowrl.accel.options import AccelOptions
from flowrl.models.lora import forward_in_activation_dtype, merged_weight


def _foldable_adapter(layer) -> str | None:
    """The name of a peft LoRA Linear's one active plain adapter, if the folded op computes it;
    None for an adapter disabled or merged, a variant (DoRA ...), several active adapters, dropout,
    a bias on B, or a layer compiled with `lora_fold=False`."""
    options = getattr(layer, "_flowrl_accel", None)
    if options is None or not options.lora_fold or layer.disable_adapters or layer.merged or layer.lora_variant:
        return None
    names = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(names) != 1:
        return None
    name = names[0]
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity) or layer.lora_B[name].bias is not None:
        return None
    return name


def low_rank_factors(layer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, s B) of the adapter `_foldable_adapter` names, cast to `dtype` (the casts carry
    gradients to the float32 master weights); None where there is none."""
    name = _foldable_adapter(layer)
    if name is None:
        return None
    return layer.lora_A[name].weight.to(dtype), (layer.lora_B[name].weight * layer.scaling[name]).to(dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes x in: autocast's where autocast is on for x's device."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def folds(layer) -> bool:
    """Whether `layer` (any module) is a LoRA Linear whose rollout graphs compute it as plain GEMM
    outputs: on `folded_forward` (installed by `fold_lora_projections`) with an adapter
    `flowrl::lora_linear` computes, or with a training rollout's merged weight
    (flowrl.accel.lora_merge)."""
    if not isinstance(getattr(layer, "base_layer", None), torch.nn.Linear):
        return False
    return merged_weight(layer) is not None or _foldable_adapter(layer) is not None


def rollout_operands(layer, dtype: torch.dtype) -> tuple:
    """(weight, bias, down, up) in `dtype` of a layer that `folds` in a rollout graph: the merged
    weight and no low-rank factors (None, None) during a merged rollout, else the base weight and
    the adapter's (A, s B)."""
    base = layer.base_layer
    bias = None if base.bias is None else base.bias.to(dtype)
    merged = merged_weight(layer)
    if merged is not None:
        return merged.to(dtype), bias, None, None
    return base.weight.to(dtype), bias, *low_rank_factors(layer, dtype)


def _in_rollout_graph() -> bool:
    return not torch.is_grad_enabled() and torch.compiler.is_compiling()


def folded_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The trainer's LoRA forward, with the projection as `flowrl::lora_linear` in rollout graphs
    (module docstring)."""
    if not (args or kwargs) and _in_rollout_graph() and folds(self):
        dtype = compute_dtype(x)
        weight, bias, down, up = rollout_operands(self, dtype)
        if down is None:
            return F.linear(x.to(dtype), weight, bias)
        return lora_linear(x.to(dtype), weight, bias, down, up)
    return forward_in_activation_dtype(self, x, *args, **kwargs)


def folded_gelu_forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(layer(x)) as `flowrl::lora_linear_gelu_tanh` in a rollout graph, where `layer` folds
    (`folds`) and its base layer has a bias (module docstring); None elsewhere."""
    if not (_in_rollout_graph() and folds(layer) and layer.base_layer.bias is not None):
        return None
    dtype = compute_dtype(x)
    return lora_linear_gelu_tanh(x.to(dtype), *rollout_operands(layer, dtype))


def fold_lora_projections(module: torch.nn.Module, options: AccelOptions = AccelOptions()) -> int:
    """Put every LoRA Linear under `module` that runs the trainer's forward (flowrl.models.lora)
    on `folded_forward` with `options`; returns how many. Layers on peft's own forward are left
    alone. Idempotent; a later call's options replace the earlier ones."""
    count = 0
    for layer in module.modules():
        if getattr(layer, "_flowrl_lora_forward", False):
            layer.forward = types.MethodType(folded_forward, layer)
            layer._flowrl_accel = options
            count += 1
    return count


def _gemm_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def linear_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    down: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
) -> None:
    """out (M, N) = x (M, K) W^T + bias [+ (x down^T) up^T]: the low-rank GEMM with the bias writes
    out and the base GEMM accumulates into it in place (cuBLAS beta = 1), so the sum needs no pass
    of its own."""
    if down is None:
        _gemm_into(x, weight, bias, out)
        return
    _gemm_into(torch.mm(x, down.t()), up, bias, out)
    out.addmm_(x, weight.t())


@torch.library.custom_op("flowrl::lora_linear", mutates_args=())
def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    down: torch.Tensor,
    up: torch.Tensor,
) -> torch.Tensor:
    """x (..., K) W^T + bias + (x down^T) up^T, (..., N), in x's dtype (all inputs in it)."""
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty((rows.shape[0], weight.shape[0]))
    linear_into(rows, weight, bias, out, down, up)
    return out.view(*x.shape[:-1], weight.shape[0])


@lora_linear.register_fake
def _(x, weight, bias, down, up):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("flowrl::lora_linear_gelu_tanh", mutates_args=())
def lora_linear_gelu_tanh(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, down: torch.Tensor | None, up: torch.Tensor | None
) -> torch.Tensor:
    """gelu_tanh(x (..., K) W^T + bias + (x down^T) up^T), (..., N), in x's dtype: one GEMM over
    [x | x down^T] (M, K + r) and [W | up] (N, K + r), the bias and GELU in its epilogue on CUDA;
    without factors (a merged weight) the GEMM over x and W alone."""
    rows = x.reshape(-1, x.shape[-1])
    joint, weights = rows, weight
    if down is not None:
        joint = torch.cat([rows, torch.mm(rows, down.t())], dim=1)
        weights = torch.cat([weight, up], dim=1)
    if x.is_cuda:
        out = torch._addmm_activation(bias, joint, weights.t(), use_gelu=True)
    else:
        out = F.gelu(torch.addmm(bias, joint, weights.t()), approximate="tanh")
    return out.view(*x.shape[:-1], weight.shape[0])


@lora_linear_gelu_tanh.register_fake
def _(x, weight, bias, down, up):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))

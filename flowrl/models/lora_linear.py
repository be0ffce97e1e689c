"""LoRA-wrapped linear layers as flowrl runs them: the low-rank product in the activations' dtype
everywhere, and in the rollout's compiled graphs the low-rank term added inside cuBLAS.

`forward_in_activation_dtype` replaces a peft LoRA Linear's forward per instance (installed by
flowrl.trainer.lora.apply_trainable). It computes base(x) + (x A^T)(s B)^T with the float32 master
weights A and s B cast to x's dtype; peft's own forward casts the activations to float32 instead,
which on a bf16 model makes every adapted projection two float32 GEMMs on CUDA cores plus float32
copies of its input and output (Qwen-Image rollout with rank-32 LoRA: 0.614 -> 0.693 img/s on an
H200, docs/benchmarks.md runs 24-25).

In a compiled graph without grad (the rollout's, and the trainer's value pass, which runs the
same graph: flowrl.trainer.policy) the projection is one custom op, `flowrl::lora_linear`, that
inductor keeps whole. Left to inductor, the sum base + low-rank is a separate pass over the
projection's output: the low-rank GEMM writes a full-width output that an add kernel (or the
fused q/k kernel) reads again, and the hand-written q/k kernel and joint v projection of Qwen-Image
blocks (flowrl.models.qwen_block) cannot apply, because their inputs would have to be stored as
sums first. The op instead runs x A^T, then the low-rank GEMM with the base layer's bias into the
output, then the base GEMM accumulating into it in place (cuBLAS beta = 1, read in the GEMM's
epilogue): no add kernel, and its output is a plain tensor those kernels take. On an H200,
LoRA's cost per B=16 Qwen-Image block fell from 0.67 to 0.37 ms with the base GEMM written first
(docs/benchmarks.md run 42), and this order took 0.08 ms less again (run 43). The base GEMM's
product is not rounded on its own (the low-rank term plus bias is, once), so the values differ
from the eager expression's by bf16 rounding; the trainer's log-prob values come from this same
graph when the model is compiled, so the PPO ratio does not see it (the compiled-training GPU
test, tests/trainer/test_gpu.py). Training graphs keep the differentiable expression.

Under autocast (the trainer's mixed precision, which rollouts share) the op's inputs are cast to
the autocast dtype first, as autocast casts a linear layer's inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _foldable_adapter(layer) -> str | None:
    """The name of a peft LoRA Linear's one active plain adapter, if the folded op computes it;
    None for an adapter disabled or merged, a variant (DoRA ...), several active adapters, dropout,
    or a bias on B. `layer._flowrl_lora_fold = False` turns the fold off (benchmark A/B)."""
    if not getattr(layer, "_flowrl_lora_fold", True) or layer.disable_adapters or layer.merged or layer.lora_variant:
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
    """Whether `layer` (any module) is a LoRA Linear whose rollout graphs run `flowrl::lora_linear`:
    its forward is flowrl's (not peft's) and its adapter is one the op computes."""
    return (getattr(layer, "_flowrl_lora_forward", False)
            and isinstance(getattr(layer, "base_layer", None), torch.nn.Linear)
            and _foldable_adapter(layer) is not None)


def _in_rollout_graph() -> bool:
    return not torch.is_grad_enabled() and torch.compiler.is_compiling()


def forward_in_activation_dtype(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft LoRA Linear's forward with the low-rank product in x's dtype (module docstring);
    anything this does not cover (adapter disabled or merged, extra arguments, DoRA and other
    variants) runs peft's forward."""
    if self.disable_adapters or self.merged or args or kwargs or self.lora_variant:
        return type(self).forward(self, x, *args, **kwargs)
    if _in_rollout_graph() and isinstance(self.base_layer, torch.nn.Linear):
        dtype = compute_dtype(x)
        factors = low_rank_factors(self, dtype)
        if factors is not None:
            base = self.base_layer
            bias = None if base.bias is None else base.bias.to(dtype)
            return lora_linear(x.to(dtype), base.weight.to(dtype), bias, *factors)
    result = self.base_layer(x)
    for name in self.active_adapters:
        if name in self.lora_A:
            down = self.lora_A[name].weight.to(x.dtype)
            up = (self.lora_B[name].weight * self.scaling[name]).to(x.dtype)
            result = result + F.linear(F.linear(self.lora_dropout[name](x), down), up)
    return result


# Which GEMM of a folded projection writes the output first. True (shipped): the low-rank GEMM with
# the bias, then the base GEMM accumulating into it; False: the base GEMM with the bias, then the
# low-rank GEMM accumulating into that, 1% slower per Qwen-Image block (run 43). Benchmarks switch
# it (benchmarks/qwen_block_variants.py `lora_first=0|1`); the op reads it at run time.
LOW_RANK_FIRST = True


def _gemm_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                down: torch.Tensor | None = None, up: torch.Tensor | None = None) -> None:
    """out (M, N) = x (M, K) W^T + bias [+ (x down^T) up^T]: one GEMM writes out, the other
    accumulates into it in place (cuBLAS beta = 1), so the sum needs no pass of its own."""
    if down is not None and LOW_RANK_FIRST:
        _gemm_into(torch.mm(x, down.t()), up, bias, out)
        out.addmm_(x, weight.t())
        return
    _gemm_into(x, weight, bias, out)
    if down is not None:
        out.addmm_(torch.mm(x, down.t()), up.t())


@torch.library.custom_op("flowrl::lora_linear", mutates_args=())
def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor,
                up: torch.Tensor) -> torch.Tensor:
    """x (..., K) W^T + bias + (x down^T) up^T, (..., N), in x's dtype (all inputs in it)."""
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty((rows.shape[0], weight.shape[0]))
    linear_into(rows, weight, bias, out, down, up)
    return out.view(*x.shape[:-1], weight.shape[0])


@lora_linear.register_fake
def _(x, weight, bias, down, up):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))

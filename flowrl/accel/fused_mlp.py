"""GELU(tanh) applied inside the MLP's first GEMM (cuBLASLt epilogue) on CUDA.

SD3 and Qwen-Image MLPs are Linear -> GELU(tanh) -> Linear. Compiled, the GELU is a separate
kernel that reads and writes the 4x-wide activation; cuBLASLt can apply it to the accumulator
before the result leaves the GEMM, so that pass over the activation disappears
(benchmarks/qwen_block_parts.py times both).

`linear_gelu_tanh` is a custom op so that inductor keeps it as one opaque call (it would
otherwise split it back into GEMM + GELU). Forward and backward:
- CUDA: `torch._addmm_activation(..., use_gelu=True)` (tanh GELU in the epilogue); elsewhere
  the plain `gelu(linear(x), approximate="tanh")`, i.e. the unfused module's own math.
- Backward recomputes the pre-activation (one more GEMM) rather than keeping it: the same
  memory as the unfused MLP, which saves GELU's input.
Rollout and trainer call the same op, so their forwards stay bitwise equal (the log-prob parity
the trainer relies on).

`fuse_gelu_epilogues(module)` switches every diffusers FeedForward whose first layer is a tanh
GELU to the op, per instance (parameter names and state_dict unchanged). Where LoRA wraps the
projection, rollout graphs take the folded LoRA op with the GELU in its epilogue instead
(flowrl.accel.lora_fold.lora_linear_gelu_tanh). A call falls back to the module's own forward
when neither applies: the projection is not a biased nn.Linear (plain, or under a LoRA that
folds), its dtype differs from the input's, autocast is on (the plain op does not cast), or the
adapter was compiled with `gelu_epilogue=False` (flowrl.accel.options.AccelOptions).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from flowrl.accel.lora_fold import folded_gelu_forward
from flowrl.accel.options import AccelOptions


@torch.library.custom_op("flowrl::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        rows = x.reshape(-1, x.shape[-1])
        out = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


@linear_gelu_tanh.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    x, weight, bias = ctx.saved_tensors
    pre = F.linear(x, weight, bias)
    grad_pre = torch.ops.aten.gelu_backward(grad, pre, approximate="tanh")
    grad_x = grad_pre @ weight if ctx.needs_input_grad[0] else None
    flat = grad_pre.reshape(-1, grad_pre.shape[-1])
    grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = flat.sum(0) if ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


linear_gelu_tanh.register_autograd(_backward, setup_context=_setup_context)


def epilogue_applies(proj: torch.nn.Module, x: torch.Tensor, options: AccelOptions) -> bool:
    """Whether `linear_gelu_tanh` can stand for gelu_tanh(proj(x)): a plain biased nn.Linear
    (LoRA wraps it otherwise) in x's dtype, autocast off, `options.gelu_epilogue` on."""
    return (
        options.gelu_epilogue
        and type(proj) is torch.nn.Linear
        and proj.bias is not None
        and proj.weight.dtype == x.dtype
        and not torch.is_autocast_enabled(x.device.type)
    )


def gelu_tanh_projection(proj: torch.nn.Module, x: torch.Tensor, options: AccelOptions) -> torch.Tensor | None:
    """gelu_tanh(proj(x)) with the GELU in the GEMM's epilogue: `linear_gelu_tanh` where
    `epilogue_applies`, the folded LoRA op where `proj` is a LoRA projection a rollout graph folds
    (flowrl.accel.lora_fold.folded_gelu_forward); None where neither does."""
    if epilogue_applies(proj, x, options):
        return linear_gelu_tanh(x, proj.weight, proj.bias)
    return folded_gelu_forward(proj, x) if options.gelu_epilogue else None


def _fused_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    activated = gelu_tanh_projection(self.net[0].proj, hidden_states, self._flowrl_accel)
    if activated is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    hidden_states = activated
    for layer in self.net[1:]:
        hidden_states = layer(hidden_states)
    return hidden_states


def fuse_gelu_epilogues(module: torch.nn.Module, options: AccelOptions = AccelOptions()) -> int:
    """Route every tanh-GELU FeedForward under `module` through `linear_gelu_tanh` (unless
    `options.gelu_epilogue` is off); returns how many. Idempotent; a later call's options replace
    the earlier ones."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    count = 0
    for ff in module.modules():
        if isinstance(ff, FeedForward) and isinstance(ff.net[0], GELU) and ff.net[0].approximate == "tanh":
            ff.forward = types.MethodType(_fused_forward, ff)
            ff._flowrl_accel = options
            count += 1
    return count

"""The matrix products of a training forward + backward, replayed back to back: the training half
of benchmarks/floor.py.

A trainer's update runs each transformer forward with grad and then its backward. With the base
weights frozen (LoRA), the backward of a Linear is one GEMM, the input gradient dY W, and only
where the input depends on something trainable; each LoRA layer adds four small ones (dY B,
dh A, dY^T h, dh^T x) to its forward's two (x A^T, h B^T); attention's backward is one fused
kernel. Which of these a step needs is recorded, not assumed: one forward with grad, at the
trainer's setup (`flowrl.bench.models.make_trainable`), notes which inputs require grad, which
weights train and every scaled_dot_product_attention call. The replays then run those products
alone on buffers of the recorded shapes, so `floor / limit` says how close to the matmul peak a
step could come if everything between its matrix products were free.

Knows nothing about the trainer's loop or its compiled graphs: only shapes, weights and which
gradients autograd would compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from flowrl.run.flops import attention_flops


@dataclass
class LoraCall:
    """One call of a LoRA-adapted Linear: y = x W^T + (x A^T)(s B)^T."""

    module: torch.nn.Module  # peft's LoRA Linear (lora_A, lora_B, scaling, base_layer)
    rows: int
    input_requires_grad: bool
    output_used: bool = True  # the velocity depends on the output, so a backward reaches it

    def factors(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, s B) of the active adapters, concatenated along the rank, in `dtype`: the product
        the trainer's LoRA forward computes (flowrl.models.lora.forward_in_activation_dtype)."""
        downs, ups = [], []
        for name in self.module.active_adapters:
            if name in self.module.lora_A:
                downs.append(self.module.lora_A[name].weight)
                ups.append(self.module.lora_B[name].weight * self.module.scaling[name])
        return torch.cat(downs).to(dtype), torch.cat(ups, dim=1).to(dtype)

    @property
    def rank(self) -> int:
        return sum(
            self.module.lora_A[n].weight.shape[0] for n in self.module.active_adapters if n in self.module.lora_A
        )

    @property
    def forward_flops(self) -> int:
        base = self.module.base_layer
        return 2 * self.rows * self.rank * (base.in_features + base.out_features)

    @property
    def backward_flops(self) -> int:
        """dh = dY (s B) and the two weight gradients where a backward reaches the layer; dX += dh A
        where the input needs it too."""
        if not self.output_used:
            return 0
        base = self.module.base_layer
        dh_and_weights = 2 * self.rows * self.rank * (2 * base.out_features + base.in_features)
        return dh_and_weights + (2 * self.rows * self.rank * base.in_features if self.input_requires_grad else 0)


def is_lora_linear(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def mark_used_outputs(outputs, result: torch.Tensor) -> None:
    """Set each call's `output_used` from (call, its output's autograd node) pairs: whether a
    backward from `result` reaches that node. Autograd runs nothing for an output the result does
    not depend on (a last block's text stream, say), so neither does the replay."""
    reachable, stack = set(), [result.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in reachable:
            continue
        reachable.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    for call, node in outputs:
        call.output_used = node is not None and node in reachable


_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass
class SdpaCall:
    """One F.scaled_dot_product_attention call by keyword: q, k and v as ("tensor", shape, stride,
    dtype), a mask kept as it is (its values matter), the rest as given."""

    kwargs: dict

    @property
    def forward_flops(self) -> int:
        q, k, v = (self.kwargs[name][1] for name in _SDPA_ARGUMENTS[:3])
        return attention_flops(q, k, v)


class SdpaRecorder(TorchFunctionMode):
    """Records every F.scaled_dot_product_attention call without changing it."""

    def __init__(self, calls: list[SdpaCall]):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            named = {**dict(zip(_SDPA_ARGUMENTS, args)), **kwargs}
            spec = {}
            for name, value in named.items():
                if name in _SDPA_ARGUMENTS[:3]:
                    value = tensor_spec(value)
                elif isinstance(value, torch.Tensor):
                    value = ("kept", value.detach())
                spec[name] = value
            self.calls.append(SdpaCall(spec))
        return func(*args, **kwargs)


def tensor_spec(t: torch.Tensor) -> tuple:
    """("tensor", shape, stride, dtype): a recorded tensor whose values the replay draws anew."""
    return ("tensor", tuple(t.shape), tuple(t.stride()), t.dtype)


def materialize(spec, device, requires_grad: bool = False):
    """A recorded argument back as a value: a `tensor_spec` as a tensor of that layout (random
    values if floating point, zeros otherwise), a kept tensor as it was, anything else as given."""
    if isinstance(spec, tuple) and spec and spec[0] == "kept":
        return spec[1].to(device)
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        _, shape, stride, dtype = spec
        t = torch.empty_strided(shape, stride, device=device, dtype=dtype)
        if not dtype.is_floating_point:
            return t.zero_()
        t.copy_(torch.randn(shape, device=device, dtype=torch.float32))
        return t.requires_grad_(requires_grad)
    return spec


def attention_train_replay(calls: list[SdpaCall], device):
    """A callable running each recorded attention call forward and backward (input gradients of
    q, k and v, from an output gradient of the output's layout), as autograd runs it."""
    plan = []
    for call in calls:
        kwargs = {
            name: materialize(spec, device, requires_grad=name in _SDPA_ARGUMENTS[:3])
            for name, spec in call.kwargs.items()
        }
        with torch.no_grad():
            out = F.scaled_dot_product_attention(**kwargs)
        plan.append((kwargs, torch.randn_like(out)))

    @torch.enable_grad()
    def run():
        for kwargs, grad in plan:
            out = F.scaled_dot_product_attention(**kwargs)
            torch.autograd.grad(out, (kwargs["query"], kwargs["key"], kwargs["value"]), grad)

    return run


class Buffers:
    """Random buffers of the run's dtype by shape, shared by the calls that read one."""

    def __init__(self, device, dtype):
        self.device, self.dtype, self.cache = device, dtype, {}

    def __call__(self, *shape: int) -> torch.Tensor:
        if shape not in self.cache:
            self.cache[shape] = torch.randn(shape, device=self.device, dtype=self.dtype)
        return self.cache[shape]


def linear_backward_replay(groups, device, dtype):
    """A callable running each Linear group's backward GEMMs: dX = dY W where the input requires
    grad, dW = dY^T X where the weight trains. `groups` are floor.py's (calls sharing one input,
    concatenated weight) pairs. Returns (callable, GEMM count, FLOPs)."""
    buffers = Buffers(device, dtype)
    plan, gemms, flops = [], 0, 0
    for calls, weight in groups:
        rows, k = calls[0].rows, calls[0].module.in_features
        needs_dx = any(c.input_requires_grad and c.output_used for c in calls)
        needs_dw = any(c.module.weight.requires_grad and c.output_used for c in calls)
        if not (needs_dx or needs_dw):
            continue
        dy, x = buffers(rows, weight.shape[0]), buffers(rows, k)
        plan.append((dy, x, weight.to(dtype), needs_dx, needs_dw))
        gemms += needs_dx + needs_dw
        flops += (needs_dx + needs_dw) * 2 * rows * k * weight.shape[0]

    def run():
        for dy, x, weight, needs_dx, needs_dw in plan:
            if needs_dx:
                torch.mm(dy, weight)
            if needs_dw:
                torch.mm(dy.t(), x)

    return run, gemms, flops


def lora_replays(calls: list[LoraCall], device, dtype):
    """Two callables: the LoRA factors' forward GEMMs (x A^T, then the output accumulated with
    h (s B)^T, as the base GEMM's output is added to) and their backward GEMMs (dh = dY (s B),
    dX += dh A where the input needs it, d(sB) = dY^T h, dA = dh^T x)."""
    inputs, outputs = Buffers(device, dtype), Buffers(device, dtype)
    plan = []
    for call in calls:
        down, up = call.factors(dtype)
        base = call.module.base_layer
        x, dy = inputs(call.rows, base.in_features), inputs(call.rows, base.out_features)
        h = inputs(call.rows, down.shape[0])
        y, dx = outputs(call.rows, base.out_features), outputs(call.rows, base.in_features)
        plan.append((x, dy, h, y, dx, down, up, call))

    def forward():
        for x, _, _, y, _, down, up, _ in plan:
            y.addmm_(torch.mm(x, down.t()), up.t())

    def backward():
        for x, dy, h, _, dx, down, up, call in plan:
            if not call.output_used:
                continue  # the backward never reaches this layer
            dh = torch.mm(dy, up)
            if call.input_requires_grad:
                dx.addmm_(dh, down)
            torch.mm(dy.t(), h)
            torch.mm(dh.t(), x)

    return forward, backward

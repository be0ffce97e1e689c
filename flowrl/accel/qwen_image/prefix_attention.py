"""Joint attention of a batch whose rows have text of different lengths, without a mask: one
attention call per run of rows with the same text length, each on the keys its rows see.

A batch pads every row's text to the longest, and diffusers masks the padding out of the keys with
a (B, 1, 1, L) boolean mask. A CFG batch always has padding: the negative prompt is shorter than
the prompts. cuDNN runs masked attention well below its unmasked rate at Qwen-Image's sizes
(docs/performance.md, "Attention per run of text lengths"; `bash benchmarks/gpu_suites.sh
qwen-text-mask-attention`).

The sequence-major block (flowrl.accel.qwen_image.block) orders the joint sequence image first,
then text, with a row's valid text tokens first within its text. The keys a row sees are then the
first `image tokens + its text length` of the sequence: a prefix. So each run of consecutive rows
with one text length is one unmasked call on a slice of the key and value buffers (views, no
copy). Queries are all tokens of every row, as with the mask: a padded text token's query attends
to the same keys as the mask lets it (its output is never read by an image token). Masked keys get
exactly zero weight either way, so the result is the masked attention's up to the rounding of the
shorter sums.

`attention(q, k, v, lengths, key_offset)` takes (B, H, S, D) views of sequence-major (S, B, H, D)
buffers and each row's text length as a CPU int64 tensor (row b sees its first key_offset +
lengths[b] keys), so the runs are found on the host without waiting for the GPU; the blocks get the
lengths from the adapter, which knows every prompt's length (`TEXT_LENGTHS_KEY`), and the image
token count as the offset. The two custom ops keep the call whole inside compiled graphs: the forward
writes the runs' outputs (and their log-sum-exps, for the backward) into one buffer in q's layout;
the backward runs each run's backward and gives the keys past a row's prefix zero gradient. On
CUDA each call is cuDNN's attention kernel (where PyTorch can run it: `applies`), on a CPU
PyTorch's flash kernel for CPUs. Many short runs would each launch a small call, so beyond
`MAX_RUNS` runs the adapter's hook passes no lengths and the block keeps the masked call
(`few_runs`: decided on the host, outside the compiled graphs, which read no tensor's values).

Where it runs: the rollout's forwards (no grad), where a block of the Qwen-Image recipe gains by
it (`bash benchmarks/gpu_suites.sh qwen-prefix-attention-ab`). At the trainer's micro-batch the
kernels gain less than the runs' host time and copies cost, so training forwards keep the masked
call (flowrl.accel.qwen_image.TransformerCallHook).
"""

from __future__ import annotations

import torch

# The key under which the blocks find each row's text length in `joint_attention_kwargs`.
TEXT_LENGTHS_KEY = "flowrl_text_lengths"

# Above this many runs of equal text lengths in a batch, the block keeps the masked call (each run
# is an attention call of its own; the rollout's CFG batch of several prompts has a few).
MAX_RUNS = 8


def runs(lengths: torch.Tensor | list[int]) -> list[tuple[int, int, int]]:
    """(first row, end row, length) of each run of consecutive rows with equal lengths."""
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    out, start = [], 0
    for row in range(1, len(values) + 1):
        if row == len(values) or values[row] != values[start]:
            out.append((start, row, values[start]))
            start = row
    return out


def few_runs(lengths: list[int]) -> bool:
    """Whether a batch with these text lengths (host ints) has at most MAX_RUNS runs."""
    return len(runs(lengths)) <= MAX_RUNS


def applies(q: torch.Tensor) -> bool:
    """Whether `attention` can run on q: a kernel that returns its log-sum-exp (cuDNN's on a CUDA
    device where PyTorch enables it, with a head width it takes; the flash kernel on a CPU). Reads
    only q's device, dtype and shape, so compiled graphs decide it when they are traced."""
    if q.device.type == "cpu":
        return True
    return (
        q.device.type == "cuda"
        and torch.backends.cuda.cudnn_sdp_enabled()
        and torch.cuda.get_device_capability(q.device) >= (9, 0)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] <= 128
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, key_offset: int = 0
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v of (B, H, S, D) views, row b attending to its first
    key_offset + lengths[b] keys; the output in q's memory layout. Call where `applies`."""
    return torch.ops.flowrl.prefix_attention(q, k, v, lengths, key_offset)[0]


def _sequence_major_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised (B, H, S, D) view of a new (S, B, H, D) buffer: the blocks' layout."""
    batch, heads, tokens, dim = t.shape
    return t.new_empty((tokens, batch, heads, dim)).permute(1, 2, 0, 3)


def _outputs_like(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output buffer (sequence-major) and a (B, H, S) float32 log-sum-exp buffer."""
    return _sequence_major_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _forward(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """One unmasked call: (output, log-sum-exp (B, H, S) float32)."""
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return out, lse.reshape(q.shape[:3])


def _backward(grad_out, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One unmasked call's gradients of q, k, v."""
    if q.device.type == "cuda":
        empty = q.new_empty(0)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse.unsqueeze(-1),
            empty,
            empty,
            None,
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            False,
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, False)


@torch.library.custom_op("flowrl::prefix_attention", mutates_args=())
def prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, key_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in q's layout, log-sum-exp (B, H, S) float32) of `attention`."""
    out, lse = _outputs_like(q)
    for start, end, length in runs(lengths):
        keys = key_offset + length
        run_out, run_lse = _forward(q[start:end], k[start:end, :, :keys], v[start:end, :, :keys])
        out[start:end].copy_(run_out)
        lse[start:end].copy_(run_lse)
    return out, lse


@prefix_attention.register_fake
def _(q, k, v, lengths, key_offset):
    return _outputs_like(q)


@torch.library.custom_op("flowrl::prefix_attention_backward", mutates_args=())
def prefix_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lengths: torch.Tensor,
    key_offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v (in their layouts); keys past a row's prefix get zero."""
    if grad_out.stride() != out.stride():  # the kernels take it in the output's layout
        grad_out = _sequence_major_like(grad_out).copy_(grad_out)
    grads = _gradients_like(q, k, v)
    for start, end, length in runs(lengths):
        rows, keys = slice(start, end), key_offset + length
        run_grads = _backward(
            grad_out[rows],
            q[rows],
            k[rows, :, :keys],
            v[rows, :, :keys],
            out[rows],
            lse[rows],
        )
        grads[0][rows].copy_(run_grads[0])
        for full, run_grad in zip(grads[1:], run_grads[1:]):
            full[rows, :, :keys].copy_(run_grad)
            full[rows, :, keys:].zero_()
    return grads


def _gradients_like(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_sequence_major_like(t) for t in (q, k, v))


@prefix_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, lengths, key_offset):
    return _gradients_like(q, k, v)


def _setup_context(ctx, inputs, output):
    q, k, v, lengths, key_offset = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.lengths, ctx.key_offset = lengths, key_offset


def _backward_of_op(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flowrl.prefix_attention_backward(grad_out, q, k, v, out, lse, ctx.lengths, ctx.key_offset)
    return dq, dk, dv, None, None


prefix_attention.register_autograd(_backward_of_op, setup_context=_setup_context)

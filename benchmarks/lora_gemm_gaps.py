"""Where the rollout's GPU waits: the LoRA projections of one Qwen-Image block, alone, eager.

The Qwen-Image recipe's profiled rollout (docs/performance.md) idled 1.6 s of 19 s in gaps of
0.1-10 ms, about three per block, each ended by one of two cuBLAS GEMMs of the folded LoRA
projections, while the launching thread was inside those GEMMs' launches. Bounding how far the
host ran ahead did not change the rollout's time. This script runs just the projections of a
block (its 12 LoRA linears: q, k, v, out and the MLP's two, per stream, at the recipe's rollout
rows) several ways, each profiled, and reports per way the time per block, how busy the GPU was,
the gaps of 0.1 ms or more by the kernel that ended them (and the host op that launched it), and
those gaps by when that kernel's launch call returned (before the gap began: the GPU idled with
the kernel queued; inside it: the GPU waited for the host, and the call's own share of the gap
says whether the host was blocked in it):

- folded: the rollout's op (flowrl.accel.lora_fold.linear_into: x A^T, the low-rank GEMM with the
  bias into the output, the base GEMM accumulating into it);
- folded-base-first: the same with the base GEMM first and the low-rank one accumulating;
- unfolded: base GEMM, low-rank GEMMs and an add, as the training graphs compute it;
- base-only: the base GEMMs without LoRA;
- folded-synced-N: folded, the host waiting for the GPU after every N projections;
- folded-B-blocks: folded, B blocks queued at once (as the rollout's 60 blocks a forward), so that
  the host runs far enough ahead to block on the driver's full command buffer; with -ahead-N the
  host waits before each block until at most N blocks are still queued;
- attention+folded: the block's joint attention (SDPA over text and image tokens) before the
  folded projections, as in the block, where the projections' inputs come from it;
- masked-attention+folded: the same attention as the block runs it: sequence-major q, k, v
  ((L, B, H, Dh) in memory), a boolean key mask over the text tokens (half the rows padded, as a
  CFG batch's short negative prompts are), SDPA's own backend choice, and the two output
  projections reading their rows of its output in place; masked-cudnn-attention+folded and
  masked-efficient-attention+folded force SDPA's cuDNN and memory-efficient backends.

Each long gap is also reported with the kernel that most often ran just before it.

    python benchmarks/lora_gemm_gaps.py                     # on a GPU, the recipe's shapes
    python benchmarks/lora_gemm_gaps.py --device cpu --rows 1 --image-tokens 16 --text-tokens 8 \\
        --width 32 --mlp-width 64 --rank 4 --blocks 2      # a smoke run
"""

from __future__ import annotations

import argparse
import time

import torch

from flowrl.accel.lora_fold import linear_into
from flowrl.bench.step_profile import profile_gaps
from flowrl.bench.summary import kernels_after_gaps_text, launch_split_text

MODES = (
    "folded",
    "folded-base-first",
    "unfolded",
    "base-only",
    "attention+folded",
    "masked-attention+folded",
    "masked-cudnn-attention+folded",
    "masked-efficient-attention+folded",
)
# SDPA backends the masked modes force (None: SDPA's own choice)
_MASKED_BACKENDS = {
    "masked-attention+folded": None,
    "masked-cudnn-attention+folded": "CUDNN_ATTENTION",
    "masked-efficient-attention+folded": "EFFICIENT_ATTENTION",
}
HEAD_DIM = 128


def _projections(width: int, mlp_width: int) -> list[tuple[int, int]]:
    """(in, out) of a stream's LoRA linears: q, k, v, out, the MLP's up and down projections."""
    return [(width, width)] * 4 + [(width, mlp_width), (mlp_width, width)]


def build(args, device, dtype):
    """The block's attention inputs (q, k, v over text and image tokens), and per stream and
    linear: the input rows, the weights and the LoRA factors."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype)

    heads = max(1, args.width // HEAD_DIM)
    head_dim = args.width // heads
    tokens = args.image_tokens + args.text_tokens
    qkv = [rand(args.rows, heads, tokens, head_dim) for _ in range(3)]
    # the block's layout when this was measured: (L, B, H, Dh) in memory, text rows first, a key mask over the text
    # tokens with the second half of the rows padded to half their text length
    joint = [rand(tokens, args.rows, heads, head_dim) for _ in range(3)]
    mask = torch.ones(args.rows, tokens, dtype=torch.bool, device=device)
    mask[args.rows // 2 :, args.text_tokens // 2 : args.text_tokens] = False
    masked = (joint, mask[:, None, None, :], args.text_tokens)
    layers = []
    for tokens in (args.image_tokens, args.text_tokens):
        rows = args.rows * tokens
        inputs = {k: rand(rows, k) for k in {args.width, args.mlp_width}}
        for k, n in _projections(args.width, args.mlp_width):
            layers.append((inputs[k], rand(n, k), rand(n), rand(args.rank, k), rand(n, args.rank)))
    return qkv, masked, layers


def _masked_attention(masked, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's joint attention (flowrl.accel.qwen_image.block._joint_attention): its output's
    image and text rows, (L_img * B, D) and (L_txt * B, D), views where SDPA kept q's layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    (q, k, v), mask, text_tokens = masked
    views = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    if backend is None:
        out = torch.nn.functional.scaled_dot_product_attention(*views, attn_mask=mask)
    else:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = torch.nn.functional.scaled_dot_product_attention(*views, attn_mask=mask)
    out = out.permute(2, 0, 1, 3).flatten(2)
    return out[text_tokens:].reshape(-1, out.shape[-1]), out[:text_tokens].reshape(-1, out.shape[-1])


def run_block(block, mode: str, sync_every: int | None = None) -> list[torch.Tensor]:
    qkv, masked, layers = block
    outs = []
    if mode == "attention+folded":
        outs.append(torch.nn.functional.scaled_dot_product_attention(*qkv))
        mode = "folded"
    if mode in _MASKED_BACKENDS:
        # the output projections (each stream's 4th linear) read the attention's rows
        img_rows, txt_rows = _masked_attention(masked, _MASKED_BACKENDS[mode])
        per_stream = len(layers) // 2
        layers = list(layers)
        for index, rows in ((3, img_rows), (per_stream + 3, txt_rows)):
            layers[index] = (rows, *layers[index][1:])
        mode = "folded"
    for i, (x, weight, bias, down, up) in enumerate(layers):
        if mode == "base-only":
            outs.append(torch.nn.functional.linear(x, weight, bias))
        elif mode == "unfolded":
            outs.append(torch.nn.functional.linear(x, weight, bias) + (x @ down.t()) @ up.t())
        else:
            out = x.new_empty((x.shape[0], weight.shape[0]))
            linear_into(x, weight, bias, out, down, up, low_rank_first=mode != "folded-base-first")
            outs.append(out)
        if sync_every and (i + 1) % sync_every == 0:
            torch.cuda.synchronize()
    return outs


def measure(block, mode: str, blocks: int, device, sync_every: int | None = None, ahead: int | None = None) -> dict:
    """Profile `blocks` calls of run_block; with `ahead`, the host waits before each call until
    the GPU has finished all but the last `ahead` calls it queued."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    run_block(block, mode, sync_every)  # warm-up: cuBLAS handles, heuristics, workspace
    if on_gpu:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    queued: list = []
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(blocks):
            if ahead and len(queued) >= ahead:
                queued.pop(0).synchronize()
            run_block(block, mode, sync_every)
            if ahead:
                queued.append(torch.cuda.Event())
                queued[-1].record()
        if on_gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    result = {"ms_per_block": seconds / blocks * 1000}
    if on_gpu:
        events = prof.events()
        result.update(profile_gaps(events, top=4) or {})
        result["idle_ms"] = result.get("idle_ms", 0.0) / blocks
        # the host blocked in a launch because the driver's command buffer was full
        result["command_buffer_full_ms"] = (
            sum(e.time_range.end - e.time_range.start for e in events if e.name == "Command Buffer Full") / 1000
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=64, help="rows per forward (the recipe's 32 samples x CFG)")
    parser.add_argument("--image-tokens", type=int, default=1024)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--mlp-width", type=int, default=12288)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--sync-every", type=int, nargs="*", default=[1, 3], help="folded-synced-N variants")
    parser.add_argument("--deep-blocks", type=int, default=60, help="blocks of the host-far-ahead variants")
    parser.add_argument(
        "--ahead", type=int, nargs="*", default=[1, 3], help="folded-...-ahead-N variants: at most N blocks queued"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = build(args, device, dtype)
    reference = run_block(block, "unfolded")
    # the forced backends are CUDA's
    variants = [(mode, None) for mode in MODES if device.type == "cuda" or not _MASKED_BACKENDS.get(mode)]
    for mode, _ in variants:
        got = run_block(block, mode)
        if mode == "attention+folded":
            got = got[1:]
        if mode != "base-only" and mode not in _MASKED_BACKENDS:  # the masked modes change two inputs
            err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, reference))
            print(f"{mode}: max relative difference to unfolded {err:.2e}")
    variants = [(mode, mode, None, args.blocks, None) for mode, _ in variants]
    if device.type == "cuda":
        variants += [(f"folded-synced-{n}", "folded", n, args.blocks, None) for n in args.sync_every]
        # the host far ahead of the GPU, as in the rollout, where launches block on a full command buffer
        variants += [(f"folded-{args.deep_blocks}-blocks", "folded", None, args.deep_blocks, None)]
        variants += [
            (f"folded-{args.deep_blocks}-blocks-ahead-{n}", "folded", None, args.deep_blocks, n) for n in args.ahead
        ]
    for name, mode, sync_every, blocks, ahead in variants:
        r = measure(block, mode, blocks, device, sync_every, ahead)
        line = f"{name:22s} {r['ms_per_block']:8.2f} ms per block"
        if "gpu_busy" in r:
            line += (
                f", GPU busy {r['gpu_busy']:.1%}, idle {r['idle_ms']:.2f} ms per block, host in Command Buffer Full "
                f"{r['command_buffer_full_ms']:.0f} ms"
            )
            line += kernels_after_gaps_text(r["kernels_after_long_gaps_ms"]) or "; no gap of 0.1 ms or more"
            line += launch_split_text(r["long_gaps_by_launch"])
        print(line, flush=True)


if __name__ == "__main__":
    main()

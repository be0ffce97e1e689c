"""FLOPs of one configuration, counted once, and the matmul peak of the machine, measured.

- `transformer_flops_per_row`: FLOPs of one transformer forward for ONE row (one image or video, cond only)
  at the benchmark's image size and prompt length, counted by torch.utils.flop_counter (matmuls,
  convolutions and attention). A step costs rows x this; a CFG sample has two rows.
- `decode_flops_per_image`: FLOPs of one VAE decode (of a video's every frame).
- `count_flops`: FLOPs of any callable (forward + backward for a training step).
- `measure_matmul_peak`: a large square matmul in the model dtype, timed the benchmark's way
  (warm-up, synchronize, repeats): a short burst and a sustained run. On a power-capped card the
  sustained figure, well below the burst, is the realistic 100%.

MFU = achieved FLOP/s / measured sustained peak.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

from flowrl.models.base import FlowModelAdapter


def attention_flops(query_shape, key_shape, value_shape) -> int:
    """One attention's matrix products, q @ k^T and attn @ v: 2 * b * h * Lq * Lk * (d_qk + d_v)."""
    *batch, lq, d = query_shape
    lk, dv = key_shape[-2], value_shape[-1]
    heads = 1
    for size in batch:
        heads *= size
    return 2 * heads * lq * lk * (d + dv)


def _sdpa_shape_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return attention_flops(query_shape, key_shape, value_shape)


def _extra_formulas() -> dict:
    # The CPU fused attention kernel has no formula in torch's table; GPU kernels (flash,
    # efficient, cuDNN) do. Without this, CPU counts would miss attention.
    aten = torch.ops.aten
    extra = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        extra[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_shape_flops
    return extra


def count_flops(fn) -> int:
    """Total FLOPs of the ops `fn()` dispatches (forward, and backward if it runs one).

    Compiled modules run eagerly here (the same ops): dynamo meeting the counter's dispatch mode
    gave up on the code object every regionally compiled block shares, and every later call of
    those blocks ran eager (a profile taken after a count showed eager kernels only)."""
    with (
        torch.compiler.set_stance("force_eager"),
        FlopCounterMode(display=False, custom_mapping=_extra_formulas()) as counter,
    ):
        fn()
    return int(counter.get_total_flops())


def _frames(adapter: FlowModelAdapter, num_frames: int) -> dict:
    """`latent_shape`'s frame argument: none for an image family, the frame count for a video one."""
    return adapter.frame_kwargs(SimpleNamespace(num_frames=num_frames))


@torch.no_grad()
def transformer_flops_per_row(
    adapter: FlowModelAdapter,
    height: int,
    width: int,
    prompt: str = "a photo",
    num_frames: int = 1,
    sigma: float = 0.5,
) -> int:
    encodings = adapter.encode_prompts([prompt])
    latents = torch.randn(
        (1, *adapter.latent_shape(height, width, **_frames(adapter, num_frames))), device=adapter.device
    )
    sigma = torch.full((1,), sigma, device=adapter.device)
    cfg_scale = torch.ones(1, device=adapter.device)
    guidance = adapter.guidance_embedding_kwargs(torch.ones(1, device=adapter.device))
    return count_flops(
        lambda: adapter.velocity(latents, sigma, encodings, [None], cfg_scale, height, width, **guidance)
    )


@torch.no_grad()
def decode_flops_per_image(adapter: FlowModelAdapter, height: int, width: int, num_frames: int = 1) -> int:
    latents = torch.randn(
        (1, *adapter.latent_shape(height, width, **_frames(adapter, num_frames))), device=adapter.device
    )
    return count_flops(lambda: adapter.decode(latents, height, width))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    device: torch.device,
    dtype: torch.dtype,
    size: int | None = None,
    burst_repeats: int = 10,
    sustain_seconds: float = 3.0,
) -> dict:
    """Matmul FLOP/s: `burst` (mean of burst_repeats products after 3 warm-ups) and `sustained`
    (products back to back for about sustain_seconds, after the burst). Random data, not zeros
    (zeros run faster). Size defaults to 8192 on a GPU and 1024 on a CPU."""
    device = torch.device(device)
    if size is None:
        size = 8192 if device.type == "cuda" else 1024
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((size, size), device=device, dtype=dtype, generator=gen)
    b = torch.randn((size, size), device=device, dtype=dtype, generator=gen)
    flops = 2 * size**3
    for _ in range(3):
        torch.mm(a, b)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(burst_repeats):
        torch.mm(a, b)
    synchronize(device)
    burst = flops * burst_repeats / (time.perf_counter() - t0)
    # Sustained: enough products for ~sustain_seconds at the burst rate, timed as one block.
    count = max(burst_repeats, int(sustain_seconds * burst / flops))
    t0 = time.perf_counter()
    for _ in range(count):
        torch.mm(a, b)
    synchronize(device)
    sustained = flops * count / (time.perf_counter() - t0)
    return {
        "size": size,
        "dtype": str(dtype).replace("torch.", ""),
        "burst_flops": burst,
        "sustained_flops": sustained,
        "sustained_products": count,
    }

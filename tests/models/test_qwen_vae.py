"""Qwen-Image VAE decode as 2D convolutions (flowrl.models.qwen_vae): the same images as the stock
causal-3D decode for a single frame, about a third of the FLOPs, and the stock path everywhere
the shortcut does not hold (outside the adapter's decode, videos, cached chunks)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flowrl.models.qwen_vae import decode_single_frames_in_2d, single_frame_2d


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    model = AutoencoderKLQwenImage(
        base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    with torch.no_grad():  # non-trivial weights everywhere (conv_out etc. would otherwise be small)
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(std=0.05)
    return model


def _decode(vae, z):
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


def _flops_and_padded_conv3d_calls(fn):
    """FLOPs of fn, and how many 3D convolutions it ran (the stock path's, over zero-padded frames)."""
    calls = []
    original = torch.nn.Conv3d._conv_forward

    def recording(self, x, weight, bias):
        calls.append(1)
        return original(self, x, weight, bias)

    torch.nn.Conv3d._conv_forward = recording
    try:
        with FlopCounterMode(display=False) as counter:
            fn()
    finally:
        torch.nn.Conv3d._conv_forward = original
    return counter.get_total_flops(), len(calls)


def test_single_frame_decode_matches_stock_with_a_third_of_the_conv_flops(vae):
    fast = copy.deepcopy(vae)
    keys = list(fast.state_dict())
    assert decode_single_frames_in_2d(fast) > 0
    assert decode_single_frames_in_2d(fast) == 0  # idempotent
    assert list(fast.state_dict()) == keys
    z = torch.randn(2, 16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    reference = _decode(vae, z)
    stock_flops, stock_conv3d = _flops_and_padded_conv3d_calls(lambda: _decode(fast, z))
    with single_frame_2d():
        flops_2d, conv3d_2d = _flops_and_padded_conv3d_calls(lambda: _decode(fast, z))
        out = _decode(fast, z)
    assert reference.abs().mean() > 1e-2
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    # Outside the context the switched modules are stock: same FLOPs as the unswitched VAE, and
    # every 3x3x3 convolution still runs over zero-padded frames.
    assert stock_conv3d > 0 and conv3d_2d == 0
    assert stock_flops == _flops_and_padded_conv3d_calls(lambda: _decode(vae, z))[0]
    assert flops_2d < 0.45 * stock_flops, (flops_2d, stock_flops)


def test_videos_and_cached_chunks_take_the_stock_path(vae):
    fast = copy.deepcopy(vae)
    decode_single_frames_in_2d(fast)
    z = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with single_frame_2d():
        out = _decode(fast, z)  # frame 0 is a single uncached frame (2D); frames 1-2 use the cache
    reference = _decode(vae, z)
    assert out.shape == reference.shape == (1, 3, 9, 64, 64)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)


def test_qwen_adapter_decodes_in_2d_and_leaves_the_pipeline_stock(tiny_qwen_path):
    from flowrl.models import load_adapter

    adapter = load_adapter(tiny_qwen_path)
    latents = torch.randn((2, *adapter.latent_shape(64, 64)), generator=torch.Generator().manual_seed(3))
    with FlopCounterMode(display=False) as counter:
        images = adapter.decode(latents, 64, 64)
    h, w = adapter._latent_hw(64, 64)
    z = adapter.unpack(latents, h, w)[:, :, None]  # latents_mean 0, std 1 in the tiny config
    stock_flops, _ = _flops_and_padded_conv3d_calls(lambda: _decode(adapter.vae, z))
    reference = ((_decode(adapter.vae, z)[:, :, 0] / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    assert images.dtype == torch.uint8 and images.shape == reference.shape
    assert (images.int() - reference.int()).abs().max() <= 1
    assert counter.get_total_flops() < 0.45 * stock_flops
